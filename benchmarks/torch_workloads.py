"""The PyTorch workloads of the benchmarks: each model with its fixed batch, optimizer and loss,
its twins, and the training step they all time.

Shared by ``overhead_torch.py``, ``streaming.py`` and ``distributed_torch.py``. Every workload
is built from a fixed seed, so that two builds, or a build and its :func:`twin`, hold the same
weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

import graddebug
from graddebug import Watcher

__all__ = ["BUILDERS", "CENSUS_STEPS", "DEFAULT_WORKLOADS", "WORKLOADS", "LossFn", "ResNet18",
           "Workload", "build_workload", "compiled_copy", "graph_census", "train_step", "twin"]

LossFn = Callable[[Tensor, Tensor], Tensor]

CENSUS_STEPS = 3
"""Steps run to count graph breaks and compiled graphs (a recompile shows from the second)."""


@dataclass
class Workload:
    """A model with a fixed batch, its optimizer and its loss.

    Attributes:
        name: Short name (``mlp``, ``cnn``, ``transformer``).
        description: Model and batch, in words.
        model: The model, in training mode.
        optimizer: Plain SGD over the model's parameters.
        inputs: One batch of inputs, reused every step.
        target: The matching targets.
        loss_fn: ``loss_fn(output, target) -> scalar``.
    """

    name: str
    description: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: Tensor
    target: Tensor
    loss_fn: LossFn


def _mlp() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    x, y = torch.randn(128, 512), torch.randn(128, 512)
    return nn.Sequential(*layers), x, y, nn.functional.mse_loss, "16 x (Linear 512 + ReLU), b=128"


def _cnn() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]

    model = nn.Sequential(
        *block(3, 32), nn.MaxPool2d(2),
        *block(32, 64), nn.MaxPool2d(2),
        *block(64, 64), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    return model, x, y, nn.functional.cross_entropy, "3 x (Conv+BN+ReLU) 3-32-64-64, b=64, 32x32"


def _transformer() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    layer = nn.TransformerEncoderLayer(
        d_model=256, nhead=4, dim_feedforward=1024, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    x, y = torch.randn(16, 64, 256), torch.randn(16, 64, 256)
    return model, x, y, nn.functional.mse_loss, "TransformerEncoder d256 h4 L4 ff1024, b=16 s=64"


class _BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock``: two 3x3 conv-BN pairs and a (projected) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` layout (module names and shapes), built here so that the
    benchmark needs no torchvision."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        for i, width in enumerate(widths):
            c_in = widths[max(i - 1, 0)]
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(
                _BasicBlock(c_in, width, stride), _BasicBlock(width, width, 1)))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(self.avgpool(x).flatten(1))


def _resnet18() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    return (ResNet18(), x, y, nn.functional.cross_entropy,
            "ResNet-18 (torchvision layout), b=16, 64x64, 10 classes")


def _gpt2() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    import transformers  # an optional workload: only this one needs transformers

    # No key-value cache, as in training: under torch.compile (torch 2.13) a tensor hook traced
    # after the cache's update loses the cache's attributes, and dynamo falls back to eager.
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512,
                                     n_positions=64, bos_token_id=0, eos_token_id=0,
                                     use_cache=False)
    tokens = torch.randint(0, 512, (8, 64))

    def loss(output: Any, target: Tensor) -> Tensor:
        logits: Tensor = output.logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    return (transformers.GPT2LMHeadModel(config), tokens, tokens, loss,
            "GPT-2 (transformers) L4 d128 h4, b=8 s=64, vocab 512")


BUILDERS: dict[str, Callable[[], tuple[nn.Module, Tensor, Tensor, LossFn, str]]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "transformer": _transformer,
    "resnet18": _resnet18,
    "gpt2": _gpt2,
}
"""Each workload's builder: ``() -> (model, inputs, target, loss_fn, description)``."""

WORKLOADS: tuple[str, ...] = tuple(BUILDERS)
DEFAULT_WORKLOADS: tuple[str, ...] = ("mlp", "cnn", "transformer")


def build_workload(name: str, device: torch.device, seed: int = 0) -> Workload:
    """Build a workload from a fixed seed.

    Args:
        name: One of :data:`WORKLOADS`.
        device: Where the model and the batch live.
        seed: Seed for the weights and the batch.

    Returns:
        The workload, with its model in training mode.
    """
    torch.manual_seed(seed)
    model, x, y, loss_fn, description = BUILDERS[name]()
    model = model.to(device).train()
    # A small learning rate keeps the shared weights sane over hundreds of steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    return Workload(name, description, model, optimizer, x.to(device), y.to(device), loss_fn)


def twin(work: Workload, apart: bool = False) -> Workload:
    """A copy of ``work``'s model with its own optimizer, on the same batch and loss.

    Args:
        work: The workload to copy; its weights are copied as they are now.
        apart: Give the copy a subclass of the model's class, so that dynamo compiles its
            graphs apart from those of the original's class: dynamo would otherwise reuse a
            hook-free graph of the class for a watched copy, without graddebug's hooks.

    Returns:
        The copy's workload.
    """
    model = copy.deepcopy(work.model)
    if apart:
        cls = type(model)
        model.__class__ = type(f"Watched{cls.__name__}", (cls,), {})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    return Workload(work.name, work.description, model, optimizer, work.inputs, work.target,
                    work.loss_fn)


def compiled_copy(work: Workload, apart: bool) -> Workload:
    """A ``torch.compile``d :func:`twin` of ``work``.

    Args:
        work: The workload to copy.
        apart: As for :func:`twin`.

    Returns:
        The copy's workload, its model compiled.
    """
    copied = twin(work, apart)
    copied.model = torch.compile(copied.model)
    return copied


def train_step(work: Workload, dbg: Watcher | None) -> None:
    """Run one training step, closing the watcher's step after ``backward`` when given.

    Args:
        work: The workload to train.
        dbg: An entered watcher, or None for a plain step.
    """
    work.optimizer.zero_grad(set_to_none=True)
    loss = work.loss_fn(work.model(work.inputs), work.target)
    torch.autograd.backward(loss)
    if dbg is not None:
        dbg.step()
    work.optimizer.step()


def graph_census(name: str, options: dict[str, Any] | None, device: torch.device
                 ) -> tuple[int, int]:
    """Graph breaks and compiled graphs of :data:`CENSUS_STEPS` steps of a compiled workload,
    from a clean dynamo state; dynamo alone traces (backend "eager"), since breaks are its.

    Args:
        name: Workload name.
        options: ``graddebug.watch`` options, or None for plain steps.
        device: Where to run.

    Returns:
        ``(graph breaks, graphs)`` as ``torch._dynamo.utils.counters`` counts them.
    """
    work = build_workload(name, device)
    torch._dynamo.reset()
    counters.clear()
    work.model = torch.compile(work.model, backend="eager")
    if options is None:
        for _ in range(CENSUS_STEPS):
            train_step(work, None)
    else:
        with graddebug.watch(work.model, **options) as dbg:
            for _ in range(CENSUS_STEPS):
                train_step(work, dbg)
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return breaks, graphs
