"""Closing a step: the captures of one step become records, with one host transfer.

Each source of statistics is a small object with two halves around the transfer: ``queue``
puts its device-side reductions on the step's :class:`_HostBatch`, ``read`` turns the fetched
values into rows or events. The sources are the activations (layer outputs, taps and ops), the
parameters and the forward checks; :func:`gather` queues them all, moves the batch to the host
once, and reads them in the order the records and events are documented in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from graddebug.adapter import StepResult
from graddebug.capture.layers import keep_label
from graddebug.records import Event, EventKind, Kind, Record
from graddebug_torch.captures import (
    Capture,
    ForwardChecks,
    Key,
    StepCaptures,
    kept_array,
    shape_text,
)
from graddebug_torch.distributed import local_slice, summed_by_ranks, whole
from graddebug_torch.params import ParamRow
from graddebug_torch.rows import activation_row, param_record
from graddebug_torch.staging import GroupStats, SmallGrads, StagedGroup
from graddebug_torch.stats import (
    nonzero_counts,
    param_norms,
    stack_scalars,
    sum_and_absmax,
    unit_summary,
)
from graddebug_torch.updates import UpdateWatch

__all__ = ["gather"]

_PARAMETER = Kind.PARAMETER.value  # Enum.value is slow
_NO_SLOT = slice(0, 0)


class _HostBatch:
    """Device tensors queued in order, moved to the host in one transfer, read back by slot."""

    def __init__(self) -> None:
        self._parts: list[Tensor] = []
        self._size = 0
        self._values: list[float] = []

    def add(self, tensor: Tensor) -> slice:
        """Queue ``tensor``'s values; return where they will be read."""
        n = tensor.numel()
        slot = slice(self._size, self._size + n)
        self._parts.append(tensor if tensor.dim() == 1 else tensor.reshape(-1))
        self._size += n
        return slot

    def fetch(self) -> None:
        """Move everything queued to the host: the step's one sync (one per device)."""
        parts = self._parts
        if not parts:
            return
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
        flat = [p if p.dtype == dtype else p.to(dtype) for p in parts]  # most are already
        devices = {p.device for p in flat}
        if len(devices) > 1:
            # Several devices: one transfer each, in the original order.
            flat = [p.to("cpu", non_blocking=True) for p in flat]
            for device in devices:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        self._values = torch.cat(flat).tolist()

    def __getitem__(self, slot: slice) -> list[float]:
        """The fetched values of ``slot``."""
        return self._values[slot]


class _Source(Protocol):
    """One source of a step's statistics, on both sides of the host transfer."""

    def queue(self, batch: _HostBatch) -> None:
        """Queue the source's reductions on ``batch``."""

    def read(self, step: int, batch: _HostBatch, result: StepResult) -> None:
        """Add the source's rows or events to ``result`` from the fetched ``batch``."""


def gather(step: int, state: StepCaptures, params: Sequence[ParamRow], depths: dict[str, int],
           full: bool, staging: SmallGrads | None = None, whole_kept: bool = True,
           weights: UpdateWatch | None = None) -> StepResult:
    """Turn one step's captures and parameter gradients into records and events.

    Args:
        step: Index of the step.
        state: What the hooks captured.
        params: Every watched parameter that requires a gradient.
        depths: Forward-order depth of each layer and tap name.
        full: Also compute mean and absmax of parameter gradients.
        staging: Where the hooks staged small gradients (reduced here, in one pass a shape).
        whole_kept: ``keep=`` of a sharded parameter gathers its whole gradient (a
            collective); False leaves it out (a rank unwinding an exception).
        weights: The parameters' weight and update norms (``weight_norm``, ``update_norm``);
            None leaves them NaN.

    Returns:
        The step's records, events and kept arrays.
    """
    present = [p for p in params if p.grad is not None]
    if not state.captures and not present:
        # No backward ran in this step; what forward saw (a tap cut from the graph) stands.
        return StepResult(events=list(state.events))
    activations = _Activations(state, staging, depths)
    parameters = _Parameters(params, present, full, whole_kept, weights)
    sources: tuple[_Source, ...] = (
        activations, parameters, _ForwardReads(state.forward, EventKind.FORWARD_NONFINITE),
        _ForwardReads(state.inputs, EventKind.INPUT_NONFINITE),
        _ForwardReads(state.between, EventKind.LAYER_INPUT_NONFINITE))
    batch = _HostBatch()
    for source in sources:
        source.queue(batch)
    batch.fetch()  # the step's single host sync
    result = StepResult(events=list(state.events), kept=dict(state.kept))
    for source in sources:
        source.read(step, batch, result)
    activations.unreached(step, result)
    parameters.missing(step, result)
    return result


