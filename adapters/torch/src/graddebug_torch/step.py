"""Closing a step: the captures of one step become records, with one host transfer."""

from __future__ import annotations

import functools
import gc
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import StepResult
from graddebug.capture.layers import keep_label
from graddebug.records import Event, EventKind, Kind, Record, sums_record
from graddebug_torch.sharded import GlobalStats, OnBug, nonfinite_flags, row_values, whole
from graddebug_torch.staging import GroupStats, SmallGrads, StagedGroup
from graddebug_torch.stats import DotSums, acc_dtype, finiteness, unit_summary

__all__ = ["Capture", "CollectorPause", "ForwardChecks", "GradHooks", "ParamRow",
           "StepCaptures", "gather", "kept_array", "shape_text"]

Key = tuple[str, str]


@functools.lru_cache(maxsize=4096)
def shape_text(shape: torch.Size) -> str:
    """``str(tuple(shape))`` as the ``shape`` column holds it, built once per distinct shape."""
    return str(tuple(shape))


_ACTIVATION, _PARAMETER = Kind.ACTIVATION.value, Kind.PARAMETER.value  # Enum.value is slow

_PENDING = torch.empty(0)
"""Stands for a statistic of a staged gradient until the step's batched pass fills it in."""


@dataclass(slots=True)  # one object per hook call, not two: less for the collector
class Capture:
    """Device-side statistics of one gradient seen by one hook call.

    A small gradient is staged instead (``group`` and ``row`` say where, see
    :mod:`graddebug_torch.staging`); its statistics are filled in when the step closes.
    """

    sq: Tensor
    total: Tensor
    extremes: tuple[Tensor, Tensor] | None  # per-unit (max, min)
    absmax: Tensor | None  # only when there is no unit axis
    shape: str  # str(tuple(shape))
    numel: int
    pre_sq: Tensor | None  # sum of squares before an intervention
    n_units: int = 0
    """Number of units (features or channels); 0 without a unit axis."""
    group: StagedGroup | None = None
    row: int = 0

    @property
    def sentinel(self) -> bool:
        """Only the sum of squares and the sum were measured, no extremes (a step that is not
        full, see :mod:`graddebug.capture.tiers`)."""
        return self.group is None and self.extremes is None and self.absmax is None

    @classmethod
    def pending(cls, group: StagedGroup, row: int, shape: str, numel: int,
                n_units: int) -> Capture:
        """The capture of a gradient staged in ``row`` of ``group``."""
        return cls(_PENDING, _PENDING, None, None, shape, numel, None, n_units, group, row)


@dataclass(slots=True)
class ParamRow:
    """A watched parameter at the close of a step (``sharded``: its gradient is a ``DTensor``,
    measured whole by :mod:`graddebug_torch.sharded`).

    One row per parameter lives as long as the adapter: each close fills in ``depth`` and
    ``grad`` and empties ``grad`` after (:func:`graddebug_torch.params.param_rows`), so that a
    model of many small layers allocates no object per parameter and step. ``group`` numbers
    the small parameters of one shape, dtype and device (-1 for the others), whose norms are
    taken in one batched pass.
    """

    layer: str
    tensor: str
    depth: int
    grad: Tensor | None
    keep: bool
    sharded: bool = False
    group: int = -1


class CollectorPause:
    """Pauses Python's cyclic garbage collector while a recorded step's forward and backward
    passes run, as :func:`graddebug.capture.buffer.gc_paused` does while a step closes.

    Each output's tensor hook and capture live until the backward pass has used them. On a
    model of many small layers the young collections that the passes' allocations trigger
    move them all to the oldest generation, whose collections walk the whole heap (every
    module, parameter and tensor of the process): about a fifth of a step on 10,000 layers.
    Paused, they die young. The forward pass is paused by hooks on the root module (the one
    after it runs also when the forward raises); the backward pass from its first recorded
    gradient to its end, where the autograd engine calls back. A backward pass that raises
    before its end is resumed at the next forward, when the step closes, or on exit. A
    collector the user disabled stays disabled.
    """

    __slots__ = ("paused",)

    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        """Pause, if the collector runs and no pause holds it already."""
        if not self.paused and gc.isenabled():
            gc.disable()
            self.paused = True

    def until_backward_ends(self) -> None:
        """Pause, if the collector runs and no pause holds it already, until the running
        backward pass ends."""
        if self.paused or not gc.isenabled():
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.resume)
        except RuntimeError:  # not in a backward pass (a compiled graph's operator)
            return
        gc.disable()
        self.paused = True

    def resume(self) -> None:
        """Resume the collector if this pause stopped it."""
        if self.paused:
            self.paused = False
            gc.enable()


