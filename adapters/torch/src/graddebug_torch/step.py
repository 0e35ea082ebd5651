"""Closing a step: the captures of one step become records, with one host transfer."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import StepResult
from graddebug.capture.layers import keep_label
from graddebug.records import Event, EventKind, Kind, Record
from graddebug_torch.sharded import GlobalStats, OnBug, nonfinite_flags, row_values, whole
from graddebug_torch.staging import SMALL_NUMEL, GroupStats, SmallGrads, StagedGroup
from graddebug_torch.stats import acc_dtype, unit_summary

__all__ = ["Capture", "ParamGrad", "ParamRow", "StepCaptures", "gather", "kept_array",
           "shape_text"]

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

    A small gradient is staged instead (``staged`` holds its group and row, see
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
    staged: tuple[StagedGroup, int] | None = None

    @property
    def sentinel(self) -> bool:
        """Only the sum of squares and the sum were measured, no extremes (a step that is not
        full, see :mod:`graddebug.capture.tiers`)."""
        return self.staged is None and self.extremes is None and self.absmax is None

    @classmethod
    def pending(cls, staged: tuple[StagedGroup, int], shape: str, numel: int,
                n_units: int) -> Capture:
        """The capture of a staged gradient."""
        return cls(_PENDING, _PENDING, None, None, shape, numel, None, n_units, staged)


@dataclass(slots=True)
class ParamGrad:
    """A parameter gradient as the post-accumulate hook saw it, with its sum of squares taken
    while it was still in cache (None when it must be recomputed at the step's close)."""

    grad: Tensor
    sq: Tensor | None
    version: int


@dataclass(slots=True)
class ParamRow:
    """A watched parameter at the close of a step (``sharded``: its gradient is a ``DTensor``,
    measured whole by :mod:`graddebug_torch.sharded`)."""

    layer: str
    tensor: str
    depth: int
    grad: Tensor | None
    sq: Tensor | None
    keep: bool
    sharded: bool = False


@dataclass
class StepCaptures:
    """Everything captured in the open step; dropped when it closes.

    ``touched`` says that a parameter gradient arrived (recorded or not); ``transformed`` that
    a watched module ran inside a ``torch.func`` transform, unrecorded; ``changed_in_place``
    that the gradients were changed unseen by their version counters (a loss scaler
    unscaling them), so the sums of squares taken in the hooks are stale.
    """

    captures: dict[Key, list[Capture]] = field(default_factory=dict)
    expected: dict[Key, int] = field(default_factory=dict)
    forward_sums: list[tuple[Key, int, Tensor]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    kept: dict[str, np.ndarray] = field(default_factory=dict)
    handles: list[RemovableHandle] = field(default_factory=list)
    received: dict[int, ParamGrad] = field(default_factory=dict)
    tap_requires_grad: bool = False
    touched: bool = False
    transformed: bool = False
    changed_in_place: bool = False


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
    if not state.captures and not present:
        # No backward ran in this step; what forward saw (a tap cut from the graph) stands.
        return StepResult(events=list(state.events))
    batch = _HostBatch()

    # Staged (small) gradients: one batched pass per group of equal shapes, read by row.
    staged = staging.reduce() if staging is not None else {}
    staged_slots = {key: (batch.add(g.sq), batch.add(g.total), batch.add(g.absmax),
                          batch.add(g.live) if g.live is not None else None)
                    for key, g in staged.items()}

    # Other activation scalars, stacked into one tensor; positions remembered per capture.
    scalars: list[Tensor] = []
    where: dict[int, int] = {}
    for calls in state.captures.values():
        for c in calls:
            if c.staged is not None:
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
    for calls in state.captures.values():
        for c in calls:
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
    for key, calls in state.captures.items():
        widths = {c.n_units for c in calls}
        if len(calls) > 1 and len(widths) == 1 and 0 not in widths:
            per_unit = torch.stack([_per_unit(c, staged) for c in calls]).amax(0)
            pooled[key] = batch.add(torch.count_nonzero(per_unit))

    # Parameters: sums of squares taken in the backward hook, and one fused pass for the rest.
    # Sharded ones were combined over the ranks already.
    where_sharded = {id(p): i for i, p in enumerate(p for p in params if p.sharded)}
    local = [p for p in present if not p.sharded]
    late = [p for p in local if p.sq is None]
    early_slot = batch.add(_stack([p.sq for p in local if p.sq is not None])) \
        if len(late) < len(local) else slice(0, 0)
    late_grads = [_dense(p.grad) for p in late if p.grad is not None]
    late_parts = [(order, batch.add(norms)) for order, norms in _norms(late_grads)]
    full_slots = {id(p): batch.add(_full_stats(_dense(p.grad))) for p in local
                  if p.grad is not None} if full else {}
    sharded_slot = batch.add(sharded.values) if sharded is not None else slice(0, 0)
    forward_slot = (batch.add(torch.stack([s for _, _, s in state.forward_sums]))
                    if state.forward_sums else slice(0, 0))

    batch.fetch()  # the step's single host sync

    result = StepResult(events=list(state.events), kept=dict(state.kept))
    act = _activation_values(state, batch, scalar_slot, where, unit_slots, staged_slots)
    for key, calls in state.captures.items():
        result.records.append(_activation_record(
            step, key, depths.get(key[0], -1), calls, act,
            batch[pooled[key]][0] if key in pooled else None))

    early = iter(batch[early_slot])
    late_values = [0.0] * len(late_grads)
    for order, slot in late_parts:
        for i, value in zip(order, batch[slot], strict=True):
            late_values[i] = value
    late_norms = iter(late_values)
    whole_values = batch[sharded_slot]
    broken: list[tuple[ParamRow, Tensor, float, list[float] | None]] = []
    for p in present:
        assert p.grad is not None
        if p.sharded:
            found = (row_values(whole_values, where_sharded[id(p)], full)
                     if sharded is not None else None)
            if found is None:  # not combined, or a rank failed to measure its slice
                continue
            norm, extra = found
            if not math.isfinite(norm):
                broken.append((p, p.grad, norm, extra))
                continue
            result.records.append(_param_record(step, p, p.grad, norm, extra, (False, False)))
            continue
        norm = math.sqrt(next(early)) if p.sq is not None else next(late_norms)
        extra = batch[full_slots[id(p)]] if full else None
        result.records.append(_param_record(step, p, _dense(p.grad), norm, extra))
    if broken:  # every rank sees the same combined norms, so all of them come here together
        flags = nonfinite_flags([g for _, g, _, _ in broken], on_bug or _ignore)
        for (p, grad, norm, extra), pair in zip(broken, flags, strict=True):
            result.records.append(_param_record(step, p, grad, norm, extra, pair))

    for (key, depth, _), value in zip(state.forward_sums, batch[forward_slot], strict=True):
        if not math.isfinite(value):
            result.events.append(Event(step, key[0], key[1], depth,
                                       EventKind.FORWARD_NONFINITE.value,
                                       "NaN" if math.isnan(value) else "Inf"))
    for (layer, tname), depth in state.expected.items():
        if (layer, tname) not in state.captures:
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


def _activation_values(state: StepCaptures, batch: _HostBatch, scalar_slot: slice,
                       where: dict[int, int],
                       unit_slots: list[tuple[list[Capture], slice, slice]],
                       staged_slots: dict[Any, tuple[slice, slice, slice, slice | None]],
                       ) -> dict[int, _Values]:
    """The fetched statistics of every capture, by ``id``."""
    values = batch[scalar_slot]
    unit: dict[int, tuple[float, float]] = {}
    for members, absmax_slot, live_slot in unit_slots:
        for c, a, n in zip(members, batch[absmax_slot], batch[live_slot], strict=True):
            unit[id(c)] = (a, n)
    columns = {key: (batch[sq], batch[total], batch[absmax],
                     batch[live] if live is not None else None)
               for key, (sq, total, absmax, live) in staged_slots.items()}
    out: dict[int, _Values] = {}
    for calls in state.captures.values():
        for c in calls:
            if c.staged is not None:
                group, row = c.staged
                sqs, totals, absmaxes, lives = columns[group.key]
                out[id(c)] = (sqs[row], totals[row], absmaxes[row], None,
                              lives[row] if lives is not None else None)
                continue
            at = where[id(c)]
            sq, total = values[at], values[at + 1]
            at += 2
            live = None
            if c.absmax is not None:
                absmax = values[at]
                at += 1
            elif c.extremes is not None:
                absmax, live = unit[id(c)]
            else:  # a sentinel
                absmax = math.nan
            out[id(c)] = (sq, total, absmax, values[at] if c.pre_sq is not None else None,
                          live)
    return out


def _per_unit(c: Capture, staged: dict[Any, GroupStats]) -> Tensor:
    """Largest ``|g|`` of each unit of one capture."""
    if c.staged is not None:
        group, row = c.staged
        per_unit = staged[group.key].per_unit
        assert per_unit is not None
        return per_unit[row]
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


def _activation_record(step: int, key: Key, depth: int, calls: list[Capture],
                       act: dict[int, _Values], pooled_live: float | None) -> Record:
    sq = total = pre_sq = 0.0
    absmax = -math.inf
    pre = False
    for c in calls:
        c_sq, c_total, value, c_pre, _ = act[id(c)]
        sq += c_sq
        total += c_total
        absmax = value if math.isnan(value) or math.isnan(absmax) else max(absmax, value)
        if c_pre is not None:
            pre_sq += c_pre
            pre = True
    first = calls[0]
    live = act[id(first)][4] if len(calls) == 1 else pooled_live
    units = first.n_units
    numel = first.numel if len(calls) == 1 else sum(c.numel for c in calls)
    if any(c.sentinel for c in calls):
        # Squares are never negative, so the sum of squares is NaN exactly when an entry is;
        # it is Inf for an Inf entry or for finite entries whose squares overflow, which the
        # sum tells apart (it stays finite for the latter).
        nan = math.isnan(sq)
        inf = not nan and math.isinf(sq) and not math.isfinite(total)
        absmax, live = math.nan, None
    else:
        nan, inf = math.isnan(absmax), math.isinf(absmax)
    return _record(
        step, key[0], key[1], _ACTIVATION, depth, first.shape, numel,
        norm=math.sqrt(sq) if sq >= 0 else math.nan,
        total=total,
        absmax=absmax,
        zero_frac=(units - live) / units if live is not None and units else math.nan,
        nan=nan,
        inf=inf,
        pre_norm=math.sqrt(pre_sq) if pre else math.nan,
    )


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
    return _record(step, p.layer, p.tensor, _PARAMETER, p.depth, shape_text(grad.shape),
                   grad.numel(), norm, extra[0], extra[1], math.nan, nan, inf)


def _record(step: int, layer: str, tensor: str, kind: str, depth: int, shape: str,
            numel: int, norm: float, total: float, absmax: float, zero_frac: float,
            nan: bool, inf: bool, pre_norm: float = math.nan) -> Record:
    return Record.from_sums(step, layer, tensor, kind, depth, shape, numel, norm=norm,
                            total=total, absmax=absmax, zero_frac=zero_frac, nan=nan, inf=inf,
                            pre_norm=pre_norm)


_NATIVE = (torch.float32, torch.float64)
"""Dtypes whose norms ``_foreach_norm`` accumulates in their own precision without loss."""


def _norms(grads: Sequence[Tensor]) -> list[tuple[list[int], Tensor]]:
    """L2 norms of ``grads``, as ``(positions, norms)`` parts.

    On CPU ``_foreach_norm`` is a loop of one kernel per tensor; gradients of at most
    :data:`~graddebug_torch.staging.SMALL_NUMEL` entries are stacked by shape instead, one
    kernel per shape, which on a model of many small layers is 10-20x faster.
    """
    small: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = {}
    large: list[int] = []
    for i, g in enumerate(grads):
        if g.numel() <= SMALL_NUMEL and g.layout == torch.strided:
            small.setdefault((g.shape, g.dtype, g.device), []).append(i)
        else:
            large.append(i)
    parts = []
    for (_, dtype, _), order in small.items():
        if len(order) == 1:
            large += order
            continue
        stacked = torch.stack([grads[i] for i in order]).reshape(len(order), -1)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        parts.append((order, torch.linalg.vector_norm(stacked, dim=1, dtype=acc)))
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
