"""Vanishing and exploding gradients, and two healthy networks that show neither.

Training that "does nothing" or that blows up to NaN after a few steps usually comes down to
how the gradient's size changes from the loss back to the input:

* A deep MLP with sigmoid activations and PyTorch's default initialisation shrinks the gradient
  at every layer (the sigmoid's slope is at most 1/4), so its first layers get a gradient
  billions of times smaller than its last layer and barely learn: the gradient *vanishes*.
* The same depth with weights that are too large grows the gradient at every layer instead.
  Here a ReLU MLP whose default weights are multiplied by 5, and a deep linear network with the
  same large weights: the gradient *explodes* towards the input.
* A ReLU MLP with He initialisation, and a small residual CNN with batch normalisation, keep the
  gradient's size roughly constant with depth. graddebug must report nothing for them.

Each network trains for a few SGD steps on random data under ``graddebug.watch``; the findings
name the layers at fault. Layers have readable names (``layer_1`` ... ``layer_12``), so the
findings can be read without counting modules.

Run it with ``python examples/torch/scenario4_vanishing_exploding.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

import graddebug

SEED = 0
STEPS = 5
DEPTH = 12
WIDTH = 64
INPUTS = 32
CLASSES = 10
BATCH = 64
LARGE_WEIGHT_SCALE = 5.0

ModelBuilder = Callable[[], nn.Module]


def build_mlp(
    activation: Callable[[], nn.Module] | None,
    init: Callable[[nn.Linear], None] | None = None,
    depth: int = DEPTH,
) -> nn.Sequential:
    """Return ``layer_1`` ... ``layer_<depth>`` Linear layers with an activation between each.

    Args:
        activation: Builds the module placed after every layer but the last; None for a deep
            linear network.
        init: Re-initialises each Linear layer in place; None keeps PyTorch's default.
        depth: Number of Linear layers.

    Returns:
        The network; activations are named ``act_1`` ... ``act_<depth - 1>``.
    """
    modules: OrderedDict[str, nn.Module] = OrderedDict()
    for i in range(1, depth + 1):
        layer = nn.Linear(INPUTS if i == 1 else WIDTH, CLASSES if i == depth else WIDTH)
        if init is not None:
            init(layer)
        modules[f"layer_{i}"] = layer
        if i < depth and activation is not None:
            modules[f"act_{i}"] = activation()
    return nn.Sequential(modules)


def scale_weights(layer: nn.Linear) -> None:
    """Multiply PyTorch's default weights by :data:`LARGE_WEIGHT_SCALE`: too large."""
    with torch.no_grad():
        layer.weight.mul_(LARGE_WEIGHT_SCALE)


def he_init(layer: nn.Linear) -> None:
    """He (Kaiming) normal initialisation for ReLU, zero biases."""
    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    nn.init.zeros_(layer.bias)


class ResidualBlock(nn.Module):
    """``relu(x + bn2(conv2(relu(bn1(conv1(x))))))`` with 3x3 convolutions."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        """Add the residual branch to the input."""
        branch = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(x + branch)


class SmallResNet(nn.Module):
    """A stem convolution, three residual blocks, global average pooling and a classifier."""

    def __init__(self, channels: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ResidualBlock(channels) for _ in range(blocks)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        """Classify a batch of 3-channel images."""
        h = self.blocks(torch.relu(self.stem(x)))
        return self.classifier(self.pool(h).flatten(1))


MODELS: dict[str, tuple[ModelBuilder, tuple[int, ...], float]] = {
    # name: (builder, input shape, SGD learning rate). The large-weight networks get a tiny
    # learning rate: with 0.01 they reach NaN by the third step, and the example is about the
    # explosion itself, not the non-finite values it leads to.
    "sigmoid_default_init": (lambda: build_mlp(nn.Sigmoid), (BATCH, INPUTS), 0.1),
    "relu_large_weights": (lambda: build_mlp(nn.ReLU, scale_weights), (BATCH, INPUTS), 1e-6),
    "linear_large_weights": (lambda: build_mlp(None, scale_weights), (BATCH, INPUTS), 1e-6),
    "relu_he_init": (lambda: build_mlp(nn.ReLU, he_init), (BATCH, INPUTS), 0.01),
    "small_resnet": (SmallResNet, (16, 3, 8, 8), 0.01),
}
"""Every network of the example, by name."""


def batches(shape: tuple[int, ...], steps: int = STEPS) -> list[tuple[Tensor, Tensor]]:
    """Seeded random inputs and class labels, one pair per step."""
    generator = torch.Generator().manual_seed(SEED + 1)
    return [
        (
            torch.randn(*shape, generator=generator),
            torch.randint(0, CLASSES, (shape[0],), generator=generator),
        )
        for _ in range(steps)
    ]


def build(name: str) -> nn.Module:
    """Build the network ``name`` of :data:`MODELS` from the example's seed."""
    torch.manual_seed(SEED)
    return MODELS[name][0]()


def train(name: str, steps: int = STEPS) -> graddebug.Watcher:
    """Train the network ``name`` for ``steps`` SGD steps under ``graddebug.watch``.

    Returns:
        The Watcher, after its ``with`` block.
    """
    _, shape, lr = MODELS[name]
    model = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with graddebug.watch(model) as dbg:
        for x, y in batches(shape, steps):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            dbg.step()
    return dbg


def main() -> dict[str, Any]:
    """Train every network of :data:`MODELS` and print what graddebug finds.

    Returns:
        ``findings``: the findings frame of each network, by name; ``frames``: the record
        frame of each network, by name.
    """
    findings: dict[str, pd.DataFrame] = {}
    frames: dict[str, pd.DataFrame] = {}
    for name in MODELS:
        dbg = train(name)
        findings[name], frames[name] = dbg.findings(), dbg.frame()
    for name, found in findings.items():
        counts = found["issue"].value_counts().to_dict() if len(found) else {}
        print(f"--- {name}: {counts or 'no findings'}")
        for issue, rows in found.groupby("issue", sort=False):
            layers = ", ".join(dict.fromkeys(rows["layer"]))
            print(f"  {issue} at: {layers}")
            print(f"  e.g. {rows['message'].iloc[0]}")
    return {"findings": findings, "frames": frames}


if __name__ == "__main__":
    main()
