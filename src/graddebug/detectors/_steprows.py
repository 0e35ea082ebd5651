"""One recorded step's rows as arrays: what the streaming rules read, built alike from a live
step's records and from a loaded run's frame."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from graddebug.records import Event, EventKind, Kind, Record

__all__ = ["StepRows"]

_LOSS, _OP = Kind.LOSS.value, Kind.OP.value
_BROKEN = (EventKind.FORWARD_NONFINITE.value, EventKind.INPUT_NONFINITE.value)
_SKIPPED = EventKind.SKIPPED_STEP.value
_FIELDS = ("kind", "layer", "tensor", "depth", "numel", "norm", "zero_frac", "weight_norm",
           "update_norm")
_AT = tuple(Record._fields.index(name) for name in _FIELDS)
_NAN_AT, _INF_AT = Record._fields.index("nan"), Record._fields.index("inf")
_NUMERIC = ((_AT[4], np.int64), *((i, float) for i in _AT[5:]), (_NAN_AT, bool),
            (_INF_AT, bool))
"""numel, norm, zero_frac, weight_norm, update_norm, nan, inf: (field index, dtype)."""
_MEAN_AT = Record._fields.index("mean")
_KIND_AT = Record._fields.index("kind")
_DEPTH_AT, _LAYER_AT = Record._fields.index("depth"), Record._fields.index("layer")
_TENSOR_AT = Record._fields.index("tensor")
_ACTIVATION = Kind.ACTIVATION.value


@dataclass
class StepRows:
    """The gradient rows of one step (activation and parameter rows; op rows left out), and
    what else the step showed.

    Attributes:
        step: The step.
        kind, layer, tensor: Per row, as in the record frame (object arrays).
        depth, numel: Per row (int arrays).
        norm, zero_frac, weight_norm, update_norm: Per row (float arrays).
        loss: The step's loss; NaN where none was recorded.
        loss_finite: False where a recorded loss was NaN or Inf.
        broken: Some gradient, layer output or model input of the step held NaN or Inf (the
            ``nonfinite`` diagnosis speaks for such a step).
        skipped: A loss scaler skipped the step.
    """

    step: int
    kind: np.ndarray
    layer: np.ndarray
    tensor: np.ndarray
    depth: np.ndarray
    numel: np.ndarray
    norm: np.ndarray
    zero_frac: np.ndarray
    weight_norm: np.ndarray
    update_norm: np.ndarray
    loss: float = math.nan
    loss_finite: bool = True
    broken: bool = False
    skipped: bool = False

    def __len__(self) -> int:
        return len(self.norm)

    @classmethod
    def from_records(cls, step: int, records: Sequence[tuple[object, ...]],
                     events: Sequence[Event]) -> StepRows:
        """Build from a step's :class:`~graddebug.records.Record` rows and events."""
        broken = any(e.event in _BROKEN for e in events)
        skipped = any(e.event == _SKIPPED for e in events)
        if not records:
            return cls._of(step, _arrays([() for _ in _FIELDS]), math.nan, True, broken,
                           skipped)
        columns = list(zip(*records, strict=True))  # one tuple per field, made in C
        order = _order(columns[_KIND_AT], columns[_DEPTH_AT], columns[_LAYER_AT],
                       columns[_TENSOR_AT])
        loss, loss_finite = math.nan, True
        if order.loss is not None:  # the last loss row, if several
            loss = float(columns[_MEAN_AT][order.loss])
            loss_finite = not (columns[_NAN_AT][order.loss] or columns[_INF_AT][order.loss])
        kept = order.kept
        numel, norm, zero_frac, weight_norm, update_norm, nan, inf = (
            np.asarray(columns[i], dtype=dtype)[kept] for i, dtype in _NUMERIC)
        return cls(step, order.kind, order.layer, order.tensor, order.depth, numel, norm,
                   zero_frac, weight_norm, update_norm, loss=loss, loss_finite=loss_finite,
                   broken=broken or bool(nan.any() or inf.any()), skipped=skipped)

    @classmethod
    def _of(cls, step: int, arrays: list[np.ndarray], loss: float, loss_finite: bool,
            broken: bool, skipped: bool) -> StepRows:
        kind, layer, tensor, depth, numel, norm, zero_frac, weight_norm, update_norm = arrays
        return cls(step, kind, layer, tensor, depth, numel, norm, zero_frac, weight_norm,
                   update_norm, loss=loss, loss_finite=loss_finite, broken=broken,
                   skipped=skipped)

    @classmethod
    def from_columns(cls, step: int, columns: dict[str, np.ndarray], at: np.ndarray,
                     events: np.ndarray) -> StepRows:
        """Build from the rows ``at`` of a record frame's columns (``columns``, one array per
        column name, taken once for the whole frame) and the step's event kinds."""
        kind = columns["kind"][at]
        is_loss = kind == _LOSS
        loss, loss_finite = math.nan, True
        if is_loss.any():
            first = at[is_loss][0]
            loss = float(columns["mean"][first])
            loss_finite = not bool(columns["nan"][first] or columns["inf"][first])
        grads = at[~is_loss & (kind != _OP)]
        broken = bool(columns["nan"][grads].any() or columns["inf"][grads].any()
                      or np.isin(events, _BROKEN).any())
        return cls._of(step, _arrays([columns[name][grads] for name in _FIELDS]), loss,
                       loss_finite, broken, bool((events == _SKIPPED).any()))