class GradHooks:
    """The tensor hooks of one step, removed together when it closes.

    A plain tensor's hook goes straight into its hook dictionary, as ``Tensor.register_hook``
    does, without the handle and weak reference that call makes: on a model of 10,000 small
    layers those two objects a layer lived until the step closed, so the collector moved
    them to its oldest generation and walked the whole heap about once a step. Subclasses
    (``__torch_function__``) go through ``register_hook``.
    """

    __slots__ = ("_dicts", "_handles", "_ids")

    def __init__(self) -> None:
        self._dicts: list[dict[int, Any]] = []
        self._ids: list[int] = []
        self._handles: list[RemovableHandle] = []

    def add(self, tensor: Tensor, hook: Callable[[Tensor], Tensor | None]) -> None:
        """Register ``hook`` on ``tensor``'s gradient until :meth:`remove`."""
        hooks = tensor._backward_hooks if type(tensor) is Tensor else None
        if hooks is None:
            if type(tensor) is not Tensor or tensor.grad_fn is None:
                self._handles.append(tensor.register_hook(hook))
                return
            hooks = tensor._backward_hooks = OrderedDict()
            tensor.grad_fn._register_hook_dict(tensor)
        key = RemovableHandle.next_id  # the ids register_hook hands out: never a clash
        RemovableHandle.next_id = key + 1
        hooks[key] = hook
        self._dicts.append(hooks)
        self._ids.append(key)

    def remove(self) -> None:
        """Remove every hook this step registered."""
        for hooks, key in zip(self._dicts, self._ids, strict=True):
            hooks.pop(key, None)
        for handle in self._handles:
            handle.remove()
        self._dicts, self._ids, self._handles = [], [], []


class ForwardChecks:
    """The forward finiteness checks of one step: per watched output a number that is finite
    exactly when the output is (:func:`~graddebug_torch.stats.finiteness`), read at the step's
    single sync.

    A small output that needs a gradient is copied into a staging buffer of its shape (one
    kernel, as costly as the sum it replaces) and the buffer is summed row by row when the
    step closes. The checks live in parallel lists rather than a tuple each, so that the
    usual check adds no object that outlives the step's young collections.
    """

    __slots__ = ("_groups", "_rows", "_staging", "_sums", "_values", "depths", "keys")

    def __init__(self, staging: SmallGrads, sums: DotSums) -> None:
        self._staging = staging
        self._sums = sums
        self.keys: list[Key] = []
        self.depths: list[int] = []
        self._values: list[Tensor | None] = []
        self._groups: list[StagedGroup | None] = []
        self._rows: list[int] = []

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: Key, depth: int, value: Tensor) -> None:
        """Add a check already reduced to its number (a compiled graph's, an op's)."""
        self.keys.append(key)
        self.depths.append(depth)
        self._values.append(value)
        self._groups.append(None)
        self._rows.append(0)

    def check(self, key: Key, depth: int, tensor: Tensor) -> None:
        """Add the check of output ``key``, a floating ``tensor``."""
        if not (tensor.requires_grad and SmallGrads.fits(tensor)):
            self.add(key, depth, finiteness(tensor, self._sums))
            return
        group = self._staging.group(tensor, None)
        self.keys.append(key)
        self.depths.append(depth)
        self._values.append(None)
        self._groups.append(group)
        self._rows.append(group.put(tensor))

    def gather(self) -> Tensor:
        """Every check's number, in the order they were added (one tensor)."""
        parts: list[Tensor] = []
        direct = [v for v in self._values if v is not None]
        if direct:
            parts.append(_stack(direct))
        offsets: dict[int, int] = {}
        size = len(direct)
        for group in self._groups:
            if group is not None and id(group) not in offsets:
                offsets[id(group)] = size
                parts.append(group.sums())
                size += group.used
        if not offsets:
            return parts[0]
        order, at = [], 0
        for group, row in zip(self._groups, self._rows, strict=True):
            if group is None:
                order.append(at)
                at += 1
            else:
                order.append(offsets[id(group)] + row)
        joined = torch.cat(parts) if len(parts) > 1 else parts[0]
        return joined[torch.tensor(order, device=joined.device)]


