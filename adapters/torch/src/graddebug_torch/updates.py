"""The optimizer's view of the watched parameters: the ``weight_norm`` and ``update_norm`` of
each parameter row.

``weight_norm`` is the norm of a parameter's weights when its step closes; ``update_norm`` the
norm of the change, ``||w_after - w_before||``, that the latest optimizer step since the
previous close made to them (NaN where none ran, or where ``every=`` skipped the step it ran
in). With ``dbg.step()`` after ``opt.step()`` a row shows the weights and the update of its own
step; with ``dbg.step()`` before it (or Lightning's and the Trainer's callbacks, which close the
step before the optimizer updates), the weights its gradient was computed at and the previous
step's update.

No copy of the weights is kept. Each parameter is seen through a fixed sample of its entries,
a strided view ``flat[::stride]`` whose stride is a prime near ``numel / k`` that divides none
of the tensor's row lengths, so that the sample walks across the columns of a matrix rather
than down one of them; both norms are the sample's times ``sqrt(numel / k)``, exact for a
tensor small enough to be taken whole (:func:`sample_sizes` says how many entries each tensor
gets). The samples of one device, dtype and length share one buffer of two slots, a row each:
the buffers are the only memory held, at most :data:`FRACTION` of the parameters' entries,
small tensors included.

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

That read is most of the cost. On the benchmark's MLP (16 x Linear 512, two CPU threads) this
module adds about 0.8 ms to a 37 ms step: 0.25-0.3 ms the post-hook's copy, whose 792 entries
of each weight lie on 792 cache lines over all 256 of its 4 KB pages, read just after the
optimizer streamed 32 MB past them (the same copy takes 0.08 ms in a loop of its own, and 0.09
ms in place for 792 contiguous entries: each tensor costs some microseconds cold, each page
and line more); the rest the stamps (three checks a step, 0.6 us a parameter each) and the
hooks' Python. Touching fewer pages would cover fewer rows of each weight, and the estimates
of updates, whose rows differ in scale, would suffer first.

A change made through ``.data`` in place (``p.data.mul_(2)``) moves no stamp, as it escapes
autograd's version counter too: it is seen at the next optimizer step, whose update it joins.
The view of a parameter whose ``.data`` was replaced keeps the old storage until the next check
(a close or a step of an optimizer that holds it). Parameters that cannot be sampled by a view
have NaN in both columns: sharded ones (``DTensor``, FSDP2: each rank holds a slice) and other
tensor subclasses, sparse ones, those that are not dense in memory (a slice of a larger tensor;
a permuted dense tensor, ``channels_last`` say, is sampled in memory order), non-float ones,
and those left out where the budget cannot give every tensor :data:`FEWEST` entries (a model
of a few thousand entries gets none). Optimizer steps run inside ``torch.compile`` are not
measured.
"""

from __future__ import annotations

import functools
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

__all__ = ["FEWEST", "FRACTION", "MOST", "Batch", "UpdateWatch", "sample_sizes"]

FRACTION = 0.01
"""The most entries the buffers hold, both slots, as a fraction of the sampled parameters'
entries."""

MOST = 1024
"""The most entries sampled from one tensor, which bounds the pages a copy touches in a large
one. On a 512-wide MLP whose budget gives its 512 x 512 weights 598 entries each, the
estimates of their updates were off by 3.1% root mean square over 576 steps of SGD, momentum,
Adam and AdamW (11% at worst), and of their weights by 2.9%."""

FEWEST = 32
"""The fewest entries a sampled tensor gets: fewer would be too few to estimate a norm from,
and a sample of a few entries that all happen to be zero would show a moving tensor as still."""

_NAN = math.nan


class Batch(Protocol):
    """The step's host transfer, as :mod:`graddebug_torch.closing` keeps it."""

    def add(self, tensor: Tensor) -> slice:
        """Queue ``tensor``'s values; return where they will be read."""

    def __getitem__(self, slot: slice) -> list[float]:
        """The fetched values of ``slot``."""


def sample_sizes(numels: Sequence[int], fraction: float = FRACTION, most: int = MOST,
                 fewest: int = FEWEST) -> list[int]:
    """How many entries of each tensor to sample (0: none), within a total budget.

    The budget, ``fraction`` of all entries, is shared as water fills a basin: each tensor gets
    ``min(numel, level)`` for the highest level (at most ``most``) the budget reaches, so that
    small tensors are taken whole. Where the level stays below ``fewest`` (a model of many
    small tensors), the tensors under it are taken whole and the largest others get ``fewest``
    entries each while the budget lasts; the rest get none.

    Args:
        numels: Each tensor's number of entries.
        fraction: The budget, as a fraction of ``sum(numels)``.
        most: The most entries of one tensor.
        fewest: The fewest entries of a tensor that is sampled and not whole.

    Returns:
        The sizes, in the order of ``numels``; their sum is at most the budget.
    """
    budget = int(sum(numels) * fraction)
    level = _level(sorted(numels), budget, most)
    if level >= fewest or all(n <= level for n in numels):
        return [min(n, level) for n in numels]
    sizes = [n if n <= level else 0 for n in numels]
    left = budget - sum(sizes)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        take = min(numels[i], fewest)
        if sizes[i] or take > left:
            continue
        sizes[i] = take
        left -= take
    return sizes


def _level(ascending: Sequence[int], budget: int, most: int) -> int:
    """The highest ``c <= most`` with ``sum(min(n, c)) <= budget`` over ``ascending``."""
    whole = 0  # the entries of the tensors below the level, taken whole
    for j, n in enumerate(ascending):
        level = (budget - whole) // (len(ascending) - j)
        if level < n:
            return min(level, most)
        whole += n
    return most


