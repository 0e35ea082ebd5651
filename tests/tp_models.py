"""The model, the batches and the plain-torch references of ``test_torch_tensor_parallel.py``.

One model serves every sharding. Unsharded, it is the single process whose rows are the truth;
the same weights (one seed) are then sharded by :func:`parallelize` on a tensor-parallel mesh:
``first`` row-wise with its output split over the sequence, ``norm`` a ``SequenceParallel``
LayerNorm, ``ffn`` prepared to gather its input (``PrepareModuleInput``) with ``ffn.up``
column-wise and ``ffn.down`` row-wise, ``hand`` a layer written with ``DTensor`` ops whose output
is a ``DTensor`` split over the features, and ``side.0`` column-wise. ``fade`` has tiny weights
behind a sigmoid: every layer before it vanishes. ``side.1`` detaches its input: ``side.0``
gets no gradient.

Nothing here imports graddebug: the references are plain torch (tensor hooks and ``.grad``),
checked against ``torch.autograd.grad`` in the tests.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

D, H, S = 8, 8, 4  # features, hidden units, sequence length: all split evenly over 2 ranks
BATCH = 4  # the global batch, split over the data-parallel ranks
STEPS = 3
LR = 0.1
FADE = 1e-4  # the scale of fade.0's weights: every layer before it vanishes
CLIP = {"ffn.up": 1e-6, "norm": 4e-7}
"""``clip_norm`` on two layer outputs split over the ranks: below their norms at every step."""
LEAVES = ("first", "norm", "ffn.up", "ffn.act", "ffn.down", "hand", "fade.0", "fade.1", "head",
          "side.0", "side.1", "side.2")
SPLIT_OUTPUTS = {"first": 1, "norm": 1, "ffn.up": 2, "ffn.act": 2, "hand": 2}
"""The dim over which each layer's output is split between the tensor-parallel ranks (the
others are whole on every rank)."""

Stats = dict[str, Any]


class Hand(nn.Module):
    """``x W^T + b``, written with ``DTensor`` ops once :func:`distribute_hand` has split
    ``W`` and ``b`` over the output features: its output is then a ``DTensor``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.bias = nn.Parameter(0.1 * torch.randn(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        mesh = getattr(weight, "device_mesh", None)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x @ weight.t() + self.bias


class Cut(nn.Module):
    """A layer that detaches its input: the graph stops here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach() * 2


def whole(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` as the whole tensor on every rank; anything else as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class Net(nn.Module):
    """The model of the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.ffn = nn.Sequential(OrderedDict(up=nn.Linear(D, H), act=nn.Tanh(),
                                             down=nn.Linear(H, D)))
        self.hand = Hand(D, D)
        self.fade = nn.Sequential(nn.Linear(D, D), nn.Sigmoid())
        self.head = nn.Linear(D, 1)
        self.side = nn.Sequential(nn.Linear(D, D), Cut(), nn.Linear(D, 1))
        with torch.no_grad():
            self.fade[0].weight.mul_(FADE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffn(self.norm(self.first(x)))
        h = whole(self.hand(h))
        return self.head(self.fade(h)) + self.side(x)


def net(dtype: torch.dtype = torch.float32) -> Net:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return Net().to(dtype)


def global_batch(step: int, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs ``[BATCH, S, D]`` and targets ``[BATCH, S, 1]``."""
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, S, D, generator=gen), torch.randn(BATCH, S, 1, generator=gen)
    return x.to(dtype), y.to(dtype)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A mean over the (local) batch, as usual."""
    return nn.functional.mse_loss(out, target)


@dataclass(frozen=True)
class Layout:
    """Where a rank sits: ``dp`` data-parallel groups of ``tp`` tensor-parallel ranks, rank
    ``r`` at ``(r // tp, r % tp)`` (a row-major mesh)."""

    dp: int
    tp: int

    def batch(self, step: int, rank: int, dtype: torch.dtype = torch.float32
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s share of the global batch: its data-parallel group's rows."""
        x, y = global_batch(step, dtype)
        n, group = BATCH // self.dp, rank // self.tp
        return x[group * n:(group + 1) * n], y[group * n:(group + 1) * n]


def parallelize(model: Net, mesh: Any) -> Net:
    """Shard ``model`` on the 1-D tensor-parallel ``mesh`` as the module docstring says."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "first": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "ffn.up": ColwiseParallel(),
        "ffn.down": RowwiseParallel(),
        "side.0": ColwiseParallel(output_layouts=Replicate()),
    })
    for name in ("weight", "bias"):
        value = getattr(model.hand, name).detach()
        setattr(model.hand, name, nn.Parameter(distribute_tensor(value, mesh, [Shard(0)])))
    return model


# -- statistics, in float64 ---------------------------------------------------------------------


def stats(grad: torch.Tensor | np.ndarray) -> Stats:
    """The statistics of one whole gradient, in float64."""
    g = torch.as_tensor(np.asarray(grad, dtype=np.float64))
    return {"norm": float(g.norm()), "mean": float(g.mean()), "std": float(g.std(unbiased=False)),
            "absmax": float(g.abs().max()), "numel": g.numel(), "shape": str(tuple(g.shape))}


def output_hooks(model: nn.Module, seen: dict[str, torch.Tensor],
                 clip: dict[str, float] | None = None) -> list[Any]:
    """Hook every leaf of :data:`LEAVES`: the gradient reaching its output goes into ``seen``
    (a local piece where the output is one), clipped by hand to ``clip[name]`` if given."""
    modules = dict(model.named_modules())
    clip = clip or {}

    def forward_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if not out.requires_grad:
                return

            def grad_hook(grad: torch.Tensor) -> torch.Tensor | None:
                seen[name] = grad.detach().clone()
                if name not in clip:
                    return None
                norm = float(whole(grad).double().norm())
                return grad * min(1.0, clip[name] / norm) if norm > 0 else None
            out.register_hook(grad_hook)
        return hook

    return [modules[name].register_forward_hook(forward_hook(name)) for name in LEAVES]


def reference_run(steps: int = STEPS, clip: dict[str, float] | None = None,
                  dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    """Train :class:`Net` on the global batches in one process, with no graddebug: per step,
    each parameter gradient's statistics and each leaf output's gradient norm (before the clip
    where ``clip`` names the leaf), and the weights after ``steps`` steps."""
    model = net(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    params: dict[tuple[int, str, str], Stats] = {}
    outputs: dict[tuple[int, str], Stats] = {}
    for step in range(steps):
        seen: dict[str, torch.Tensor] = {}
        handles = output_hooks(model, seen, clip)
        optimizer.zero_grad()
        x, y = global_batch(step, dtype)
        loss_fn(model(x), y).backward()
        for handle in handles:
            handle.remove()
        outputs.update({(step, name): stats(g) for name, g in seen.items()})
        for pname, p in model.named_parameters():
            if p.grad is not None:
                layer, _, tensor = pname.rpartition(".")
                params[(step, layer, tensor)] = stats(p.grad)
        optimizer.step()
    weights = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
    return {"params": params, "outputs": outputs, "weights": weights}
