"""Finding where a ``.detach()`` or a numpy round trip silently cuts the graph.

A model built from ``block1 -> block2 -> head`` trains without any error when ``block1``'s
output is detached on its way into ``block2``: the loss goes down, because ``block2`` and
``head`` still learn, but ``block1`` never changes. Nothing in PyTorch warns about it. The same
happens with a numpy round trip such as ``torch.from_numpy(h.detach().numpy())``, which is easy
to write while debugging or when a preprocessing step lives in numpy.

graddebug sees that ``block1``'s output required a gradient in the forward pass but none reached
it in the backward pass, while ``block2`` did get one, and reports a ``cut_graph`` finding that
names the boundary between the two blocks, plus a second one for ``block1``'s parameters, which
got no gradient at all. This example shows three versions of the same bug:

1. a module whose ``forward`` calls ``.detach()``, watched at block level
   (``layers=["block1", "block2", "head"]``);
2. the numpy round trip, watched at the default leaf-module level (``block1.1``, ``block2.0``);
3. functional code without modules, where ``dbg.tap`` marks the block outputs.

Run it with ``python examples/torch/scenario3_cut_graph.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

import graddebug

SEED = 0
STEPS = 2
BATCH = 16
FEATURES = 4
HIDDEN = 8
BLOCKS = ["block1", "block2", "head"]

Cut = Callable[[Tensor], Tensor]


def detach(h: Tensor) -> Tensor:
    """The explicit cut."""
    return h.detach()


def numpy_round_trip(h: Tensor) -> Tensor:
    """The accidental cut: the values survive the trip to numpy, the graph does not."""
    return torch.from_numpy(h.detach().numpy())


class BlockNet(nn.Module):
    """``block1 -> cut -> block2 -> head``; ``cut`` stands for the bug under study."""

    cut: Cut

    def __init__(self, cut: Cut) -> None:
        super().__init__()
        self.cut = cut
        self.block1 = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.block2 = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: Tensor) -> Tensor:
        """Run the blocks, cutting the graph between ``block1`` and ``block2``."""
        return self.head(self.block2(self.cut(self.block1(x))))


def train_module(cut: Cut, layers: list[str] | None) -> tuple[pd.DataFrame, bool]:
    """Train :class:`BlockNet` for a few SGD steps under ``watch``.

    Args:
        cut: How ``block1``'s output is cut off.
        layers: The ``layers=`` option of ``watch``; None watches every leaf module.

    Returns:
        The findings, and whether ``block1``'s weights stayed exactly as initialised.
    """
    torch.manual_seed(SEED)
    model = BlockNet(cut)
    weight = model.get_parameter("block1.0.weight")
    before = weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddebug.watch(model, layers=layers) as dbg:
        for _ in range(STEPS):
            x, y = torch.randn(BATCH, FEATURES), torch.randn(BATCH, 1)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            dbg.step()
    frozen = torch.equal(before, weight.detach())
    return dbg.findings(), frozen


def train_functional() -> pd.DataFrame:
    """The same network as plain tensors, with taps at each block's output.

    Returns:
        The findings.
    """
    generator = torch.Generator().manual_seed(SEED)
    params = {
        "W1": torch.randn(FEATURES, HIDDEN, generator=generator) * 0.5,
        "W2": torch.randn(HIDDEN, HIDDEN, generator=generator) * 0.3,
        "w3": torch.randn(HIDDEN, 1, generator=generator) * 0.3,
    }
    for p in params.values():
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    with graddebug.watch(params=params) as dbg:
        for _ in range(STEPS):
            x = torch.randn(BATCH, FEATURES, generator=generator)
            y = torch.randn(BATCH, 1, generator=generator)
            h1 = dbg.tap(torch.tanh(x @ params["W1"]), "block1")
            h2 = dbg.tap(torch.tanh(h1.detach() @ params["W2"]), "block2")
            out = dbg.tap(h2 @ params["w3"], "head")
            loss = torch.mean((out - y) ** 2)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            dbg.step()
    return dbg.findings()


def main() -> dict[str, Any]:
    """Run the three versions of the cut and print what graddebug reports.

    Returns:
        ``detach``, ``numpy``, ``functional``: the findings frame of each version;
        ``block1_frozen``: for the two module versions, whether ``block1``'s weights never
        changed during training.
    """
    detach_findings, detach_frozen = train_module(detach, BLOCKS)
    numpy_findings, numpy_frozen = train_module(numpy_round_trip, None)
    functional_findings = train_functional()
    results = {
        "detach": detach_findings,
        "numpy": numpy_findings,
        "functional": functional_findings,
    }
    for label, findings in results.items():
        print(f"--- {label}: {len(findings)} finding(s)")
        for row in findings.itertuples():
            print(f"[{row.issue}/{row.severity}] {row.layer}: {row.message}")
    print(
        f"block1 weights unchanged after {STEPS} SGD steps: "
        f"detach={detach_frozen}, numpy={numpy_frozen}"
    )
    return {**results, "block1_frozen": {"detach": detach_frozen, "numpy": numpy_frozen}}


if __name__ == "__main__":
    main()