@functools.lru_cache(maxsize=4096)
def _prime_from(n: int) -> int:
    """The smallest prime that is at least ``n``."""
    candidate = max(n, 2)
    while any(candidate % d == 0 for d in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


def _stride(numel: int, k: int, rows: Sequence[int]) -> int:
    """A prime stride that takes at most ``k`` of ``numel`` entries and divides none of the
    row lengths ``rows`` (a stride that does would sample one column only); 1 for all."""
    if k >= numel:
        return 1
    stride = _prime_from(-(-numel // k))
    while any(r % stride == 0 for r in rows):
        stride = _prime_from(stride + 1)
    return stride


def _flat(param: Tensor) -> tuple[Tensor, list[int]] | None:
    """A parameter's entries as one flat view in memory order, and its row lengths (the
    products of its innermost sizes); None when no view holds exactly its entries."""
    data = param.detach()
    if (type(data) is not Tensor or data.layout != torch.strided or data.is_meta
            or not data.is_floating_point() or data.numel() == 0):
        return None
    order = sorted(range(data.dim()), key=data.stride)
    rows, length = [], 1
    for d in order:  # innermost first: dense exactly when each stride spans the dims inside
        size = data.size(d)
        if size == 1:
            continue
        if data.stride(d) != length:
            return None
        if length > 1:
            rows.append(length)
        length *= size
    if data.is_contiguous():
        return data.view(-1), rows
    return data.as_strided((data.numel(),), (1,), data.storage_offset()), rows


_Stamp = tuple[int, int]
"""A parameter's ``(data_ptr(), _version)``: either changes when its weights do, except
through ``.data``."""
_NEVER: _Stamp = (-1, -1)


class _Group:
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
        self.samples: list[_Sample] = []
        self.views: list[Tensor] = []
        self.stamps: list[_Stamp] = []
        self.held: _Plan | None = None
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
        return [(s.param.data_ptr(), s.param._version) for s in self.samples]

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
class _Sample:
    """One parameter's sample: a view of every ``stride``-th entry, and its buffer row."""

    index: int
    """The parameter's position among the adapter's watched parameters."""
    param: Tensor
    stride: int
    """Its view holds every ``stride``-th entry (see :func:`_stride`)."""
    scale: float
    """``sqrt(numel / k)``: from the sample's norm to the tensor's."""
    position: int
    """Its row in its group's buffer."""


class _Layout:
    """Every watched parameter's sample, and the buffers they share.

    Args:
        params: The watched parameters.
    """

    def __init__(self, params: Sequence[TorchParam]) -> None:
        found = [(i, flat) for i, p in enumerate(params) if (flat := _flat(p.param)) is not None]
        # Two slots of each sample are held: the budget goes to them both.
        sizes = sample_sizes([entries.numel() for _, (entries, _) in found], FRACTION / 2)
        self.samples: list[tuple[_Sample, _Group] | None] = [None] * len(params)
        members: dict[tuple[torch.device, torch.dtype, int], list[tuple[int, Tensor, int]]] = {}
        for (i, (entries, rows)), k in zip(found, sizes, strict=True):
            if k:
                stride = _stride(entries.numel(), k, rows)
                view = entries[::stride]
                members.setdefault((view.device, view.dtype, view.numel()), []).append(
                    (i, view, stride))
        self.groups: list[_Group] = []
        for (device, dtype, k), taken in members.items():
            group = _Group(torch.empty((2, len(taken), k), dtype=dtype, device=device))
            for position, (i, view, stride) in enumerate(taken):
                param = params[i].param
                sample = _Sample(i, param, stride, math.sqrt(param.numel() / k), position)
                self.samples[i] = (sample, group)
                group.samples.append(sample)
                group.views.append(view)
                group.stamps.append(_NEVER)
            self.groups.append(group)
        self.entries = sum(g.buffer.numel() for g in self.groups)
        """The entries the buffers hold."""


@dataclass(eq=False)
class _Plan:
    """The samples of the watched parameters one optimizer holds, by group."""

    signature: tuple[int, ...]
    """How many parameters each of its ``param_groups`` held when the plan was made."""
    layout: _Layout
    groups: dict[_Group, list[_Sample]]
    waiting: bool = False
    """The pre-hook ran (``before`` holds the weights), the post-hook has not come yet."""
    before: dict[_Group, int] = field(default_factory=dict)
    """The slot of each group's copy from before the step."""
    update: list[tuple[Tensor, int, list[_Sample]]] = field(default_factory=list)
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


def _held(layout: _Layout, optimizer: torch.optim.Optimizer) -> dict[_Group, list[_Sample]]:
    """The samples of the parameters ``optimizer`` holds, by group."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    out: dict[_Group, list[_Sample]] = {}
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
        self._layout: _Layout | None = None  # built when first needed
        self._plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan] = (
            weakref.WeakKeyDictionary())
        self._updated: list[_Plan] = []  # plans with an update not yet closed, oldest first
        self._handles: list[RemovableHandle] = []
        self._weight_slots: list[tuple[slice, _Group]] = []
        self._update_slots: list[tuple[slice, list[_Sample]]] = []

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

    def _build(self) -> _Layout:
        """Build the layout (again): the plans made for the old one are dropped, and with them
        the copies a pre-hook kept."""
        self._plans = weakref.WeakKeyDictionary()
        self._layout = layout = _Layout(self._params)
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