@dataclass
class StepCaptures:
    """Everything captured in the open step; dropped when it closes.

    ``touched`` says that a parameter gradient arrived (recorded or not); ``transformed`` that
    a watched module ran inside a ``torch.func`` transform, unrecorded.
    """

    forward: ForwardChecks
    captures: dict[Key, Capture] = field(default_factory=dict)
    """The first call's capture of each output; :meth:`calls` has them all."""
    repeats: dict[Key, list[Capture]] = field(default_factory=dict)
    """Every call's capture, for outputs captured more than once (a module called twice)."""
    expected: dict[Key, int] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    kept: dict[str, np.ndarray] = field(default_factory=dict)
    # Through a lambda: dynamo, tracing a tap's first call in a compiled function, inlines
    # it, where calling the class as the factory would break the graph.
    hooks: GradHooks = field(default_factory=lambda: GradHooks())
    received: dict[int, Tensor] = field(default_factory=dict)
    """The gradients the post-accumulate hooks held, by parameter index (measured when the
    step closes)."""
    tap_requires_grad: bool = False
    touched: bool = False
    transformed: bool = False

    def add(self, key: Key, capture: Capture) -> int:
        """Add one call's capture of output ``key``; return how many came before it.

        The usual output, captured once a step, costs a dictionary entry and no list: each
        object that lives until the step closes is one more for the collector to move.
        """
        first = self.captures.get(key)
        if first is None:
            self.captures[key] = capture
            return 0
        calls = self.repeats.get(key)
        if calls is None:
            calls = self.repeats[key] = [first]
        calls.append(capture)
        return len(calls) - 1

    def calls(self) -> dict[Key, list[Capture]]:
        """Every output's captures, one per call, in the order the outputs were first seen."""
        repeats = self.repeats
        return {key: repeats.get(key, [c]) for key, c in self.captures.items()}


class _HostBatch:
    """Device tensors queued in order, moved to the host in one transfer, read back by slot."""

    def __init__(self) -> None:
        self._parts: list[Tensor] = []
        self._size = 0
        self._values: list[float] = []

    def add(self, tensor: Tensor) -> slice:
        n = tensor.numel()
        slot = slice(self._size, self._size + n)
        self._parts.append(tensor.reshape(-1))
        self._size += n
        return slot

    def fetch(self) -> None:
        self._values = _to_host(self._parts)

    def __getitem__(self, slot: slice) -> list[float]:
        return self._values[slot]


