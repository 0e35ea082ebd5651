"""Host syncs on the step path: one per recorded step, none on unrecorded steps.

``torch.cuda`` is absent here, so the syncs are counted at their source: every call that
moves a tensor's values to the host (``item``, ``tolist``, ``numpy``, ``cpu`` and the Python
conversions) is counted through a patched ``torch.Tensor`` while graddebug runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import graddebug

TO_HOST = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts calls that bring tensor values to the host, by method name."""
    counts: Counter[str] = Counter()
    for name in TO_HOST:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _original: Any = original,
                    _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield counts


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "mlp": (mlp, lambda: torch.randn(32, 8)),
    "cnn": (cnn, lambda: torch.randn(4, 3, 8, 8)),
    "transformer": (transformer, lambda: torch.randn(4, 6, 16)),
}

OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "parameters only": {"outputs": False},
    "full parameter statistics": {"param_stats": "full"},
    "clipped": {"intervene": {"0": {"clip_norm": 1e-3}}},
    "op-level capture": {"ops": True},
}


def run(name: str, options: dict[str, Any], syncs: Counter[str], *, every: int = 1,
        steps: int = 4, by_optimizer: bool = False) -> list[tuple[int, int]]:
    """Train ``steps`` steps; return (syncs in forward and backward, syncs closing the step)
    for each step."""
    build, batch = MODELS[name]
    torch.manual_seed(0)
    model, x = build(), batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if name == "transformer" and "intervene" in options:
        options = {"intervene": {"layers.0.linear1": {"clip_norm": 1e-3}}}
    extra = {"optimizer": opt} if by_optimizer else {}
    seen = []
    with graddebug.watch(model, every=every, **options, **extra) as dbg:
        for _ in range(steps):
            syncs.clear()
            opt.zero_grad()
            model(x).square().mean().backward()
            training = sum(syncs.values())
            syncs.clear()
            if by_optimizer:
                opt.step()
            else:
                dbg.step()
                opt.step()
            seen.append((training, sum(syncs.values())))
    assert dbg.frame()["step"].nunique() == len(range(0, steps, every))  # it did record
    return seen


@pytest.mark.parametrize("options", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("name", MODELS)
def test_one_sync_per_recorded_step(name: str, options: str, syncs: Counter[str]) -> None:
    assert run(name, OPTIONS[options], syncs) == [(0, 1)] * 4, dict(syncs)


@pytest.mark.parametrize("name", MODELS)
def test_no_sync_on_steps_every_skips(name: str, syncs: Counter[str]) -> None:
    assert run(name, {}, syncs, every=2) == [(0, 1), (0, 0), (0, 1), (0, 0)]


def test_one_sync_when_the_optimizer_closes_the_step(syncs: Counter[str]) -> None:
    assert run("mlp", {}, syncs, by_optimizer=True) == [(0, 1)] * 4


class _Detached(nn.Module):
    """A cut graph: every step has a cut_graph finding, so escalate=True captures ops once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)).detach())


def test_one_sync_per_step_when_escalation_captures_ops(syncs: Counter[str]) -> None:
    torch.manual_seed(0)
    model, x = _Detached(), torch.randn(4, 8)
    seen = []
    with graddebug.watch(model, escalate=True) as dbg:
        for _ in range(3):
            syncs.clear()
            model(x).square().mean().backward()
            training = sum(syncs.values())
            syncs.clear()
            dbg.step()
            seen.append((training, sum(syncs.values())))
    frame = dbg.frame()
    assert frame.loc[frame["kind"] == "op", "step"].unique().tolist() == [1]  # it escalated
    assert seen == [(0, 1)] * 3, dict(syncs)
