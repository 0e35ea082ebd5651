"""Synthetic runs, built from records by hand, for tests that need no framework."""

from __future__ import annotations

import math

from graddebug import Report, Thresholds
from graddebug.diagnosis import diagnose
from graddebug.frames import event_frame, record_frame
from graddebug.records import Event, Record

LAYERS = ("embed", "block.0", "block.1", "head")


def records(steps: int = 12, layers: tuple[str, ...] = LAYERS, *,
            nan_at: tuple[int, str] | None = None, clip: str | None = None,
            shape_tuples: bool = False) -> list[Record]:
    """Healthy-looking records: activation and weight rows per layer, norms near 1.

    Args:
        steps: Recorded steps.
        layers: Layer names, in forward order.
        nan_at: ``(step, layer)`` whose output gradient (and every later step's) is NaN.
        clip: A layer whose output rows carry a ``pre_norm`` (an intervention acted).
        shape_tuples: Store ``shape`` as a tuple instead of its ``str``.
    """
    rows = []
    for step in range(steps):
        for depth, layer in enumerate(layers):
            for kind, tensor, shape in (("activation", "output", (16, 8)),
                                        ("parameter", "weight", (8, 8))):
                norm = (1.0 + 0.1 * depth) * (1.0 + 0.01 * ((step * 7 + depth) % 5))
                bad = (nan_at is not None and kind == "activation" and layer == nan_at[1]
                       and step >= nan_at[0])
                if bad:
                    norm = math.nan
                numel = shape[0] * shape[1]
                pre = norm * 2 if clip == layer and kind == "activation" else math.nan
                rows.append(Record(step, layer, tensor, kind, depth,
                                   shape if shape_tuples else str(shape), numel, norm,
                                   0.0, norm / math.sqrt(numel), norm / 2,
                                   0.0 if kind == "activation" else math.nan, bad, False, pre))
    return rows


def report(rows: list[Record], events: list[Event] = (), metadata: dict | None = None) -> Report:
    """A Report of ``rows`` diagnosed with the default thresholds."""
    thresholds = Thresholds()
    frame, evs = record_frame(rows), event_frame(list(events))
    return Report(frame, evs, diagnose(frame, evs, thresholds), thresholds=thresholds,
                  metadata=metadata or {"framework": "synthetic", "model": "Handmade"})


def healthy() -> Report:
    """Four layers, 12 steps, no finding."""
    return report(records())


def broken() -> Report:
    """NaN gradients at ``block.1`` from step 5: an error-severity ``nonfinite`` finding."""
    return report(records(nan_at=(5, "block.1")))
