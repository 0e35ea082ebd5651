"""The optimizer's view of the watched parameters: the ``weight_norm`` and ``update_norm`` of
each parameter row.

``weight_norm`` is the norm of a parameter's weights when its step closes; ``update_norm`` the
norm of the change, ``||w_after - w_before||``, that the latest optimizer step since the
previous close made to them (NaN where none ran, or where ``every=`` skipped the step it ran
in). With ``dbg.step()`` after ``opt.step()`` a row shows the weights and the update of its own
step; with ``dbg.step()`` before it (or Lightning's and the Trainer's callbacks, which close the
step before the optimizer updates), the weights its gradient was computed at and the previous
step's update.

Each parameter is seen through a fixed sample of its entries (:mod:`graddebug_torch.samples`).

Any torch optimizer is followed, through torch's global step hooks, for as long as the
adapter is attached, so that Lightning's, the Trainer's and a plain loop's optimizers are all
seen without being named. One slot holds the latest copy of the samples, each row stamped with
its parameter's ``(data_ptr(), _version)``: an in-place change (an optimizer's, or one under
``torch.no_grad()``) moves the version, a replaced ``.data`` the pointer. The pre-hook keeps
that slot as the copy from before the step, copying first the rows whose stamp moved (none, as
a rule: the latest change was the previous step, and its post-hook copied it). The post-hook
copies the samples into the other slot (one ``torch.stack`` per buffer), subtracts, and takes
the norms of both slots in one reduction: the change's, and the weights' after the step, which
a close whose stamps have not moved since reuses. So a training step reads the sampled entries
once, in the post-hook, and a close adds no device work of its own; everything stays on the
device until the close queues it on the step's single host transfer.

That read is most of the cost: the post-hook's copy, whose strided entries lie on as many
cache lines across all the pages of each weight, read just after the optimizer streamed the
whole model past them, so that each tensor costs some microseconds cold, each page and line
more; the rest is the stamps and the hooks' Python (the Performance page has the breakdown on
the benchmark's MLP). Touching fewer pages would cover fewer rows of each weight, and the
estimates of updates, whose rows differ in scale, would suffer first.

A change made through ``.data`` in place (``p.data.mul_(2)``) moves no stamp, as it escapes
autograd's version counter too: it is seen at the next optimizer step, whose update it joins.
The view of a parameter whose ``.data`` was replaced keeps the old storage until the next check
(a close or a step of an optimizer that holds it). A ``DTensor``'s slice on this rank is
sampled, and the ranks' rows combine. Parameters that cannot be sampled by a view have NaN in
both columns: other tensor subclasses, sparse ones, those that are not dense in memory (a slice
of a larger tensor; a permuted dense tensor, ``channels_last`` say, is sampled in memory order)
and non-float ones. Optimizer steps run inside ``torch.compile`` are not measured.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import WatchContext
from graddebug.capture.layers import FailOpen
from graddebug_torch.params import ParamRow, TorchParam
from graddebug_torch.samples import Group, Layout, Sample

__all__ = ["Batch", "UpdateWatch"]


_NAN = math.nan


class Batch(Protocol):
    """The step's host transfer, as :mod:`graddebug_torch.closing` keeps it."""

    def add(self, tensor: Tensor) -> slice:
        """Queue ``tensor``'s values; return where they will be read."""

    def __getitem__(self, slot: slice) -> list[float]:
        """The fetched values of ``slot``."""


@dataclass(eq=False)
class _Plan:
    """The samples of the watched parameters one optimizer holds, by group."""

    signature: tuple[int, ...]
    """How many parameters each of its ``param_groups`` held when the plan was made."""
    layout: Layout
    groups: dict[Group, list[Sample]]
    waiting: bool = False
    """The pre-hook ran (``before`` holds the weights), the post-hook has not come yet."""
    before: dict[Group, int] = field(default_factory=dict)
    """The slot of each group's copy from before the step."""
    update: list[tuple[Tensor, int, list[Sample]]] = field(default_factory=list)
    """The latest step's norms, one tensor per group with the row of the update's, not yet
    closed."""

    def release(self) -> None:
        """Let go of the copies from before the step."""
        self.waiting = False
        for group in self.before:
            if group.held is self:
                group.held = None
        self.before = {}


def _row(slot: slice, row: int, width: int) -> slice:
    """Where row ``row`` of a ``(2, width)`` norms tensor queued at ``slot`` is read."""
    start = slot.start + row * width
    return slice(start, start + width)


