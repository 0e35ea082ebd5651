"""Distributed training: the process group a run spans, and sharded gradients (``DTensor``,
as FSDP2's ``fully_shard`` and tensor parallelism leave them).

Each rank holds a slice of a sharded gradient; its row measures that slice, and the ranks'
rows combine into the whole gradient's (the rule of :mod:`graddebug.adapter.ranks`, the
shares of :mod:`graddebug_torch.sharding`). A gradient whose placements are ``Partial`` (not
reduced yet) is reduced first, one collective for each such gradient; FSDP2, DDP and tensor
parallelism never leave one.

``torch.distributed.tensor`` is looked up in ``sys.modules``: a process that created no
``DTensor`` has not imported it, and pays nothing here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from graddebug.adapter import Distribution

__all__ = ["PARTIAL_LIMIT", "ShardedMarks", "distribution", "is_sharded", "local_slice",
           "replicated_like", "summed_by_ranks", "whole"]

_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")  # torch >= 2.4; older




def _dtensor_type() -> type | None:
    for name in _MODULES:
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if isinstance(cls, type):
            return cls
    return None


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor``: a slice of a tensor spread over ranks."""
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def distribution() -> Distribution:
    """This process's rank, the world size and the backend of ``torch.distributed``'s default
    process group; one process when it is not available or not initialized."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return Distribution()
    return Distribution(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


def _grad_mark(grad: Tensor | None) -> tuple[int, int] | None:
    """Which gradient a tensor's ``.grad`` holds, and how often it changed in place."""
    if grad is None:
        return None
    # FSDP2 accumulates into the slice, unseen by the DTensor's own version counter.
    local: Tensor = grad.to_local() if is_sharded(grad) else grad  # type: ignore[attr-defined]
    return id(grad), local._version


class ShardedMarks:
    """The gradient each sharded parameter held when the last step closed.

    FSDP2 may set ``.grad`` without running the post-accumulate hooks, so whether a step holds
    gradients nobody recorded is read from the gradients' identity and in-place version.

    Args:
        params: The watched sharded parameters.
    """

    __slots__ = ("_marks", "_params")

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._params = list(params)
        self._marks: list[tuple[int, int] | None] = [None] * len(self._params)

    def changed(self) -> bool:
        """Whether a sharded parameter holds a gradient other than the one last closed on."""
        return any(p.grad is not None and _grad_mark(p.grad) != mark
                   for p, mark in zip(self._params, self._marks, strict=True))

    def mark(self) -> None:
        """Remember the gradients the step closes on."""
        self._marks = [_grad_mark(p.grad) for p in self._params]


def whole(tensor: Tensor) -> Tensor:
    """The whole tensor behind a ``DTensor`` on every rank (one collective); others as given.

    For ``keep=`` of a sharded parameter, which asks for its full gradient.
    """
    if is_sharded(tensor):
        full: Tensor = tensor.full_tensor()  # type: ignore[attr-defined]
        return full
    return tensor


def _reduced(grad: Any) -> Any:
    """``grad`` with ``Partial`` placements reduced (replicated), so that its local slice holds
    final values."""
    if not any(p.is_partial() for p in grad.placements):
        return grad
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(grad.device_mesh, placements)


PARTIAL_LIMIT = 1 << 16
"""The largest ``Partial`` gradient (in entries) whose addends travel in the ranks' one
collective (:class:`graddebug.adapter.ranks.Partial`); a larger one is reduced first, one
collective more."""


def summed_by_ranks(grad: Any) -> bool:
    """Whether ``grad`` is a ``DTensor`` with ``Partial(sum)`` placements small enough for
    its addends to travel in the ranks' one collective, unreduced."""
    return (is_sharded(grad) and any(p.is_partial() for p in grad.placements)
            and all(getattr(p, "reduce_op", "sum") == "sum" for p in grad.placements
                    if p.is_partial())
            and grad.to_local().numel() <= PARTIAL_LIMIT)


def local_slice(grad: Any, reduce: bool = True) -> Tensor:
    """This rank's slice of a sharded gradient, as dense values (``Partial`` placements
    reduced first, unless ``reduce`` is False: then this rank's addend)."""
    local: Tensor = (_reduced(grad) if reduce else grad).to_local()
    if local.is_sparse:
        local = local.coalesce().values()
    return local


def replicated_like(tensor: Tensor, like: Any) -> Tensor:
    """``tensor``, the same on every rank, as a replicated ``DTensor`` on ``like``'s mesh."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    out: Tensor = DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return out
