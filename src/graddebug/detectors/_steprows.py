"""One recorded step's rows as arrays: what the streaming rules read, built alike from a live
step's records and from a loaded run's frame."""

from __future__ import annotations

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
        loss, loss_finite, broken = math.nan, True, False
        kept = []
        for r in records:
            kind = r[_KIND_AT]
            if kind == _LOSS:
                loss = float(r[_MEAN_AT])  # type: ignore[arg-type]
                loss_finite = not (r[_NAN_AT] or r[_INF_AT])
            elif kind != _OP:
                broken = broken or bool(r[_NAN_AT] or r[_INF_AT])
                kept.append(r)
        kept.sort(key=_frame_order)  # as the record frame holds them, so a replay agrees
        columns = list(zip(*[[r[i] for i in _AT] for r in kept], strict=True)) if kept \
            else [() for _ in _FIELDS]
        return cls._of(step, _arrays(columns), loss, loss_finite,
                       broken or any(e.event in _BROKEN for e in events),
                       any(e.event == _SKIPPED for e in events))

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


def _frame_order(r: tuple[object, ...]) -> tuple[int, float, str, str]:
    """The order of a step's rows in the record frame: activations first, then parameters;
    each in forward order, unknown depths last."""
    depth = r[_DEPTH_AT]
    return (0 if r[_KIND_AT] == _ACTIVATION else 1,
            depth if depth >= 0 else math.inf,  # type: ignore[operator]
            r[_LAYER_AT], r[_TENSOR_AT])  # type: ignore[return-value]


def _arrays(columns: Sequence[Sequence[object]]) -> list[np.ndarray]:
    kind, layer, tensor, depth, numel, *floats = columns
    return [np.asarray(kind, dtype=object), np.asarray(layer, dtype=object),
            np.asarray(tensor, dtype=object), np.asarray(depth, dtype=np.int64),
            np.asarray(numel, dtype=np.int64),
            *(np.asarray(values, dtype=float) for values in floats)]
