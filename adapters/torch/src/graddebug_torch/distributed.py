"""Distributed training: the process group a run spans, and sharded parameter gradients
(``DTensor``, as FSDP2's ``fully_shard`` leaves them), measured whole.

Each rank holds a slice of such a gradient. The statistics of the whole gradient follow from
per-slice sums: the sum of squares and the sum add up over the slices, and ``absmax`` is the
largest of the slices' ones. Every rank computes its slices' sums on the device, stacks them
for all sharded parameters, and one collective per recorded step combines the stacks:

- ``param_stats="norm"``: one ``all_reduce(SUM)`` of ``[sum of squares, failures]`` per
  parameter;
- ``param_stats="full"``: one ``all_gather_into_tensor`` of ``[sum of squares, sum, absmax,
  failures]`` per parameter, reduced on each rank (sums added, ``absmax`` the largest), since
  one ``all_reduce`` cannot both add and take a maximum. The gathered tensor holds
  ``world_size x 4`` floats per parameter; ``"full"`` is opt-in.

Where no parameter is sharded (DDP, one process) there is no collective at all. A slice that is
a copy of another rank's (a ``Replicate`` placement, as in HSDP) is counted once, from the rank
whose coordinate on the replicated mesh dimensions is 0. A gradient whose placements are
``Partial`` (not reduced yet) is reduced first, one collective for each such gradient; FSDP2 and
DDP never leave one.

Every rank of the process group must reach the collective exactly once per recorded step, or
the ranks would wait on each other forever (or pair the collective with the next step's). So a
failure while computing a rank's own sums is counted in the ``failures`` column instead of
raised: the collective still runs, and every rank then drops that parameter's row.

``torch.distributed.tensor`` is looked up in ``sys.modules``: a process that created no
``DTensor`` has not imported it, and pays nothing here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from graddebug.adapter import Distribution
from graddebug_torch.stats import acc_dtype, square_sum, whole_absmax

__all__ = ["GlobalStats", "ShardedMarks", "distribution", "is_sharded", "nonfinite_flags",
           "reduce_sharded", "row_values", "whole"]

_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")  # torch >= 2.4; older

OnBug = Callable[[BaseException, str], None]


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


@dataclass(frozen=True)
class GlobalStats:
    """The statistics of whole sharded gradients, as the collective combined them.

    Attributes:
        values: ``[parameters, columns]`` on the collective's device: the sum of squares, then
            with ``full`` the sum and ``absmax``, then the number of ranks that failed to
            measure their slice.
        full: Whether the sum and ``absmax`` columns are there.
    """

    values: Tensor
    full: bool

    @property
    def width(self) -> int:
        """Number of columns per parameter."""
        return 4 if self.full else 2


def _collective_device(grad: Any) -> torch.device:
    """Where the collective's tensor lives: the device type of the gradient's mesh (a CPU
    offloaded gradient of a CUDA mesh goes to the current CUDA device)."""
    kind = str(grad.device_mesh.device_type)
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    return torch.device(kind, module.current_device())


def _weight(grad: Any, world_size: int) -> float:
    """How much this rank's slice counts in the sums: 0 for a copy of another rank's slice
    (a replicated mesh dimension where this rank's coordinate is not 0), and ``mesh size /
    world size`` for a mesh that spans part of the world, whose slices the other parts hold
    again."""
    mesh = grad.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh
        return 0.0
    for dim, placement in enumerate(grad.placements):
        if placement.is_replicate() and coordinate[dim] != 0:
            return 0.0
    size = mesh.size()
    return 1.0 if size >= world_size else size / world_size


def _reduced(grad: Any) -> Any:
    """``grad`` with ``Partial`` placements reduced (replicated), so that its local slice holds
    final values."""
    if not any(p.is_partial() for p in grad.placements):
        return grad
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(grad.device_mesh, placements)


def _local_slice(grad: Any, world_size: int) -> tuple[Tensor, float]:
    """This rank's slice of a sharded gradient (dense values) and its weight in the sums."""
    grad = _reduced(grad)
    local: Tensor = grad.to_local()
    if local.is_sparse:
        local = local.coalesce().values()
    return local, _weight(grad, world_size)


def _column(scalars: Sequence[Tensor], device: torch.device) -> Tensor:
    """0-d tensors as one float64 column on ``device``, with one conversion where they share
    a dtype and a device (the usual case)."""
    first = scalars[0]
    if all(t.dtype == first.dtype and t.device == first.device for t in scalars):
        return torch.stack(list(scalars)).to(device=device, dtype=torch.float64)
    return torch.stack([t.to(device=device, dtype=torch.float64) for t in scalars])


def reduce_sharded(grads: Sequence[Tensor | None], full: bool, on_bug: OnBug
                   ) -> GlobalStats | None:
    """Combine the slices' statistics of sharded gradients over every rank: one collective.

    Every rank must call it with the same number of gradients, in the same order (the watched
    sharded parameters, in ``named_parameters()`` order), each recorded step. A slice costs
    one reduction (two more with ``full``); the rows are assembled with a few kernels for all
    of them.

    Args:
        grads: The gradient of each sharded parameter on this rank (a ``DTensor``), None where
            it has none.
        full: Also combine the sum and ``absmax``.
        on_bug: Where a failure to measure this rank's slices goes (the fail-open rule); the
            collective runs anyway.

    Returns:
        The whole gradients' statistics, or None when ``grads`` is empty.
    """
    if not grads:
        return None
    import torch.distributed as dist

    world_size = dist.get_world_size()
    present = [g for g in grads if g is not None]
    device = _collective_device(present[0]) if present else torch.device("cpu")
    local_rows, failures = _local_rows(grads, full, world_size, device)
    combined = _combine(local_rows, full, world_size)
    for failure in failures:  # reported once every rank is past the collective (strict raises)
        on_bug(failure, "sharded gradient")
    return GlobalStats(combined, full)


def _local_rows(grads: Sequence[Tensor | None], full: bool, world_size: int,
                device: torch.device) -> tuple[Tensor, list[BaseException]]:
    """This rank's rows for the collective, one per gradient, and the failures met.

    Args:
        grads: The sharded gradients (None where a parameter has none).
        full: Also measure the sum and ``absmax``.
        world_size: The number of ranks.
        device: Where the collective's tensor lives.

    Returns:
        ``[gradients, columns]`` float64 rows (zeros for no gradient, a copy or an empty
        slice; the last column counts this rank's failure), and the exceptions caught.
    """
    width = 4 if full else 2
    measured: list[int] = []
    weights: list[float] = []
    sums: list[list[Tensor]] = [[] for _ in range(width - 1)]
    failed: list[int] = []
    failures: list[BaseException] = []
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        try:
            local, weight = _local_slice(grad, world_size)
            if weight == 0.0 or local.numel() == 0:
                continue  # a copy of another rank's slice, or an empty one: adds nothing
            parts = [square_sum(local)]
            if full:
                parts += [local.sum(dtype=acc_dtype(local)), whole_absmax(local)]
        except Exception as exc:  # counted, not raised: the collective must still run
            failures.append(exc)
            failed.append(i)
            continue
        measured.append(i)
        weights.append(weight)
        for column, part in zip(sums, parts, strict=True):
            column.append(part)
    local_rows = torch.zeros((len(grads), width), dtype=torch.float64, device=device)
    if measured:
        rows = torch.stack([_column(column, device) for column in sums], dim=1)
        if any(w != 1.0 for w in weights):  # the sums of squares and the sums, not absmax
            scale = torch.tensor(weights, dtype=torch.float64, device=device)[:, None]
            rows[:, :2] = rows[:, :2] * scale
        local_rows[measured, :width - 1] = rows
    if failed:
        local_rows[failed, width - 1] = 1.0
    return local_rows, failures


def _combine(local_rows: Tensor, full: bool, world_size: int) -> Tensor:
    """Combine every rank's rows: the step's one collective.

    Args:
        local_rows: This rank's rows (:func:`_local_rows`).
        full: The rows hold the sum and ``absmax`` too.
        world_size: The number of ranks.

    Returns:
        The combined rows, alike on every rank.
    """
    import torch.distributed as dist

    if not full:
        dist.all_reduce(local_rows, op=dist.ReduceOp.SUM)
        return local_rows
    n, width = local_rows.shape
    # all_gather_single is all_gather_into_tensor's new name (torch 2.13).
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gathered = torch.empty((world_size * n, width), dtype=torch.float64,
                           device=local_rows.device)
    gather_into(gathered, local_rows)
    gathered = gathered.view(world_size, n, width)
    # amax propagates NaN, as a NaN absmax must.
    return torch.cat([gathered[..., :2].sum(0), gathered[..., 2:3].amax(0),
                      gathered[..., 3:].sum(0)], dim=1)


def nonfinite_flags(grads: Sequence[Tensor | None], on_bug: OnBug) -> list[tuple[bool, bool]]:
    """Whether each whole gradient holds a NaN, and an Inf: one ``all_reduce(MAX)``.

    Called only for gradients whose combined norm came out non-finite, which every rank sees
    alike, so every rank calls it the same way. A rank that fails to look at its slice says
    neither.

    Returns:
        ``(nan, inf)`` per gradient, in order.
    """
    import torch.distributed as dist

    present = [g for g in grads if g is not None]
    device = _collective_device(present[0]) if present else torch.device("cpu")
    flags = torch.zeros((len(grads), 2), dtype=torch.float32, device=device)
    failures: list[BaseException] = []
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        try:
            local, _ = _local_slice(grad, 1)
            flags[i, 0] = torch.isnan(local).any().to(device)
            flags[i, 1] = torch.isinf(local).any().to(device)
        except Exception as exc:  # the collective must still run
            failures.append(exc)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    for failure in failures:
        on_bug(failure, "sharded gradient")
    return [(bool(nan), bool(inf)) for nan, inf in flags.tolist()]


def row_values(values: Sequence[float], index: int, full: bool
               ) -> tuple[float, list[float] | None] | None:
    """One parameter's combined ``(norm, [sum, absmax] or None)`` from the fetched values of
    :class:`GlobalStats`; None when some rank failed to measure its slice."""
    width = 4 if full else 2
    row = values[index * width:(index + 1) * width]
    if row[-1] > 0:
        return None
    sq = row[0]
    norm = math.sqrt(sq) if sq >= 0 or math.isnan(sq) else math.nan
    return norm, ([row[1], row[2]] if full else None)