# sum of squares, sum, absmax, sum of squares before an intervention, live units
_Values = tuple[float, float, float, float | None, float | None]


class _Activations:
    """The gradients the tensor hooks captured (layer outputs, taps, ops): one row per output.

    Queued: the staged small gradients (one batched pass per group of equal shapes, read by
    row), the other captures' scalars stacked into one tensor, the per-unit extremes (one
    batched summary per group of equally wide captures), and the live units pooled over the
    calls of an output captured more than once.

    Args:
        state: What the hooks captured.
        staging: Where the hooks staged small gradients, or None.
        depths: Forward-order depth of each layer and tap name.
    """

    def __init__(self, state: StepCaptures, staging: SmallGrads | None,
                 depths: dict[str, int]) -> None:
        self._state = state
        self._staging = staging
        self._depths = depths
        self._staged_slots: dict[StagedGroup, tuple[slice, slice, slice, slice | None]] = {}
        self._where: dict[int, int] = {}  # a capture's first scalar, by id
        self._scalar_slot = _NO_SLOT
        self._unit_slots: list[tuple[list[Capture], slice, slice]] = []
        self._pooled: dict[Key, slice] = {}
        self._scalars: list[float] = []
        self._units: dict[int, tuple[float, float]] = {}
        self._columns: dict[StagedGroup, tuple[list[float], list[float], list[float],
                                               list[float] | None]] = {}

    def queue(self, batch: _HostBatch) -> None:
        """Queue every capture's statistics."""
        state = self._state
        every = ([c for calls in state.calls().values() for c in calls] if state.repeats
                 else list(state.captures.values()))
        staged = self._staging.reduce() if self._staging is not None else {}
        self._staged_slots = {group: (batch.add(g.sq), batch.add(g.total), batch.add(g.absmax),
                                      batch.add(g.live) if g.live is not None else None)
                              for group, g in staged.items()}
        scalars: list[Tensor] = []
        for c in every:
            if c.group is not None:
                continue
            self._where[id(c)] = len(scalars)
            scalars += [c.sq, c.total]
            if c.absmax is not None:
                scalars.append(c.absmax)
            if c.pre_sq is not None:
                scalars.append(c.pre_sq)
        if scalars:
            self._scalar_slot = batch.add(stack_scalars(scalars))
        self._queue_units(every, batch)
        # A layer called several times: a unit is dead only if it is dead in every call.
        for key, calls in state.repeats.items():
            widths = {c.n_units for c in calls}
            if len(widths) == 1 and 0 not in widths:
                per_unit = torch.stack([_per_unit(c, staged) for c in calls]).amax(0)
                self._pooled[key] = batch.add(torch.count_nonzero(per_unit))

    def _queue_units(self, every: list[Capture], batch: _HostBatch) -> None:
        """Queue the per-unit summaries: one batched pass per group of equally wide captures."""
        groups: dict[tuple[int, torch.dtype, torch.device], list[Capture]] = {}
        for c in every:
            if c.extremes is not None:
                high = c.extremes[0]
                groups.setdefault((c.n_units, high.dtype, high.device), []).append(c)
        for members in groups.values():
            absmax, live = unit_summary([c.extremes[0] for c in members if c.extremes],
                                        [c.extremes[1] for c in members if c.extremes])
            self._unit_slots.append((members, batch.add(absmax), batch.add(live)))

    def read(self, step: int, batch: _HostBatch, result: StepResult) -> None:
        """Add one row per captured output, in the order the outputs were first seen."""
        self._scalars = batch[self._scalar_slot]
        for members, absmax_slot, live_slot in self._unit_slots:
            for c, a, n in zip(members, batch[absmax_slot], batch[live_slot], strict=True):
                self._units[id(c)] = (a, n)
        self._columns = {group: (batch[sq], batch[total], batch[absmax],
                                 batch[live] if live is not None else None)
                         for group, (sq, total, absmax, live) in self._staged_slots.items()}
        depths, repeats, pooled = self._depths, self._state.repeats, self._pooled
        records = result.records
        for key, first in self._state.captures.items():
            depth = depths.get(key[0], -1)
            repeated = repeats.get(key) if repeats else None
            if repeated is None:  # the usual output, called once
                sq, total, top, pre_sq, alive = self._values(first)
                records.append(activation_row(step, key, depth, first, first.numel, sq, total,
                                               top, pre_sq, alive, first.sentinel))
            else:
                records.append(self._repeated_row(
                    step, key, depth, repeated, batch[pooled[key]][0] if key in pooled else None))

    def _values(self, c: Capture) -> _Values:
        """The fetched statistics of capture ``c``."""
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

    def _repeated_row(self, step: int, key: Key, depth: int, calls: list[Capture],
                      pooled_live: float | None) -> Record:
        """The row of an output captured by several calls (a module called twice): the calls'
        sums add up, and a unit is live if it is in any call (``pooled_live``)."""
        sq = total = pre_sum = 0.0
        absmax = -math.inf
        pre = False
        for c in calls:
            c_sq, c_total, value, c_pre, _ = self._values(c)
            sq += c_sq
            total += c_total
            absmax = value if math.isnan(value) or math.isnan(absmax) else max(absmax, value)
            if c_pre is not None:
                pre_sum += c_pre
                pre = True
        return activation_row(step, key, depth, calls[0], sum(c.numel for c in calls), sq,
                               total, absmax, pre_sum if pre else None, pooled_live,
                               any(c.sentinel for c in calls))

    def unreached(self, step: int, result: StepResult) -> None:
        """Add an ``unreached`` event for each output that needed a gradient and got none."""
        captures = self._state.captures
        for (layer, tname), depth in self._state.expected.items():
            if (layer, tname) not in captures:
                result.events.append(Event(step, layer, tname, depth, EventKind.UNREACHED.value))