def gather(step: int, state: StepCaptures, params: Sequence[ParamRow], depths: dict[str, int],
           full: bool, staging: SmallGrads | None = None, sharded: GlobalStats | None = None,
           on_bug: OnBug | None = None) -> StepResult:
    """Turn one step's captures and parameter gradients into records and events.

    Args:
        step: Index of the step.
        state: What the hooks captured.
        params: Every watched parameter that requires a gradient.
        depths: Forward-order depth of each layer and tap name.
        full: Also compute mean and absmax of parameter gradients.
        staging: Where the hooks staged small gradients (reduced here, in one pass a shape).
        sharded: The whole-gradient statistics of the ``sharded`` rows of ``params``, in
            their order (:func:`graddebug_torch.sharded.reduce_sharded`); None leaves those
            rows out.
        on_bug: Where a failure to look at a sharded gradient's slice goes.

    Returns:
        The step's records, events and kept arrays.
    """
    present = [p for p in params if p.grad is not None]
    captures, repeats = state.captures, state.repeats
    if not captures and not present:
        # No backward ran in this step; what forward saw (a tap cut from the graph) stands.
        return StepResult(events=list(state.events))
    batch = _HostBatch()
    every = ([c for calls in state.calls().values() for c in calls] if repeats
             else list(captures.values()))

    # Staged (small) gradients: one batched pass per group of equal shapes, read by row.
    staged = staging.reduce() if staging is not None else {}
    staged_slots = {group: (batch.add(g.sq), batch.add(g.total), batch.add(g.absmax),
                            batch.add(g.live) if g.live is not None else None)
                    for group, g in staged.items()}

    # Other activation scalars, stacked into one tensor; positions remembered per capture.
    scalars: list[Tensor] = []
    where: dict[int, int] = {}
    for c in every:
        if c.group is not None:
            continue
        where[id(c)] = len(scalars)
        scalars += [c.sq, c.total]
        if c.absmax is not None:
            scalars.append(c.absmax)
        if c.pre_sq is not None:
            scalars.append(c.pre_sq)
    scalar_slot = batch.add(_stack(scalars)) if scalars else slice(0, 0)

    # Per-unit extremes: one batched summary per group of equally wide captures.
    groups: dict[tuple[int, torch.dtype, torch.device], list[Capture]] = {}
    for c in every:
        if c.extremes is not None:
            high = c.extremes[0]
            groups.setdefault((c.n_units, high.dtype, high.device), []).append(c)
    unit_slots = []
    for members in groups.values():
        absmax, live = unit_summary([c.extremes[0] for c in members if c.extremes],
                                    [c.extremes[1] for c in members if c.extremes])
        unit_slots.append((members, batch.add(absmax), batch.add(live)))
    # A layer called several times: a unit is dead only if it is dead in every call.
    pooled: dict[Key, slice] = {}
    for key, calls in repeats.items():
        widths = {c.n_units for c in calls}
        if len(widths) == 1 and 0 not in widths:
            per_unit = torch.stack([_per_unit(c, staged) for c in calls]).amax(0)
            pooled[key] = batch.add(torch.count_nonzero(per_unit))

    # Parameters: their norms in one fused pass (a batched one per group of small ones).
    # Sharded ones were combined over the ranks already.
    where_sharded = {id(p): i for i, p in enumerate(p for p in params if p.sharded)}
    local = [p for p in present if not p.sharded]
    local_grads: list[Tensor] = []
    local_groups: list[int] = []
    for p in local:
        if p.grad is not None:
            local_grads.append(_dense(p.grad) if p.grad.is_sparse else p.grad)
            local_groups.append(p.group)
    norm_parts = [(order, batch.add(norms))
                  for order, norms in _norms(local_grads, local_groups)]
    full_slots = {id(p): batch.add(_full_stats(_dense(p.grad))) for p in local
                  if p.grad is not None} if full else {}
    sharded_slot = batch.add(sharded.values) if sharded is not None else slice(0, 0)
    checks = state.forward
    forward_slot = batch.add(checks.gather()) if len(checks) else slice(0, 0)

    batch.fetch()  # the step's single host sync

    result = StepResult(events=list(state.events), kept=dict(state.kept))
    fetched = _Fetched(batch, scalar_slot, where, unit_slots, staged_slots)
    records = result.records
    for key, first in captures.items():
        depth = depths.get(key[0], -1)
        repeated = repeats.get(key) if repeats else None
        if repeated is None:  # the usual output, called once
            sq, total, top, pre_sq, alive = fetched.values(first)
            records.append(_activation_row(step, key, depth, first, first.numel, sq, total,
                                           top, pre_sq, alive, first.sentinel))
        else:
            records.append(_repeated_row(step, key, depth, repeated, fetched,
                                         batch[pooled[key]][0] if key in pooled else None))

    local_values = [0.0] * len(local_grads)
    for order, slot in norm_parts:
        for i, value in zip(order, batch[slot], strict=True):
            local_values[i] = value
    local_norms = iter(local_values)
    whole_values = batch[sharded_slot]
    broken: list[tuple[ParamRow, Tensor, float, list[float] | None]] = []
    new_row, nan = tuple.__new__, math.nan
    for p in present:
        grad = p.grad
        assert grad is not None
        if p.sharded:
            found = (row_values(whole_values, where_sharded[id(p)], full)
                     if sharded is not None else None)
            if found is None:  # not combined, or a rank failed to measure its slice
                continue
            norm, extra = found
            if not math.isfinite(norm):
                broken.append((p, grad, norm, extra))
                continue
            records.append(_param_record(step, p, grad, norm, extra, (False, False)))
            continue
        norm = next(local_norms)
        if full or not math.isfinite(norm) or grad.is_sparse:
            extra = batch[full_slots[id(p)]] if full else None
            records.append(_param_record(step, p, _dense(grad), norm, extra))
        else:  # the usual row, built inline: a large model has tens of thousands a step
            records.append(new_row(Record, (
                step, p.layer, p.tensor, _PARAMETER, p.depth, shape_text(grad.shape),
                grad.numel(), norm, nan, nan, nan, nan, False, False, nan, 0)))
    if broken:  # every rank sees the same combined norms, so all of them come here together
        flags = nonfinite_flags([g for _, g, _, _ in broken], on_bug or _ignore)
        for (p, grad, norm, extra), pair in zip(broken, flags, strict=True):
            records.append(_param_record(step, p, grad, norm, extra, pair))

    for key, depth, value in zip(checks.keys, checks.depths, batch[forward_slot], strict=True):
        if not math.isfinite(value):
            result.events.append(Event(step, key[0], key[1], depth,
                                       EventKind.FORWARD_NONFINITE.value,
                                       "NaN" if math.isnan(value) else "Inf"))
    for (layer, tname), depth in state.expected.items():
        if (layer, tname) not in captures:
            result.events.append(Event(step, layer, tname, depth, EventKind.UNREACHED.value))
    for p in params:
        if p.grad is None:
            result.events.append(Event(step, p.layer, p.tensor, p.depth,
                                       EventKind.NO_GRAD.value))
        elif p.keep and (sharded is not None or not p.sharded):
            result.kept[keep_label(p.layer, p.tensor)] = kept_array(whole(p.grad))
    return result


