"""Closing a step: the one read of the step's buffers, and the records and events made of it.

:class:`StepCloser` closes the steps of a :class:`~.adapter.TensorFlowAdapter`. It writes the
eager step's sentinel rows, and the rows of gradients handed to ``step(grads)``, into the
buffers of :mod:`.captures`, reads every buffer with one transfer and zeroes it (where
``step(grads)`` hands gradients over, all of that is one call of one ``tf.function``), then
turns the rows into records and events, adds the op-level events where the Watcher asked for
them, and tells compiled steps whether the next one records. The functions that turn rows into
records (:func:`step_records`, :func:`param_records`) also serve the rows that a
``tf.compat.v1`` session fetches (:mod:`.v1graph`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from graddebug.adapter import StepResult
from graddebug.capture.layers import keep_label
from graddebug.records import (
    SEVERED_DETAIL,
    WEIGHTED_DETAIL,
    Event,
    EventKind,
    Kind,
    Record,
    sums_record,
)
from graddebug_tensorflow.captures import LossCol, ScalerCol
from graddebug_tensorflow.params import UNMEASURED
from graddebug_tensorflow.scaling import given_scale
from graddebug_tensorflow.stats import NOT_MEASURED, Col, compiled, flat_entry
from graddebug_tensorflow.updates import update_columns

if TYPE_CHECKING:
    from graddebug.adapter import WatchContext
    from graddebug.capture.layers import FailOpen
    from graddebug_tensorflow.captures import Rows, StateBuffers, StepGates
    from graddebug_tensorflow.ops.capture import OpCapture
    from graddebug_tensorflow.outputs import Slot
    from graddebug_tensorflow.params import Param, ParamSet
    from graddebug_tensorflow.updates import UpdateView
    from graddebug_tensorflow.watching import OutputWatch

__all__ = ["StepCloser", "handed_over", "param_records", "skipped_step", "step_records"]

_ACTIVATION, _PARAMETER = Kind.ACTIVATION.value, Kind.PARAMETER.value  # Enum.value is slow

_NO_PARAM_GRADS = (
    "graddebug: dbg.step() closed a step with no parameter gradients: TensorFlow keeps none on "
    "the variables, so parameter rows need dbg.step(tape.gradient(loss, "
    "model.trainable_variables)) or watch(model, optimizer=opt). Only layer outputs and taps "
    "are recorded until then."
)

_CUT_EVIDENCE = frozenset({EventKind.NO_GRAD.value, EventKind.DETACHED_OUTPUT.value,
                           EventKind.UNREACHED.value})
_SUSPECT = _CUT_EVIDENCE | {EventKind.FORWARD_NONFINITE.value}


class StepCloser:
    """Reads a step's buffers once, clears them, and turns their rows into a
    :class:`~graddebug.adapter.StepResult`.

    Args:
        context: The Watcher's hook side.
        buffers: The buffers the step's hooks wrote.
        params: The watched variables, whose rows follow the activation rows.
        outputs: The hooks on layer outputs and taps: their slots, the eager step's rows, the
            op-level capture and the loss scaling.
        gates: The flags of compiled steps; each close says whether the next step records.
        every: Record one step in ``every``.
        fail_open: The adapter's fail-open guard, by where it runs.
        param_depth: The depth of a parameter's layer.
        updates: The optimizer's view of the watched variables (their weight and update
            norms), or None.

    Attributes:
        loss: The mean of the losses ``compute_loss`` returned in training in the step
            closed last (summed over the replicas, each of which returns its share); None
            where none was returned or the step was not recorded.
    """

    def __init__(self, context: WatchContext, buffers: StateBuffers, params: ParamSet,
                 outputs: OutputWatch, gates: StepGates, every: int,
                 fail_open: Callable[[str], FailOpen],
                 param_depth: Callable[[Param], int],
                 updates: UpdateView | None = None) -> None:
        self._ctx = context
        self._buffers = buffers
        self._params = params
        self._outputs = outputs
        self._gates = gates
        self._every = every
        self._fail_open = fail_open
        self._param_depth = param_depth
        self._updates = updates
        self.loss: float | None = None
        self._peeked: Rows | None = None  # see pending()
        self._fused_close: Any = None  # see _close_given
        # the fused close's concrete function and flat entry point, by which gradients are None
        self._fused_calls: dict[tuple[tuple[bool, ...], bool], tuple[Any, Any]] = {}

    def pending(self, closing: bool) -> bool:
        """Whether a gradient was recorded since the last step closed (one read of the
        buffers); with ``closing``, a True answer keeps the rows it read for the close that
        follows."""
        self._outputs.flush()
        rows = self._buffers.peek()
        pending = bool((rows.acts[..., Col.BWD] > 0).any() or (rows.params[:, 0] > 0).any())
        self._peeked = rows if closing and pending else None
        return pending

    def close(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Read and clear the buffers (one transfer) and turn them into records.

        Args:
            step: Index of the step.
            grads: The parameter gradients handed to ``step(grads)``, or None.
            record: Whether the step is recorded; if not, its buffers are cleared unread.

        Raises:
            GradientCountError: ``grads`` does not align with the watched variables.
        """
        peeked, self._peeked = self._peeked, None
        self.loss = None
        try:
            if record:
                self._outputs.flush()
            rows = None
            if grads is not None:  # checks the count on every step
                grads = list(grads)
                self._params.check_given(grads)
                # A skipped step stops at the check: its buffers are cleared below, unread.
                if record and self._buffers.replicas == 1:
                    rows = self._close_given(grads, given_scale(self._outputs.scale,
                                                                self._buffers))
                elif record:
                    self._params.store_given(grads, given_scale(self._outputs.scale,
                                                                self._buffers))
                peeked = None
            if not record:
                self._buffers.clear()
                return StepResult()
            if rows is None and peeked is not None:  # read by pending(closing=True)
                rows = peeked
                self._buffers.clear()
            elif rows is None:
                rows = self._buffers.read_and_clear()
            return self._result(step, rows, grads is not None)
        finally:
            self._outputs.end_step()
            self._gates.set_recording((step + 1) % self._every == 0)

    def _result(self, step: int, rows: Rows, given: bool) -> StepResult:
        """The records and events of a step's rows; ``given``: whether ``step(grads)`` handed
        gradients over."""
        result = StepResult()
        self.loss = _loss(rows.loss)
        slots = self._outputs.slots()
        for replica, acts in enumerate(rows.acts):
            step_records(step, slots, acts, result, replica)
        params = self._params.resolve()
        # A backward reached the layers, yet no parameter gradient was handed over.
        if (result.records and not given and params
                and not handed_over(rows.params, len(params))):
            self._ctx.warn_once("no-param-grads", _NO_PARAM_GRADS)
        view = self._updates
        factors = [s.factor for s in view.samples] if view is not None and view.active else []
        param_records(step, params, rows.params, result, given, self._param_depth,
                      rows.updates, factors)
        skipped = skipped_step(step, rows.scaler)
        if skipped is not None:
            result.events.append(skipped)
        ops = self._outputs.ops
        if ops is not None:
            self._op_events(ops, step, result)
        return result

    def _op_events(self, ops: OpCapture, step: int, result: StepResult) -> None:
        """Add the op-level events of the step, where the Watcher asked for them; under
        ``escalate=True``, arm the checks of the next steps after a suspect step."""
        with self._fail_open("ops"):
            codes = ops.read()
            if self._ctx.capture_ops:
                if codes is not None:
                    result.events += ops.nonfinite_events(step, codes, result.events)
                if any(e.event in _CUT_EVIDENCE for e in result.events):
                    result.events += ops.cut_events(step)
            # The Watcher decides after this step whether the next recorded one captures
            # operations; the checks of a graph cannot wait for its answer, so they run on
            # every step after one that may arm it, and their codes are used only if it did.
            ops.arm(any(e.event in _SUSPECT for e in result.events)
                    or any(r.nan or r.inf for r in result.records))

    def _close_given(self, grads: list[Any], scale: Any) -> Rows:
        """Write the rows of gradients handed to ``step(grads)``, read every buffer and
        zero it, in one call of one ``tf.function`` (traced once per model): in eager mode
        that is one dispatch and one transfer instead of a few dozen ops."""
        if self._updates is not None:  # before the trace, which reads whether it is active
            self._updates.resolve([p.var for p in self._params.resolve()])
        if self._fused_close is None:
            buffers, params, view = self._buffers, self._params, self._updates

            def close(grads: list[Any], scale: Any) -> Any:
                params.store_given(grads, scale)
                if view is not None:
                    # No optimizer in view: the weights as they are at the close, in the
                    # same call and transfer (see graddebug_tensorflow.updates).
                    view.weights([(i, p.var) for i, p in enumerate(params.resolve())])
                flat = buffers.flat()  # read after the write, zeroed after the read
                buffers.clear()
                return flat

            self._fused_close = compiled(close)
        if all(g is None or isinstance(g, tf.Tensor) for g in grads):
            # Dense gradients keep their shapes and dtypes (step() checked them): the traced
            # function is called with its flat inputs, without matching the arguments to a
            # trace again (about 2 ms a step for a few dozen gradients).
            key = (tuple(g is None for g in grads), scale is None)
            found = self._fused_calls.get(key)
            if found is None:
                traced = self._fused_close.get_concrete_function(grads, scale)
                found = self._fused_calls[key] = (traced, flat_entry(traced))
            traced, entry = found
            inputs = [g for g in grads if g is not None]
            if scale is not None:
                inputs.append(scale)
            flat = entry(inputs) if entry is not None else traced(grads, scale)
        else:
            flat = self._fused_close(grads, scale)
        return self._buffers.unpack(None if flat is None else flat.numpy())