class _Parameters:
    """The watched parameters' gradients: their norms in one fused pass (a batched one per
    group of small ones), the sum and ``absmax`` too with ``full``. A sharded gradient
    (``DTensor``) is measured on this rank's slice, which the ranks' rows combine into the
    whole (:mod:`graddebug.adapter.ranks`). The weights' and the updates' norms come from
    ``weights``.

    Args:
        params: Every watched parameter that requires a gradient.
        present: Those that got one.
        full: Also measure the sum and ``absmax``.
        whole_kept: ``keep=`` of a sharded parameter may gather its whole gradient.
        weights: Where the weight and update norms come from, or None.
    """

    def __init__(self, params: Sequence[ParamRow], present: list[ParamRow], full: bool,
                 whole_kept: bool, weights: UpdateWatch | None = None) -> None:
        self._params = params
        self._weights = weights
        self._present = present
        self._full = full
        self._whole_kept = whole_kept
        self._grads = grads = [_measured(p) for p in present]
        self._norm_parts: list[tuple[list[int], slice]] = []
        self._full_slots: dict[int, slice] = {}
        # 1-D gradients (biases, a normalisation's scale and shift), by device: their zero
        # entries are the units that got no gradient, counted on every recorded step
        self._vectors: dict[torch.device, list[int]] = {}
        for i, (p, g) in enumerate(zip(present, grads, strict=True)):
            if (g.dim() == 1 and g.numel() and g.is_floating_point() and not p.sharded
                    and not g.is_sparse):
                self._vectors.setdefault(g.device, []).append(i)
        self._zero_slots: list[tuple[list[int], slice]] = []

    def queue(self, batch: _HostBatch) -> None:
        """Queue the norms (and with ``full`` the sums and maxima) of the gradients."""
        grads = [_dense(g) if g.is_sparse else g for g in self._grads]
        groups = [p.group for p in self._present]
        self._norm_parts = [(order, batch.add(norms))
                            for order, norms in param_norms(grads, groups)]
        if self._full:
            self._full_slots = {i: batch.add(sum_and_absmax(_dense(g)))
                                for i, g in enumerate(self._grads)}
        self._zero_slots = [(order, batch.add(nonzero_counts([self._grads[i] for i in order])))
                            for order in self._vectors.values()]
        if self._weights is not None:
            self._weights.queue(batch)

    def read(self, step: int, batch: _HostBatch, result: StepResult) -> None:
        """Add one row per parameter that got a gradient, in order."""
        norms = [0.0] * len(self._present)
        for order, slot in self._norm_parts:
            for i, value in zip(order, batch[slot], strict=True):
                norms[i] = value
        full, records = self._full, result.records
        new_row, nan = tuple.__new__, math.nan
        present = self._present
        if self._weights is not None:
            weight_norms, update_norms = self._weights.read(batch, present)
        else:
            weight_norms = update_norms = [nan] * len(present)
        zeros = [nan] * len(present)
        for order, slot in self._zero_slots:
            for i, count in zip(order, batch[slot], strict=True):
                zeros[i] = 1.0 - count / self._grads[i].numel()
        for i, (p, grad, norm) in enumerate(zip(present, self._grads, norms, strict=True)):
            weight, update = weight_norms[i], update_norms[i]
            if full or not math.isfinite(norm) or grad.is_sparse:
                extra = batch[self._full_slots[i]] if full else None
                records.append(param_record(step, p, _dense(grad), norm, extra,
                                             (weight, update), zero=zeros[i]))
            else:  # the usual row, built inline: a large model has tens of thousands a step
                records.append(new_row(Record, (
                    step, p.layer, p.tensor, _PARAMETER, p.depth, shape_text(grad.shape),
                    grad.numel(), norm, nan, nan, nan, zeros[i], False, False, nan, 0, weight,
                    update, nan)))

    def missing(self, step: int, result: StepResult) -> None:
        """Add a ``no_grad`` event per parameter that got no gradient; keep the gradients
        ``keep=`` asks for (a sharded one whole, which is a collective)."""
        for p in self._params:
            if p.grad is None:
                result.events.append(Event(step, p.layer, p.tensor, p.depth,
                                           EventKind.NO_GRAD.value))
            elif p.keep and (self._whole_kept or not p.sharded):
                result.kept[keep_label(p.layer, p.tensor)] = kept_array(whole(p.grad))