# sum of squares, sum, absmax, sum of squares before an intervention, live units
_Values = tuple[float, float, float, float | None, float | None]


class _Fetched:
    """The fetched statistics of the step's activation captures."""

    __slots__ = ("_columns", "_scalars", "_units", "_where")

    def __init__(self, batch: _HostBatch, scalar_slot: slice, where: dict[int, int],
                 unit_slots: list[tuple[list[Capture], slice, slice]],
                 staged_slots: dict[StagedGroup, tuple[slice, slice, slice, slice | None]]
                 ) -> None:
        self._scalars = batch[scalar_slot]
        self._where = where
        self._units: dict[int, tuple[float, float]] = {}
        for members, absmax_slot, live_slot in unit_slots:
            for c, a, n in zip(members, batch[absmax_slot], batch[live_slot], strict=True):
                self._units[id(c)] = (a, n)
        self._columns = {group: (batch[sq], batch[total], batch[absmax],
                                 batch[live] if live is not None else None)
                         for group, (sq, total, absmax, live) in staged_slots.items()}

    def values(self, c: Capture) -> _Values:
        """The statistics of capture ``c``."""
        if c.group is not None:
            row = c.row
            sqs, totals, absmaxes, lives = self._columns[c.group]
            return (sqs[row], totals[row], absmaxes[row], None,
                    lives[row] if lives is not None else None)
        values = self._scalars
        at = self._where[id(c)]
        sq, total = values[at], values[at + 1]
        at += 2
        live = None
        if c.absmax is not None:
            absmax = values[at]
            at += 1
        elif c.extremes is not None:
            absmax, live = self._units[id(c)]
        else:  # a sentinel
            absmax = math.nan
        return sq, total, absmax, values[at] if c.pre_sq is not None else None, live


