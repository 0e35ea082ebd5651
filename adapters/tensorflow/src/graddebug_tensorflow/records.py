"""Buffer rows of one step, read back on the host, turned into records and events."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from graddebug.adapter import StepResult
from graddebug.capture.layers import keep_label
from graddebug.records import Event, EventKind, Kind, Record, sums_record
from graddebug_tensorflow.buffers import ScalerCol
from graddebug_tensorflow.params import UNMEASURED
from graddebug_tensorflow.stats import NOT_MEASURED, Col

if TYPE_CHECKING:
    from graddebug_tensorflow.outputs import Slot
    from graddebug_tensorflow.params import Param

__all__ = ["handed_over", "param_records", "skipped_step", "step_records"]

_ACTIVATION, _PARAMETER = Kind.ACTIVATION.value, Kind.PARAMETER.value  # Enum.value is slow


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
        if broken:
            result.events.append(Event(step, name, tname, layer.depth,
                                       EventKind.FORWARD_NONFINITE.value,
                                       "NaN" if any(math.isnan(v) for v in broken) else "Inf",
                                       rank))
        if not reached:
            if ran:
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
    :class:`~graddebug_tensorflow.buffers.ScalerCol`); None when it skipped none."""
    if len(scaler) == 0 or scaler[ScalerCol.SKIPPED] <= 0:
        return None
    scale = float(scaler[ScalerCol.SKIPPED_SCALE])
    return Event(step, "", "", -1, EventKind.SKIPPED_STEP.value, f"scale={scale!r}")


def _activation(step: int, layer: str, tname: str, depth: int,
                rows: list[np.ndarray], rank: int) -> Record:
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


def param_records(step: int, params: Sequence[Param], rows: np.ndarray, result: StepResult,
                  source: bool, depth: Callable[[Param], int]) -> None:
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
    """
    source = source or handed_over(rows, len(params))
    for p, row in zip(params, rows.tolist(), strict=False):  # Python floats: no numpy scalars
        if row[0] >= UNMEASURED:
            continue  # present, not read inside a graph (a batch norm's: see ParamSet)
        if row[0] <= 0:
            if source:
                result.events.append(Event(step, p.layer, p.tensor, depth(p),
                                           EventKind.NO_GRAD.value))
            continue
        _, sq, total, absmax = row
        if p.shape is None:  # a variable's shape is fixed: its text and size, once
            shape = tuple(int(d) for d in p.var.shape)
            p.shape = (str(shape), int(np.prod(shape, dtype=np.int64)))
        result.records.append(sums_record(
            step, p.layer, p.tensor, _PARAMETER, depth(p), p.shape[0], p.shape[1],
            math.sqrt(sq) if sq >= 0 else math.nan, total, absmax, math.nan, math.isnan(sq),
            math.isinf(absmax) if not math.isnan(absmax) else math.isinf(sq)))
        if p.keep_var is not None:
            result.kept[keep_label(p.layer, p.tensor)] = p.keep_var.numpy().copy()
