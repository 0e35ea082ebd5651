"""Loss-scale overflow: the steps a mixed-precision loss scaler skipped."""

from __future__ import annotations

import math

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding, fmt
from graddebug.detectors.nonfinite import origin_of
from graddebug.hookspecs import hookimpl
from graddebug.records import Cause, EventKind, Finding, Issue, Severity

__all__ = ["SCALE_PREFIX", "graddebug_findings"]

SCALE_PREFIX = "scale="
"""``skipped_step`` events hold ``scale=<the loss scale of that backward pass>``."""


def _scale(detail: str) -> float:
    """The scale in a ``skipped_step`` event's detail; NaN when the detail holds none."""
    if not detail.startswith(SCALE_PREFIX):
        return math.nan
    try:
        return float(detail[len(SCALE_PREFIX):])
    except ValueError:
        return math.nan


def _runs(skipped: list[int], recorded: list[int]) -> list[list[int]]:
    """Skipped steps grouped into runs that are consecutive among the recorded steps."""
    position = {step: i for i, step in enumerate(recorded)}
    runs: list[list[int]] = []
    for step in skipped:
        if runs and position[step] == position[runs[-1][-1]] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return runs


def _steps_text(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """One finding for the steps a loss scaler skipped on overflow.

    A skip or a few are how dynamic loss scaling finds its scale: a ``warning``. A run of
    :attr:`~graddebug.config.Thresholds.overflow_steps` consecutive skipped steps, or a skip
    at a scale below 1, means the gradients overflow whatever the scale: an ``error`` that
    names where the first of them turned non-finite.
    """
    events = evidence.events
    if events.empty:
        return []
    rows = events[events["event"] == EventKind.SKIPPED_STEP.value]
    if rows.empty:
        return []
    scales = {int(step): _scale(str(detail))
              for step, detail in zip(rows["step"], rows["detail"], strict=True)}
    skipped = sorted(scales)
    recorded = sorted({*skipped, *(int(s) for s in evidence.records["step"].unique()),
                       *(int(s) for s in events["step"].unique())})
    runs = _runs(skipped, recorded)
    longest = max(runs, key=len)
    low = [s for s in skipped if scales[s] < 1]
    last_scale = scales[skipped[-1]]
    if len(longest) >= thresholds.overflow_steps:
        return [_persistent(evidence, longest, None, thresholds)]
    if low:
        return [_persistent(evidence, [low[0]], scales[low[0]], thresholds)]
    return [finding(
        Issue.OVERFLOW, Severity.WARNING, skipped[0], "",
        f"loss-scale overflow, step skipped: the loss scaler skipped {len(skipped)} step(s) "
        f"({', '.join(_steps_text(r) for r in runs[:5])}{', ...' if len(runs) > 5 else ''}) "
        f"because the scaled gradients held Inf or NaN, and lowered its scale (to "
        f"{fmt(last_scale)} at the last skip). A few skips while the scale settles are "
        "normal; many mean the gradients overflow float16 itself.",
        value=float(len(longest)), threshold=float(thresholds.overflow_steps), cause=Cause.NUMERICS
    )]


def _persistent(evidence: Evidence, steps: list[int], low_scale: float | None,
                thresholds: Thresholds) -> Finding:
    """The error for an overflow that lowering the scale does not cure, naming its origin.

    Args:
        evidence: The run.
        steps: The skipped steps that make it persistent (a run of them, or the one whose
            scale was below 1).
        low_scale: That scale below 1, or None for a run of consecutive skips.
        thresholds: The thresholds.
    """
    records, events = evidence.records, evidence.events
    first = steps[0]
    step_rows = records[records["step"] == first]
    bad = step_rows[step_rows["nan"] | step_rows["inf"]]
    forward = events[(events["step"] == first)
                     & (events["event"] == EventKind.FORWARD_NONFINITE.value)]
    origin = origin_of(first, bad, forward, step_rows)
    where = (f" Gradients first turn non-finite at {origin.layer!r} ({origin.tensor})."
             if origin is not None else "")
    why = (f"at a loss scale of {fmt(low_scale)}, below 1, so the gradients overflow unscaled"
           if low_scale is not None else
           f"on {len(steps)} consecutive recorded steps ({_steps_text(steps)}), at least "
           f"{thresholds.overflow_steps}")
    return finding(
        Issue.OVERFLOW, Severity.ERROR, first, origin.layer if origin is not None else "",
        f"persistent loss-scale overflow: the loss scaler skipped steps {why}, and a skipped "
        f"step leaves the weights unchanged.{where} Look for an activation or a loss that "
        "overflows float16 (largest value 65504): compute it in float32 (autocast disabled "
        "around it), normalise its input, or train in bfloat16, which needs no loss scaling.",
        tensor=origin.tensor if origin is not None else "",
        value=low_scale if low_scale is not None else float(len(steps)),
        threshold=1.0 if low_scale is not None else float(thresholds.overflow_steps),
        cause=Cause.NUMERICS
    )