# -- rows into records -----------------------------------------------------------------------


def step_records(step: int, slots: Sequence[Slot], acts: np.ndarray, result: StepResult,
                 rank: int = 0) -> None:
    """Add the records, events and kept gradients of the layer outputs and taps of one step
    to ``result``.

    Args:
        step: Index of the step.
        slots: Every slot handed out so far, in creation order.
        acts: One replica's activation rows, indexed by ``Slot.index``.
        result: The step's result, extended in place.
        rank: The replica that wrote ``acts`` (0 without ``tf.distribute``); only replica 0
            keeps gradients (``keep=``).
    """
    groups: dict[tuple[str, str], list[Slot]] = {}
    for slot in slots:
        groups.setdefault((slot.layer.name, slot.tensor), []).append(slot)
    for (name, tname), members in groups.items():
        layer = members[0].layer
        ran = [s for s in members if acts[s.index, Col.FWD] > 0]
        reached = [s for s in members if acts[s.index, Col.BWD] > 0]
        sums = [acts[s.index, Col.FWD_SUM] for s in ran]
        broken = [v for v in sums if not math.isfinite(v)]
        if not layer.capture:  # the model's inputs: checked forward, never differentiated
            if broken:
                result.events.append(Event(step, name, tname, -1,
                                           EventKind.INPUT_NONFINITE.value,
                                           "NaN" if any(math.isnan(v) for v in broken)
                                           else "Inf", rank))
            continue
        if broken:
            what = "NaN" if any(math.isnan(v) for v in broken) else "Inf"
            if layer.weighted:
                what += WEIGHTED_DETAIL
            result.events.append(Event(step, name, tname, layer.depth,
                                       EventKind.FORWARD_NONFINITE.value, what, rank))
        if not reached:
            if ran and members[0].severed:
                result.events.append(Event(step, name, tname, layer.depth,
                                           EventKind.DETACHED_OUTPUT.value, SEVERED_DETAIL,
                                           rank))
            elif ran:
                result.events.append(Event(step, name, tname, layer.depth,
                                           EventKind.UNREACHED.value, "", rank))
            continue
        result.records.append(_activation(step, name, tname, layer.depth,
                                          [acts[s.index] for s in reached], rank))
        for s in reached:
            if s.keep_var is not None and rank == 0:
                result.kept[keep_label(name, tname, s.ordinal)] = s.keep_var.numpy().copy()