def _measured(p: ParamRow) -> Tensor:
    """The gradient a parameter's row measures: this rank's slice of a sharded one."""
    grad = p.grad
    assert grad is not None
    return local_slice(grad, reduce=not summed_by_ranks(grad)) if p.sharded else grad


class _ForwardReads:
    """The forward finiteness checks: one event per output (``forward_nonfinite``) or model
    input (``input_nonfinite``) that held a NaN or an Inf in the forward pass.

    Args:
        checks: The step's checks.
        kind: The event a non-finite check gives.
    """

    def __init__(self, checks: ForwardChecks, kind: EventKind) -> None:
        self._checks = checks
        self._kind = kind.value
        self._slot = _NO_SLOT

    def queue(self, batch: _HostBatch) -> None:
        """Queue every check's number."""
        if len(self._checks):
            self._slot = batch.add(self._checks.gather())

    def read(self, step: int, batch: _HostBatch, result: StepResult) -> None:
        """Add the events of the checks that came out non-finite, in the order added."""
        checks = self._checks
        for i, (key, depth, value) in enumerate(zip(checks.keys, checks.depths,
                                                    batch[self._slot], strict=True)):
            if not math.isfinite(value):
                result.events.append(Event(step, key[0], key[1], depth, self._kind,
                                           checks.detail(i, value)))


def _per_unit(c: Capture, staged: dict[StagedGroup, GroupStats]) -> Tensor:
    """Largest ``|g|`` of each unit of one capture."""
    if c.group is not None:
        per_unit = staged[c.group].per_unit
        assert per_unit is not None
        return per_unit[c.row]
    assert c.extremes is not None
    return torch.maximum(c.extremes[0], c.extremes[1].neg())


def _dense(grad: Tensor) -> Tensor:
    """A gradient's values as a dense tensor (a sparse one's stored entries)."""
    return grad.coalesce().values() if grad.is_sparse else grad
