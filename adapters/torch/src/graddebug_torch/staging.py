"""Small activation gradients, staged by the hooks and reduced all at once when the step closes.

A hook that reduces its gradient on the spot launches four kernels (sum of squares, sum,
per-unit max and min), each with a few microseconds of fixed cost, whatever the gradient's
size. On a model of many small layers that fixed cost is the whole overhead (the Performance
page has the measurement, ``benchmarks/many_layers_torch.py``'s model). A gradient of at most
:data:`SMALL_NUMEL` entries is therefore copied (one kernel) into a staging buffer of its shape,
and the buffer is reduced in one batched pass per shape when the step closes. The copy belongs
to graddebug, so no live tensor of the user's is kept, and the buffers are reused from step to
step. Larger gradients are reduced in the hook, while they are still in cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from graddebug_torch.stats import acc_dtype

__all__ = ["SMALL_NUMEL", "GroupStats", "SmallGrads", "StagedGroup"]

SMALL_NUMEL = 4096
"""Gradients with at most this many entries are staged, larger ones reduced in their hook."""

GroupKey = tuple[torch.Size, torch.dtype, torch.device, int | None]


@dataclass
class GroupStats:
    """The statistics of every gradient staged in one group, one entry (or row) each."""

    sq: Tensor  # (rows,) sums of squares
    total: Tensor  # (rows,) sums
    absmax: Tensor  # (rows,) largest |g|
    live: Tensor | None  # (rows,) units with a non-zero gradient; None without a unit axis
    per_unit: Tensor | None  # (rows, units) largest |g| of each unit


class StagedGroup:
    """The staging buffer of one (shape, dtype, device, unit axis)."""

    def __init__(self, key: GroupKey) -> None:
        self.key = key
        self.used = 0
        self._buffer: Tensor | None = None
        self._rows: tuple[Tensor, ...] = ()  # views of the buffer's rows, made in one call

    def put(self, grad: Tensor) -> int:
        """Copy ``grad`` into the next row; return the row."""
        row = self.used
        if row == len(self._rows):
            shape, dtype, device, _ = self.key
            grown = torch.empty((max(64, 2 * row), *shape), dtype=dtype, device=device)
            if self._buffer is not None:
                grown[:row].copy_(self._buffer[:row])
            self._buffer, self._rows = grown, grown.unbind(0)
        self._rows[row].copy_(grad.detach() if grad.requires_grad else grad)  # create_graph
        self.used = row + 1
        return row

    def sums(self) -> Tensor:
        """The sum of each row used in this step, in :func:`~graddebug_torch.stats.acc_dtype`
        (finite exactly when the row is: the forward check of a staged output)."""
        assert self._buffer is not None
        rows = self._buffer[: self.used]
        return rows.reshape(self.used, -1).sum(1, dtype=acc_dtype(rows))

    def reduce(self) -> GroupStats:
        """One batched pass over the rows used in this step."""
        assert self._buffer is not None
        rows = self._buffer[: self.used]
        unit_dim = self.key[3]
        flat = rows.reshape(self.used, -1)
        acc = acc_dtype(rows)
        sq = torch.linalg.vector_norm(flat, dim=1, dtype=acc).square()
        total = flat.sum(1, dtype=acc)
        if unit_dim is None:
            return GroupStats(sq, total, flat.abs().amax(1), None, None)
        units = rows.movedim(unit_dim + 1, 1).reshape(self.used, rows.shape[unit_dim + 1], -1)
        per_unit = torch.maximum(units.amax(2), units.amin(2).neg())
        return GroupStats(sq, total, per_unit.amax(1), torch.count_nonzero(per_unit, dim=1),
                          per_unit)


class SmallGrads:
    """Every staging group of an adapter; emptied (not freed) when a step closes."""

    def __init__(self) -> None:
        self._groups: dict[GroupKey, StagedGroup] = {}

    @staticmethod
    def fits(grad: Tensor) -> bool:
        """Whether ``grad`` is staged: small, dense and floating."""
        return (grad.numel() <= SMALL_NUMEL and grad.layout == torch.strided
                and grad.is_floating_point())

    def group(self, grad: Tensor, unit_dim: int | None) -> StagedGroup:
        """The group that stages ``grad`` (its :meth:`StagedGroup.put` gives the row)."""
        key = (grad.shape, grad.dtype, grad.device, unit_dim)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = StagedGroup(key)
        return group

    def reduce(self) -> dict[StagedGroup, GroupStats]:
        """The statistics of every group used in this step."""
        return {group: group.reduce() for group in self._groups.values() if group.used}

    def clear(self) -> None:
        """Start the next step; the buffers are kept for reuse."""
        for group in self._groups.values():
            group.used = 0
