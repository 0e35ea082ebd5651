"""Closing a step: the captures of one step become records, with one host transfer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import StepResult
from graddebug.capture.layers import keep_label
from graddebug.records import Event, EventKind, Kind, Record
from graddebug_torch.stats import acc_dtype, unit_summary

__all__ = ["Capture", "ParamGrad", "ParamRow", "StepCaptures", "gather", "kept_array"]

Key = tuple[str, str]


@dataclass
class Capture:
    """Device-side statistics of one gradient seen by one hook call."""

    sq: Tensor
    total: Tensor
    extremes: tuple[Tensor, Tensor] | None  # per-unit (max, min)
    absmax: Tensor | None  # only when there is no unit axis
    shape: str  # str(tuple(shape))
    numel: int
    pre_sq: Tensor | None  # sum of squares before an intervention

    @property
    def n_units(self) -> int:
        """Number of units (features or channels); 0 without a unit axis."""
        return 0 if self.extremes is None else self.extremes[0].numel()


@dataclass
class ParamGrad:
    """A parameter gradient as the post-accumulate hook saw it, with its sum of squares taken
    while it was still in cache (None when it must be recomputed at the step's close)."""

    grad: Tensor
    sq: Tensor | None
    version: int


@dataclass
class ParamRow:
    """A watched parameter at the close of a step."""

    layer: str
    tensor: str
    depth: int
    grad: Tensor | None
    sq: Tensor | None
    keep: bool


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
           full: bool) -> StepResult:
    """Turn one step's captures and parameter gradients into records and events.

    Args:
        step: Index of the step.
        state: What the hooks captured.
        params: Every watched parameter that requires a gradient.
        depths: Forward-order depth of each layer and tap name.
        full: Also compute mean and absmax of parameter gradients.

    Returns:
        The step's records, events and kept arrays.
    """
    present = [p for p in params if p.grad is not None]
    if not state.captures and not present:
        # No backward ran in this step; what forward saw (a tap cut from the graph) stands.
        return StepResult(events=list(state.events))
    batch = _HostBatch()

    # Activation scalars, stacked into one tensor; their positions are remembered per capture.
    scalars: list[Tensor] = []
    where: dict[int, int] = {}
    for calls in state.captures.values():
        for c in calls:
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
            per_unit = torch.stack([torch.maximum(c.extremes[0], c.extremes[1].neg())
                                    for c in calls if c.extremes]).amax(0)
            pooled[key] = batch.add(torch.count_nonzero(per_unit))

    # Parameters: sums of squares taken in the backward hook, and one fused pass for the rest.
    late = [p for p in present if p.sq is None]
    early_slot = batch.add(_stack([p.sq for p in present if p.sq is not None])) \
        if len(late) < len(present) else slice(0, 0)
    late_grads = [_dense(p.grad) for p in late if p.grad is not None]
    late_slot = batch.add(_stack(torch._foreach_norm(late_grads))) if late_grads else slice(0, 0)
    full_slots = [batch.add(_full_stats(_dense(p.grad))) for p in present
                  if p.grad is not None] if full else []
    forward_slot = (batch.add(torch.stack([s for _, _, s in state.forward_sums]))
                    if state.forward_sums else slice(0, 0))

    batch.fetch()  # the step's single host sync

    result = StepResult(events=list(state.events), kept=dict(state.kept))
    values = batch[scalar_slot]
    unit_absmax: dict[int, float] = {}
    unit_live: dict[int, float] = {}
    for members, absmax_slot, live_slot in unit_slots:
        for c, a, n in zip(members, batch[absmax_slot], batch[live_slot], strict=True):
            unit_absmax[id(c)], unit_live[id(c)] = a, n
    for key, calls in state.captures.items():
        result.records.append(_activation_record(
            step, key, depths.get(key[0], -1), calls, values, where, unit_absmax,
            unit_live, batch[pooled[key]][0] if key in pooled else None))

    early = iter(batch[early_slot])
    late_norms = iter(batch[late_slot])
    for i, p in enumerate(present):
        assert p.grad is not None
        norm = math.sqrt(next(early)) if p.sq is not None else next(late_norms)
        extra = batch[full_slots[i]] if full else None
        result.records.append(_param_record(step, p, _dense(p.grad), norm, extra))

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
        elif p.keep:
            result.kept[keep_label(p.layer, p.tensor)] = kept_array(p.grad)
    return result


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
                       values: list[float], where: dict[int, int],
                       unit_absmax: dict[int, float], unit_live: dict[int, float],
                       pooled_live: float | None) -> Record:
    sq = total = pre_sq = 0.0
    absmax = -math.inf
    pre = False
    for c in calls:
        at = where[id(c)]
        sq += values[at]
        total += values[at + 1]
        at += 2
        if c.absmax is not None:
            value = values[at]
            at += 1
        else:
            value = unit_absmax[id(c)]
        absmax = value if math.isnan(value) or math.isnan(absmax) else max(absmax, value)
        if c.pre_sq is not None:
            pre_sq += values[at]
            pre = True
    first = calls[0]
    live = unit_live.get(id(first)) if len(calls) == 1 else pooled_live
    units = first.n_units
    numel = first.numel if len(calls) == 1 else sum(c.numel for c in calls)
    return _record(
        step, key[0], key[1], Kind.ACTIVATION.value, depth, first.shape, numel,
        norm=math.sqrt(sq) if sq >= 0 else math.nan,
        total=total,
        absmax=absmax,
        zero_frac=(units - live) / units if live is not None and units else math.nan,
        nan=math.isnan(absmax),
        inf=math.isinf(absmax),
        pre_norm=math.sqrt(pre_sq) if pre else math.nan,
    )


def _param_record(step: int, p: ParamRow, grad: Tensor, norm: float,
                  extra: list[float] | None) -> Record:
    nan = inf = False
    if not math.isfinite(norm):
        # Rare: a second sync, only for a gradient already known to be broken.
        nan = bool(torch.isnan(grad).any())
        inf = bool(torch.isinf(grad).any())
    total, absmax = (extra[0], extra[1]) if extra is not None else (math.nan, math.nan)
    return _record(step, p.layer, p.tensor, Kind.PARAMETER.value, p.depth, str(tuple(grad.shape)),
                   grad.numel(), norm, total, absmax, math.nan, nan, inf)


def _record(step: int, layer: str, tensor: str, kind: str, depth: int, shape: str,
            numel: int, norm: float, total: float, absmax: float, zero_frac: float,
            nan: bool, inf: bool, pre_norm: float = math.nan) -> Record:
    return Record.from_sums(step, layer, tensor, kind, depth, shape, numel, norm=norm,
                            total=total, absmax=absmax, zero_frac=zero_frac, nan=nan, inf=inf,
                            pre_norm=pre_norm)


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