def _per_unit(c: Capture, staged: dict[StagedGroup, GroupStats]) -> Tensor:
    """Largest ``|g|`` of each unit of one capture."""
    if c.group is not None:
        per_unit = staged[c.group].per_unit
        assert per_unit is not None
        return per_unit[c.row]
    assert c.extremes is not None
    return torch.maximum(c.extremes[0], c.extremes[1].neg())


def kept_array(grad: Tensor) -> np.ndarray:
    """A gradient as ``keep=`` keeps it: a dense numpy copy on the host. Sparse gradients
    (``Embedding(sparse=True)``) are densified; floating dtypes numpy lacks or computes poorly
    (bfloat16, float16 under autocast) become float32, which holds them exactly."""
    out = grad.detach()
    if out.layout != torch.strided:
        out = out.to_dense()
    if out.is_floating_point() and out.dtype not in (torch.float32, torch.float64):
        out = out.float()
    return out.cpu().numpy().copy()


def _repeated_row(step: int, key: Key, depth: int, calls: list[Capture], fetched: _Fetched,
                  pooled_live: float | None) -> Record:
    """The row of an output captured by several calls (a module called twice): the calls'
    sums add up, and a unit is live if it is in any call (``pooled_live``)."""
    sq = total = pre_sum = 0.0
    absmax = -math.inf
    pre = False
    for c in calls:
        c_sq, c_total, value, c_pre, _ = fetched.values(c)
        sq += c_sq
        total += c_total
        absmax = value if math.isnan(value) or math.isnan(absmax) else max(absmax, value)
        if c_pre is not None:
            pre_sum += c_pre
            pre = True
    return _activation_row(step, key, depth, calls[0], sum(c.numel for c in calls), sq, total,
                           absmax, pre_sum if pre else None, pooled_live,
                           any(c.sentinel for c in calls))


def _activation_row(step: int, key: Key, depth: int, first: Capture, numel: int, sq: float,
                    total: float, absmax: float, pre_sq: float | None, live: float | None,
                    sentinel: bool) -> Record:
    """The row of an output from its summed statistics (``first`` gives the shape and the
    units)."""
    if sentinel:
        # Squares are never negative, so the sum of squares is NaN exactly when an entry is;
        # it is Inf for an Inf entry or for finite entries whose squares overflow, which the
        # sum tells apart (it stays finite for the latter).
        nan = math.isnan(sq)
        inf = not nan and math.isinf(sq) and not math.isfinite(total)
        absmax, live = math.nan, None
    else:
        nan, inf = math.isnan(absmax), math.isinf(absmax)
    units = first.n_units
    return sums_record(
        step, key[0], key[1], _ACTIVATION, depth, first.shape, numel,
        math.sqrt(sq) if sq >= 0 else math.nan, total, absmax,
        (units - live) / units if live is not None and units else math.nan, nan, inf,
        math.sqrt(pre_sq) if pre_sq is not None else math.nan)


