"""The built-in demonstration: a deep sigmoid MLP whose first layers get no gradient.

``graddebug demo`` reaches it through the ``graddebug_demo`` hook of this adapter's plugin, so
that neither the core nor the command line imports torch.
"""

from __future__ import annotations

import torch
from torch import nn

import graddebug

__all__ = ["build_sigmoid_mlp", "run_demo"]


def build_sigmoid_mlp(depth: int = 12, width: int = 64, inputs: int = 32,
                      classes: int = 10) -> nn.Sequential:
    """Return ``depth`` Linear layers with a Sigmoid between each, default torch init."""
    layers: list[nn.Module] = []
    for i in range(depth - 1):
        layers += [nn.Linear(inputs if i == 0 else width, width), nn.Sigmoid()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def run_demo(steps: int = 20, seed: int = 0, batch: int = 64) -> graddebug.Watcher:
    """Train the sigmoid MLP on synthetic classification data under ``watch``.

    Args:
        steps: Number of SGD steps.
        seed: Seed of the model and the data.
        batch: Batch size.

    Returns:
        The Watcher, after its ``with`` block, holding frames and findings.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_sigmoid_mlp()
    inputs = torch.randn(steps, batch, 32, generator=generator)
    targets = (inputs[..., :10].argmax(-1)).long()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddebug.watch(model) as dbg:
        for x, y in zip(inputs, targets, strict=True):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            dbg.step()
    return dbg