@dataclass(frozen=True)
class _Order:
    """Where a step's gradient rows go, for one sequence of (kind, depth, layer, tensor).

    Attributes:
        kept: The indices of the gradient rows (no loss or op row), in frame order.
        loss: The index of the last loss row; None where there is none.
        kind, layer, tensor, depth: The kept rows' columns (read-only arrays).
    """

    kept: np.ndarray
    loss: int | None
    kind: np.ndarray
    layer: np.ndarray
    tensor: np.ndarray
    depth: np.ndarray


@functools.lru_cache(maxsize=8)
def _order(kind: tuple[object, ...], depth: tuple[object, ...], layer: tuple[object, ...],
           tensor: tuple[object, ...]) -> _Order:
    """The frame order of a step's rows: activations first, then parameters; each in forward
    order, unknown depths last. Cached: a run's steps repeat one sequence of rows, and sorting
    it is a third of the cost of building a step's arrays."""
    def frame_order(i: int) -> tuple[int, float, str, str]:
        d = depth[i]
        return (0 if kind[i] == _ACTIVATION else 1,
                d if d >= 0 else math.inf,  # type: ignore[operator]
                layer[i], tensor[i])  # type: ignore[return-value]

    kept = sorted((i for i, k in enumerate(kind) if k not in (_LOSS, _OP)), key=frame_order)
    losses = [i for i, k in enumerate(kind) if k == _LOSS]
    at = np.asarray(kept, dtype=np.int64)
    kind_a, layer_a, tensor_a, depth_a = (np.asarray([column[i] for i in kept], dtype=dtype)
                                          for column, dtype in ((kind, object),
                                                                (layer, object),
                                                                (tensor, object),
                                                                (depth, np.int64)))
    for array in (at, kind_a, layer_a, tensor_a, depth_a):
        array.flags.writeable = False  # shared by every step of the sequence
    return _Order(at, losses[-1] if losses else None, kind_a, layer_a, tensor_a, depth_a)


def _arrays(columns: Sequence[Sequence[object]]) -> list[np.ndarray]:
    kind, layer, tensor, depth, numel, *floats = columns
    return [np.asarray(kind, dtype=object), np.asarray(layer, dtype=object),
            np.asarray(tensor, dtype=object), np.asarray(depth, dtype=np.int64),
            np.asarray(numel, dtype=np.int64),
            *(np.asarray(values, dtype=float) for values in floats)]
