"""Small gradients staged and reduced in one batched pass give the same statistics as the
per-hook reductions that larger gradients get."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
import graddebug_torch.adapter as torch_adapter  # noqa: E402
import graddebug_torch.step as torch_step  # noqa: E402
from graddebug_torch.staging import SmallGrads  # noqa: E402
from torch_models import ResCNN  # noqa: E402


class _Twice(nn.Module):
    """One Linear called twice (its rows pool both calls), a ReLU with dead units, and a
    tap whose gradient turns NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.relu = nn.ReLU()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.relu(self.fc(self.relu(self.fc(x)))))


def _run(model: nn.Module, x: torch.Tensor, nan: bool = False) -> pd.DataFrame:
    with graddebug.watch(model, full_stats_every=1) as dbg:  # every step, both paths
        for _ in range(2):
            out = model(x)
            if nan:
                h = dbg.tap(out * 1.0, "h")
                out = torch.sqrt(h - h)  # sqrt at 0: inf * 0 = NaN in backward
            out.sum().backward()
            dbg.step()
            model.zero_grad()
    return dbg.frame()


def _unstaged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SmallGrads, "fits", staticmethod(lambda grad: False))
    monkeypatch.setattr(torch_adapter, "SMALL_NUMEL", -1)
    monkeypatch.setattr(torch_step, "SMALL_NUMEL", -1)


@pytest.mark.parametrize("case", ["cnn", "twice", "nan"])
def test_staged_statistics_equal_per_hook_statistics(case, monkeypatch):
    torch.manual_seed(0)
    if case == "cnn":
        model, x = ResCNN(channels=4), torch.randn(2, 3, 8, 8)
    else:
        model, x = _Twice(), torch.randn(3, 6)
    staged = _run(copy.deepcopy(model), x, nan=case == "nan")
    _unstaged(monkeypatch)
    direct = _run(copy.deepcopy(model), x, nan=case == "nan")
    assert len(staged) == len(direct) > 0
    pd.testing.assert_frame_equal(staged.drop(columns=["norm", "mean", "std", "absmax"]),
                                  direct.drop(columns=["norm", "mean", "std", "absmax"]))
    for column in ("norm", "mean", "std", "absmax"):
        np.testing.assert_allclose(staged[column], direct[column], rtol=1e-5, atol=1e-7,
                                   equal_nan=True)
    if case == "twice":
        fc = staged.query("layer == 'fc' and kind == 'activation'")
        assert (fc["numel"] == 2 * 3 * 6).all()  # both calls pooled into one row a step
    if case == "nan":
        assert staged.query("layer == 'h'")["nan"].all()


def test_staged_norm_matches_an_independent_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    x = torch.randn(3, 4)
    with graddebug.watch(model) as dbg:
        model(x).pow(2).sum().backward()
        dbg.step()
    h = model[0](x)
    (dh,) = torch.autograd.grad(model[2](model[1](h)).pow(2).sum(), h)
    row = dbg.frame().query("layer == '0' and kind == 'activation'")
    assert row["norm"].item() == pytest.approx(dh.norm().item(), rel=1e-6)
    assert row["absmax"].item() == pytest.approx(dh.abs().max().item(), rel=1e-6)
    assert row["mean"].item() == pytest.approx(dh.mean().item(), rel=1e-5, abs=1e-8)