def _param_record(step: int, p: ParamRow, grad: Tensor, norm: float,
                  extra: list[float] | None, flags: tuple[bool, bool] | None = None) -> Record:
    """A parameter's row. ``grad`` gives the shape and size (a sharded gradient's are those
    of the whole parameter); ``flags`` are its ``(nan, inf)`` where the caller knows them."""
    nan, inf = flags if flags is not None else (False, False)
    if flags is None and not math.isfinite(norm):
        # Rare: a second sync, only for a gradient already known to be broken.
        nan = bool(torch.isnan(grad).any())
        inf = bool(torch.isinf(grad).any())
    if extra is None:  # param_stats="norm": no mean, std or absmax to derive
        return tuple.__new__(Record, (
            step, p.layer, p.tensor, _PARAMETER, p.depth, shape_text(grad.shape), grad.numel(),
            norm, math.nan, math.nan, math.nan, math.nan, nan, inf and not nan, math.nan, 0))
    return sums_record(step, p.layer, p.tensor, _PARAMETER, p.depth, shape_text(grad.shape),
                       grad.numel(), norm, extra[0], extra[1], math.nan, nan, inf)


_NATIVE = (torch.float32, torch.float64)
"""Dtypes whose norms ``_foreach_norm`` accumulates in their own precision without loss."""


def _norms(grads: Sequence[Tensor], groups: Sequence[int]) -> list[tuple[list[int], Tensor]]:
    """L2 norms of ``grads``, as ``(positions, norms)`` parts.

    On CPU ``_foreach_norm`` is a loop of one kernel per tensor; the gradients of one group
    (``groups``, from :attr:`ParamRow.group`: small parameters of one shape, dtype and
    device; -1 for none) are stacked instead, one kernel per group, which on a model of many
    small layers is 10-20x faster. A group that no longer stacks (a parameter moved since)
    is measured one gradient at a time.
    """
    small: dict[int, list[int]] = {}
    large: list[int] = []
    for i, group in enumerate(groups):
        if group < 0:
            large.append(i)
        else:
            small.setdefault(group, []).append(i)
    parts = []
    for order in small.values():
        if len(order) > 1:
            try:
                stacked = torch.stack([grads[i] for i in order])
            except RuntimeError:
                large += order
                continue
            acc = torch.float64 if stacked.dtype == torch.float64 else torch.float32
            parts.append((order, torch.linalg.vector_norm(stacked.reshape(len(order), -1),
                                                          dim=1, dtype=acc)))
        else:
            large += order
    # _foreach_norm returns a half gradient's norm in half precision, which overflows past
    # 65504: half gradients are reduced in float32, the others in their own dtype.
    native = [i for i in large if grads[i].dtype in _NATIVE]
    upcast = [i for i in large if grads[i].dtype not in _NATIVE]
    if native:
        parts.append((native, _stack(torch._foreach_norm([grads[i] for i in native]))))
    if upcast:
        parts.append((upcast, _stack(torch._foreach_norm([grads[i] for i in upcast], 2,
                                                         dtype=torch.float32))))
    return parts


def _ignore(exc: BaseException, where: str) -> None:
    """Drop a failure nobody asked to hear of."""


def _dense(grad: Tensor) -> Tensor:
    return grad.coalesce().values() if grad.is_sparse else grad


def _full_stats(grad: Tensor) -> Tensor:
    low, high = torch.aminmax(grad)
    return _stack([grad.sum(dtype=acc_dtype(grad)), torch.maximum(high, low.neg())])


def _stack(scalars: Sequence[Tensor]) -> Tensor:
    """Stack 0-d tensors; mixed dtypes (a float64 tensor among float32 ones) go to float64."""
    first = scalars[0].dtype
    if any(s.dtype != first for s in scalars):
        return torch.stack([s.to(torch.float64) for s in scalars])
    return torch.stack(list(scalars))


def _to_host(parts: list[Tensor]) -> list[float]:
    """Concatenate 1-D tensors and copy them to the host: one sync per device."""
    if not parts:
        return []
    wide = any(p.dtype == torch.float64 for p in parts)
    dtype = torch.float64 if wide else torch.float32
    flat = [p.to(dtype) for p in parts]
    devices = {p.device for p in flat}
    if len(devices) == 1:
        values: list[float] = torch.cat(flat).tolist()
        return values
    # Several devices: one transfer each, then restore the original order.
    on_host = [p.to("cpu", non_blocking=True) for p in flat]
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    values = torch.cat(on_host).tolist()
    return values
