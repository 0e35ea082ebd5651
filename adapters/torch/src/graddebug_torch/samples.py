"""The fixed samples through which the optimizer's view sees each parameter
(:mod:`graddebug_torch.updates`), and the buffers they share.

No copy of the weights is kept. Each parameter is seen through a fixed sample of its entries,
a strided view ``flat[::stride]`` of the plan every adapter shares
(:func:`graddebug.sampling.plan`): the stride is a prime near ``numel / k`` that divides none
of the tensor's row lengths, so that the sample walks across the columns of a matrix rather
than down one of them; both norms are the sample's times ``sqrt(numel / k)``, exact for a
tensor small enough to be taken whole. The samples of one device, dtype and length share one
buffer of two slots, a row each: the buffers are the only memory held, twice the plan's
:data:`~graddebug.sampling.BUDGET` of the parameters' entries plus twice its
:data:`~graddebug.sampling.FLOOR` per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from graddebug import sampling
from graddebug_torch.distributed import is_sharded
from graddebug_torch.params import TorchParam

__all__ = ["Group", "Layout", "Sample"]


class Held(Protocol):
    """An optimizer step under way that holds a group's copy from before it."""

    def release(self) -> None:
        """Let go of the copies from before the step."""


def _flat(param: Tensor) -> tuple[Tensor, list[int]] | None:
    """A parameter's entries as one flat view in memory order, and its shape in memory order
    (outermost axis first, axes of size 1 left out); None when no view holds exactly its
    entries."""
    data = _local(param).detach()
    if (type(data) is not Tensor or data.layout != torch.strided or data.is_meta
            or not data.is_floating_point() or data.numel() == 0):
        return None
    order = sorted(range(data.dim()), key=data.stride)
    inner, length = [], 1
    for d in order:  # innermost first: dense exactly when each stride spans the dims inside
        size = data.size(d)
        if size == 1:
            continue
        if data.stride(d) != length:
            return None
        inner.append(size)
        length *= size
    shape = inner[::-1]
    if data.is_contiguous():
        return data.view(-1), shape
    return data.as_strided((data.numel(),), (1,), data.storage_offset()), shape


def _local(param: Tensor) -> Tensor:
    """The entries of a parameter this rank holds: its slice of a ``DTensor`` (FSDP2, tensor
    parallelism), whose row the ranks' rows combine into the whole; else the parameter."""
    if is_sharded(param):
        local: Tensor = param.to_local()  # type: ignore[attr-defined]
        return local
    return param


_Stamp = tuple[int, int]
"""A parameter's ``(data_ptr(), _version)``: either changes when its weights do, except
through ``.data``."""
_NEVER: _Stamp = (-1, -1)