def _signature(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """How many parameters each of the optimizer's ``param_groups`` holds."""
    return tuple(len(group["params"]) for group in optimizer.param_groups)


def _held(layout: Layout, optimizer: torch.optim.Optimizer) -> dict[Group, list[Sample]]:
    """The samples of the parameters ``optimizer`` holds, by group."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    out: dict[Group, list[Sample]] = {}
    for found in layout.samples:
        if found is not None and id(found[0].param) in held:
            out.setdefault(found[1], []).append(found[0])
    return out


class UpdateWatch:
    """Follows every torch optimizer's steps while attached, and measures the weights at each
    recorded close (see the module's docstring).

    Args:
        context: The Watcher's side for hooks (is the open step recorded, which is it).
        params: The watched parameters, in the adapter's order.
        every: ``every=``: one step in ``every`` is recorded.
        guard: The fail-open rule for the hooks and the close's share of the work.
    """

    def __init__(self, context: WatchContext, params: Sequence[TorchParam], every: int,
                 guard: FailOpen) -> None:
        self._ctx = context
        self._params = params
        self._every = every
        self._guard = guard
        self._index = {id(p.row): i for i, p in enumerate(params)}
        self._layout: Layout | None = None  # built when first needed
        self._plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan] = (
            weakref.WeakKeyDictionary())
        self._updated: list[_Plan] = []  # plans with an update not yet closed, oldest first
        self._handles: list[RemovableHandle] = []
        self._weight_slots: list[tuple[slice, Group]] = []
        self._update_slots: list[tuple[slice, list[Sample]]] = []

    @property
    def entries(self) -> int:
        """The entries the samples' buffers hold (0 before the first step)."""
        return self._layout.entries if self._layout is not None else 0

    def attach(self) -> None:
        """Register torch's global optimizer step hooks, when there are parameters to follow
        (a Watcher of taps only may attach inside a compiled function, at its first tap)."""
        if not self._params:
            return
        self._handles += [register_optimizer_step_pre_hook(self.before_step),
                          register_optimizer_step_post_hook(self.after_step)]

    def detach(self) -> None:
        """Remove the hooks and let go of the samples and buffers."""
        handles, self._handles = self._handles, []
        try:
            for handle in handles:
                handle.remove()
        finally:
            self._layout = None
            self._plans = weakref.WeakKeyDictionary()
            self._updated = []
            self._weight_slots, self._update_slots = [], []

    # -- the optimizer's steps -----------------------------------------------------------------

    def before_step(self, optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
        """Optimizer step pre-hook: keep the buffers of the watched parameters it holds, as
        copies of their weights from before the step (copied now where they changed)."""
        with self._guard:
            ctx = self._ctx
            step, every = ctx.step_index, self._every
            # The step's update is read at the close of the step open now, or of the next
            # when that close comes inside optimizer.step() (Lightning's closure).
            if not ctx.active or torch.compiler.is_compiling() or (
                    step % every and (step + 1) % every):
                return
            plan = self._plan(optimizer)
            if plan is None:
                return
            plan.release()
            for group in plan.groups:
                if group.held is not None:  # a step that raised before its post-hook
                    group.held.release()
                group.held = plan
                plan.before[group] = group.current
            plan.waiting = True

    def after_step(self, optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
        """Optimizer step post-hook: copy the samples after the step, and take the norms of
        their change, left on the device.

        The adapter calls it itself from the post-hook of ``watch(optimizer=...)``, which
        torch runs before the global ones and which closes the step; the global hook then
        finds nothing left to do.
        """
        with self._guard:
            plan = self._plans.get(optimizer)
            if plan is None or not plan.waiting:
                return
            before, recording = plan.before, self._ctx.recording
            plan.release()
            if not recording or plan.layout is not self._layout:
                return
            plan.update = [(group.stepped(before[group]), before[group], samples)
                           for group, samples in plan.groups.items()]
            if plan in self._updated:
                self._updated.remove(plan)
            self._updated.append(plan)

    def _plan(self, optimizer: torch.optim.Optimizer) -> _Plan | None:
        """The optimizer's plan, made anew when its ``param_groups`` or the layout changed,
        its buffers brought up to date; None when it holds no sampled parameter."""
        layout = self._layout if self._layout is not None else self._build()
        plan = self._plans.get(optimizer)
        signature = _signature(optimizer)
        if plan is None or plan.signature != signature or plan.layout is not layout:
            plan = self._plans[optimizer] = _Plan(signature, layout, _held(layout, optimizer))
        if not all([group.refresh() for group in plan.groups]):
            layout = self._build()  # a parameter no longer fits its row
            plan = self._plans[optimizer] = _Plan(signature, layout, _held(layout, optimizer))
            for group in plan.groups:
                group.refresh()
        return plan if plan.groups else None

    def _build(self) -> Layout:
        """Build the layout (again): the plans made for the old one are dropped, and with them
        the copies a pre-hook kept."""
        self._plans = weakref.WeakKeyDictionary()
        self._layout = layout = Layout(self._params)
        return layout

    # -- the close -----------------------------------------------------------------------------

    def queue(self, batch: Batch) -> None:
        """Queue the weights' norms and the updates not yet closed on the step's transfer."""
        self._weight_slots, self._update_slots = [], []
        with self._guard:
            layout = self._layout
            if layout is None or not all([group.refresh() for group in layout.groups]):
                layout = self._build()
                for group in layout.groups:
                    group.refresh()
            slots: dict[int, slice] = {}  # one transfer of each norms tensor
            for group in layout.groups:
                norms, row = group.weight_norms()
                slot = slots.get(id(norms)) or slots.setdefault(id(norms), batch.add(norms))
                self._weight_slots.append((_row(slot, row, len(group.samples)), group))
            for plan in self._updated:
                for norms, row, samples in plan.update:
                    slot = slots.get(id(norms)) or slots.setdefault(id(norms), batch.add(norms))
                    self._update_slots.append((_row(slot, row, norms.shape[1]), samples))

    def read(self, batch: Batch, rows: Sequence[ParamRow]) -> tuple[list[float], list[float]]:
        """The fetched ``(weight norms, update norms)`` of ``rows``, NaN where not known."""
        weight = [_NAN] * len(self._params)
        update = [_NAN] * len(self._params)
        for slot, group in self._weight_slots:
            for sample, value in zip(group.samples, batch[slot], strict=True):
                weight[sample.index] = value * sample.scale
        for slot, samples in self._update_slots:  # oldest first: a later step's wins
            values = batch[slot]
            for s in samples:
                update[s.index] = values[s.position] * s.scale
        index = self._index
        where = [index.get(id(row), -1) for row in rows]
        return ([weight[i] if i >= 0 else _NAN for i in where],
                [update[i] if i >= 0 else _NAN for i in where])

    def closed(self) -> None:
        """A step closed, recorded or not: the updates seen so far belong to it."""
        for plan in self._updated:
            plan.update = []
        self._updated = []
        self._weight_slots, self._update_slots = [], []
