"""Tiered statistics in the torch adapter: sentinel steps measure the norm and the mean of
layer-output gradients, full steps their extremes too. References: ``torch.autograd.grad`` on
the same intermediate tensors."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import graddebug
from graddebug_torch.staging import SMALL_NUMEL
from torch_models import batches, relu_mlp

STEPS = 12


def reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient at every module's output, by ``torch.autograd.grad``."""
    outputs = []
    h = x
    for module in model:
        h = module(h)
        outputs.append(h)
    grads = torch.autograd.grad(F.cross_entropy(h, y), outputs)
    return {str(i): g for i, g in enumerate(grads)}


def watched(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
            **options: object) -> pd.DataFrame:
    """Layer-output rows of one step per batch (weights unchanged: no optimizer)."""
    with graddebug.watch(model, **options) as dbg:
        for x, y in data:
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dbg.step()
    frame = dbg.frame()
    # small gradients are reduced in one batched pass at the step's close, in full every step
    return frame[(frame["kind"] == "activation") & (frame["numel"] > SMALL_NUMEL)]


def test_sentinel_steps_measure_norm_and_mean_and_leave_the_extremes_nan() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=128, inputs=64)  # outputs of 64 x 128: not staged
    data = batches(STEPS, (64, 64))
    rows = watched(model, data)
    full = sorted(set(rows.loc[rows["absmax"].notna(), "step"]))
    assert full == [0, 10]
    for step, (x, y) in enumerate(data):
        expected = reference(model, x, y)
        for _, row in rows[rows["step"] == step].iterrows():
            g = expected[row["layer"]].double()
            assert row["norm"] == pytest.approx(float(g.norm()), rel=1e-5)
            assert row["mean"] == pytest.approx(float(g.mean()), rel=1e-4, abs=1e-9)
            assert row["std"] == pytest.approx(float(g.std(correction=0)), rel=1e-4)
            assert not row["nan"] and not row["inf"]
            if step in full:
                assert row["absmax"] == pytest.approx(float(g.abs().max()), rel=1e-6)
                dead = float((g.abs().amax(0) == 0).double().mean())
                assert row["zero_frac"] == pytest.approx(dead)
            else:
                assert math.isnan(row["absmax"]) and math.isnan(row["zero_frac"])


def test_full_stats_every_1_keep_and_every_measure_everything() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=128, inputs=64)
    data = batches(4, (64, 64))
    assert watched(model, data, full_stats_every=1)["absmax"].notna().all()
    kept = watched(model, data, keep=["0"])
    assert kept.loc[kept["layer"] == "0", "absmax"].notna().all()
    assert kept.loc[(kept["layer"] == "2") & (kept["step"] > 0), "absmax"].isna().all()
    assert len(kept[kept["layer"] == "2"]) == 4
    assert watched(model, data, every=2)["absmax"].notna().all()


class SqrtAt(nn.Module):
    """Finite forward; at ``bad_call``, sqrt at 0 gives inf * 0 = NaN in backward."""

    def __init__(self, bad_call: int) -> None:
        super().__init__()
        self.bad_call, self.calls = bad_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 != self.bad_call:
            return x
        mask = torch.ones_like(x)
        mask[:, 0] = 0
        return torch.sqrt(x.square() * mask)


def test_a_nan_on_a_sentinel_step_is_named_there_and_makes_the_next_step_full() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), SqrtAt(bad_call=3), nn.Linear(128, 10))
    data = batches(6, (64, 64))
    with graddebug.watch(model) as dbg:
        for x, y in data:
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dbg.step()
    rows = dbg.frame()
    rows = rows[(rows["kind"] == "activation") & (rows["numel"] > SMALL_NUMEL)]
    assert sorted(set(rows.loc[rows["absmax"].notna(), "step"])) == [0, 4]
    step3 = rows[rows["step"] == 3].set_index("layer")
    assert step3.loc["0", "nan"] and not step3.loc["1", "nan"]  # born in 1's backward
    nonfinite = dbg.findings().query("issue == 'nonfinite'")
    assert nonfinite[["step", "layer"]].values.tolist() == [[3, "0"]]


@pytest.mark.parametrize("factor, nan, inf", [
    (1e30, False, False),  # finite entries whose squares overflow float32
    (math.inf, False, True),
    (math.nan, True, False),
])
def test_non_finite_flags_on_a_sentinel_step_match_the_gradient(factor: float, nan: bool,
                                                                inf: bool) -> None:
    w = torch.ones(64, 128, requires_grad=True)
    with graddebug.watch(params={"w": w}) as dbg:
        for _ in range(2):
            h = dbg.tap(w * 1.0, "h")
            (h * factor).sum().backward()
            dbg.step()
            w.grad = None
    rows = dbg.frame().query("layer == 'h'").set_index("step")
    grad = torch.full((64, 128), factor)  # dL/dh, the reference
    assert math.isnan(rows.loc[1, "absmax"])  # step 1 measured the sentinel only
    for step in (0, 1):
        assert rows.loc[step, "nan"] == bool(grad.isnan().any()) == nan
        assert rows.loc[step, "inf"] == bool(grad.isinf().any()) == inf