class Group:
    """The samples of one device, dtype and length, in a buffer of two slots with a row for
    each sample. The latest copy of the samples is in slot ``current``, each row as it was
    at its ``stamps``; an optimizer step leaves its change in the other slot.

    Args:
        buffer: ``(2, samples, k)``.
    """

    __slots__ = ("buffer", "current", "held", "samples", "slots", "stamps", "views", "weights")

    def __init__(self, buffer: Tensor) -> None:
        self.buffer = buffer
        self.slots = (buffer[0], buffer[1])
        self.current = 0
        self.samples: list[Sample] = []
        self.views: list[Tensor] = []
        self.stamps: list[_Stamp] = []
        self.held: Held | None = None
        """The plan of an optimizer step under way, whose copy from before the step is the
        slot ``current`` was when it began: a refresh then writes the other slot."""
        self.weights: tuple[Tensor, int] | None = None
        """The norms of both slots and the slot of the copy, while the copy is current."""

    @property
    def acc(self) -> torch.dtype:
        """The dtype its norms are taken in: float64 for float64, else float32 (a half
        precision norm overflows past 65504)."""
        return torch.float64 if self.buffer.dtype == torch.float64 else torch.float32

    def now(self) -> list[_Stamp]:
        """The samples' parameters' stamps now."""
        return [(local.data_ptr(), local._version)
                for local in (_local(s.param) for s in self.samples)]

    def refresh(self) -> bool:
        """Copy the samples whose parameter changed since their row was copied (none, as a
        rule, when the latest change was an optimizer step this module saw), taking their
        views anew where ``.data`` was replaced.

        Returns:
            False when a replaced ``.data`` no longer fits its row (its size, dtype or
            device changed, or it cannot be sampled): the layout must be built again.
        """
        now = self.now()
        if now == self.stamps:
            return True
        changed = [i for i, (a, b) in enumerate(zip(now, self.stamps, strict=True)) if a != b]
        for i in changed:
            if now[i][0] != self.stamps[i][0] and not self._retake(i):
                return False
        slot = self.slots[self.current]
        if self.held is not None:  # the step's copy from before it stays where it is
            self.current = 1 - self.current
            fresh = self.slots[self.current]
            if len(changed) < len(now):
                fresh.copy_(slot)
            slot, self.held = fresh, None
        if len(changed) == len(now):
            torch.stack(self.views, out=slot)
        else:
            torch._foreach_copy_([slot[i] for i in changed], [self.views[i] for i in changed])
        self.stamps, self.weights = now, None
        return True

    def _retake(self, i: int) -> bool:
        """Take sample ``i``'s view anew, of its parameter's new ``.data``; False when that
        no longer fits the row."""
        sample, old = self.samples[i], self.views[i]
        found = _flat(sample.param)
        if found is None:
            return False
        view = found[0][::sample.stride]
        if (view.shape, view.dtype, view.device) != (old.shape, old.dtype, old.device):
            return False
        self.views[i] = view
        return True

    def stepped(self, before: int) -> Tensor:
        """After an optimizer step whose copy from before it is in slot ``before``: copy the
        samples into the other slot, leave their change in ``before``, and return the norms
        of both slots (``[before]``: the change's, the other: the weights')."""
        after = 1 - before
        torch.stack(self.views, out=self.slots[after])
        self.slots[before].sub_(self.slots[after])  # before - after: the same norm
        norms: Tensor = torch.linalg.vector_norm(self.buffer, dim=2, dtype=self.acc)
        self.current, self.stamps, self.held = after, self.now(), None
        self.weights = (norms, after)
        return norms

    def weight_norms(self) -> tuple[Tensor, int]:
        """The norms of the samples' latest copy: ``(norms, slot)``, the copy's row of
        ``norms``."""
        if self.weights is None:
            norms: Tensor = torch.linalg.vector_norm(self.buffer, dim=2, dtype=self.acc)
            self.weights = (norms, self.current)
        return self.weights


@dataclass(eq=False, slots=True)
class Sample:
    """One parameter's sample: a view of every ``stride``-th entry, and its buffer row."""

    index: int
    """The parameter's position among the adapter's watched parameters."""
    param: Tensor
    stride: int
    """Its view holds every ``stride``-th entry (see :func:`graddebug.sampling.sample_stride`)."""
    scale: float
    """``sqrt(numel / k)``: from the sample's norm to the tensor's."""
    position: int
    """Its row in its group's buffer."""


class Layout:
    """Every watched parameter's sample, and the buffers they share.

    Args:
        params: The watched parameters.
    """

    def __init__(self, params: Sequence[TorchParam]) -> None:
        found = [(i, flat) for i, p in enumerate(params) if (flat := _flat(p.param)) is not None]
        planned = sampling.plan([shape for _, (_, shape) in found])
        self.samples: list[tuple[Sample, Group] | None] = [None] * len(params)
        members: dict[tuple[torch.device, torch.dtype, int], list[tuple[int, Tensor, int]]] = {}
        for (i, (entries, _)), plan in zip(found, planned, strict=True):
            view = entries[::plan.stride]
            members.setdefault((view.device, view.dtype, view.numel()), []).append(
                (i, view, plan.stride))
        self.groups: list[Group] = []
        for (device, dtype, k), taken in members.items():
            group = Group(torch.empty((2, len(taken), k), dtype=dtype, device=device))
            for position, (i, view, stride) in enumerate(taken):
                param = params[i].param
                scale = sampling.Sample(_local(param).numel(), stride).scale
                sample = Sample(i, param, stride, scale, position)
                self.samples[i] = (sample, group)
                group.samples.append(sample)
                group.views.append(view)
                group.stamps.append(_NEVER)
            self.groups.append(group)
        self.entries = sum(g.buffer.numel() for g in self.groups)
        """The entries the buffers hold."""