def skipped_step(step: int, scaler: np.ndarray) -> Event | None:
    """The event of a step that a ``LossScaleOptimizer`` skipped, from the scaler's row (see
    :class:`~graddebug_tensorflow.captures.ScalerCol`); None when it skipped none."""
    if len(scaler) == 0 or scaler[ScalerCol.SKIPPED] <= 0:
        return None
    scale = float(scaler[ScalerCol.SKIPPED_SCALE])
    return Event(step, "", "", -1, EventKind.SKIPPED_STEP.value, f"scale={scale!r}")


def _activation(step: int, layer: str, tname: str, depth: int,
                rows: list[np.ndarray], rank: int) -> Record:
    """The record of one layer output or tap in one step, from the rows of its calls."""
    sq = sum(float(r[Col.SQ]) for r in rows)
    total = sum(float(r[Col.SUM]) for r in rows)
    absmaxes = [float(r[Col.ABSMAX]) for r in rows]
    absmax = math.nan if any(math.isnan(a) for a in absmaxes) else max(absmaxes)
    if any(r[Col.LIVE] == NOT_MEASURED for r in rows):
        # The sentinel only: the sum of squares is NaN exactly when an entry is; it is Inf for
        # an Inf entry or for finite entries whose squares overflow, which the sum tells apart.
        nan = math.isnan(sq)
        inf = not nan and math.isinf(sq) and not math.isfinite(total)
        absmax = math.nan
    else:
        nan, inf = math.isnan(sq) or math.isnan(absmax), math.isinf(absmax)
    pre = [float(r[Col.PRE_SQ]) for r in rows if r[Col.PRE_SQ] >= 0 or math.isnan(r[Col.PRE_SQ])]
    # A unit is dead only if it is dead in every call; per-call counts bound that from above.
    dead = [(r[Col.UNITS] - r[Col.LIVE]) / r[Col.UNITS] for r in rows if r[Col.UNITS] > 0]
    first = rows[0]
    ndim = int(first[Col.RANK])
    dims = tuple(int(d) for d in first[Col.DIMS : Col.DIMS + ndim])
    return Record.from_sums(
        step, layer, tname, _ACTIVATION, depth, str(dims),
        int(sum(r[Col.NUMEL] for r in rows)),
        norm=math.sqrt(sq) if sq >= 0 else math.nan,
        total=total,
        absmax=absmax,
        zero_frac=float(min(dead)) if dead else math.nan,
        nan=nan,
        inf=inf,
        pre_norm=math.sqrt(sum(pre)) if pre else math.nan,
        rank=rank,
    )


