"""Small torch models shared by the torch tests."""

from __future__ import annotations

import torch
from torch import nn

from graddebug_torch.demo import build_sigmoid_mlp


def relu_mlp(depth: int = 6, width: int = 64, inputs: int = 32, classes: int = 10,
             inplace: bool = False) -> nn.Sequential:
    """A He-initialised ReLU MLP: the healthy reference."""
    layers: list[nn.Module] = []
    for i in range(depth - 1):
        linear = nn.Linear(inputs if i == 0 else width, width)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU(inplace=inplace)]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def sigmoid_mlp(depth: int = 12) -> nn.Sequential:
    """Default-initialised sigmoid MLP (the demo's): its early gradients vanish."""
    return build_sigmoid_mlp(depth=depth)


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus identity."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


class ResCNN(nn.Module):
    """A small residual CNN for 3x16x16 inputs."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()
        self.block1 = Block(channels)
        self.block2 = Block(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.act(self.bn(self.stem(x)))))
        return self.head(self.pool(x).flatten(1))


def tiny_transformer(d_model: int = 32, layers: int = 2) -> nn.Module:
    """A small TransformerEncoder with a linear head."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(d_model, 4, dim_feedforward=64, dropout=0.0,
                                               batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

    return Net()


def train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], dbg=None,
          lr: float = 0.05) -> None:
    """Plain SGD on cross-entropy; ``dbg.step()`` after each step when given."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dbg is not None:
            dbg.step()


def batches(n: int, shape: tuple[int, ...], classes: int = 10, seed: int = 0,
            target_shape: tuple[int, ...] | None = None):
    """``n`` seeded random (x, y) batches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(*shape, generator=g)
        y = torch.randint(0, classes, target_shape or (shape[0],), generator=g)
        out.append((x, y))
    return out


def forward_hooks(model: nn.Module) -> int:
    """How many forward and forward-pre hooks the modules of ``model`` hold."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def watched_run(model: nn.Module, steps: int, seen: list[int] | None = None, **options):
    """Train ``model`` ``steps`` SGD steps on seeded (8, 32) batches under
    ``graddebug.watch(model, **options)``; ``seen`` gets :func:`forward_hooks` before each step.
    Returns the Watcher."""
    import graddebug

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddebug.watch(model, **options) as dbg:
        for x, y in batches(steps, (8, 32)):
            if seen is not None:
                seen.append(forward_hooks(model))
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            dbg.step()
            opt.step()
    return dbg