def handed_over(rows: np.ndarray, count: int) -> bool:
    """Whether the source row (after ``count`` parameter rows) says that gradients were handed
    over in the step, by the optimizer or ``step(grads)``."""
    return bool(len(rows) > count and rows[count, 0] > 0)


def _loss(rows: np.ndarray) -> float | None:
    """The step's loss from the loss rows (see :class:`~.captures.LossCol`), or None."""
    if rows.shape[-1] == 0 or rows[0, LossCol.COUNT] <= 0:
        return None
    return float(rows[:, LossCol.SUM].sum() / rows[0, LossCol.COUNT])


def param_records(step: int, params: Sequence[Param], rows: np.ndarray, result: StepResult,
                  source: bool, depth: Callable[[Param], int],
                  updates: np.ndarray | None = None, factors: Sequence[float] = ()) -> None:
    """Add the records of parameter gradients to ``result``.

    Args:
        step: Index of the step.
        params: The watched parameters, in buffer order.
        rows: The parameter rows.
        result: The step's result, extended in place.
        source: Whether gradients were handed over this step (by ``step(grads)`` or the
            optimizer); only then is a parameter without one reported as starved. The source
            row after the parameter rows says the same from inside a graph.
        depth: The depth of a parameter's layer.
        updates: The rows of the optimizer's view, by parameter (see :mod:`.updates`), for
            ``weight_norm`` and ``update_norm``; None or empty where not measured (NaN).
        factors: What scales each parameter's sampled norms to its own
            (:attr:`~.updates.Sample.factor`).
    """
    source = source or handed_over(rows, len(params))
    measured = updates is not None and len(updates) == len(params) == len(factors)
    for position, (p, row) in enumerate(
            zip(params, rows.tolist(), strict=False)):  # Python floats: no numpy scalars
        if row[0] >= UNMEASURED:
            continue  # present, not read inside a graph (a batch norm's: see ParamSet)
        if row[0] <= 0:
            if source:
                result.events.append(Event(step, p.layer, p.tensor, depth(p),
                                           EventKind.NO_GRAD.value))
            continue
        _, sq, total, absmax, zero = row
        if p.shape is None:  # a variable's shape is fixed: its text and size, once
            shape = tuple(int(d) for d in p.var.shape)
            p.shape = (str(shape), int(np.prod(shape, dtype=np.int64)))
        weight, update = (update_columns(updates, position, factors[position])
                          if measured and updates is not None else (math.nan, math.nan))
        result.records.append(sums_record(
            step, p.layer, p.tensor, _PARAMETER, depth(p), p.shape[0], p.shape[1],
            math.sqrt(sq) if sq >= 0 else math.nan, total, absmax, zero, math.isnan(sq),
            math.isinf(absmax) if not math.isnan(absmax) else math.isinf(sq), math.nan, 0,
            weight, update))
        if p.keep_var is not None:
            result.kept[keep_label(p.layer, p.tensor)] = p.keep_var.numpy().copy()
