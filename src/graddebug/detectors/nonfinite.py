"""NaN/Inf gradients, traced to the layer where they were born."""

from __future__ import annotations

import pandas as pd

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding
from graddebug.hookspecs import hookimpl
from graddebug.records import EventKind, Finding, Issue, Kind, Severity

_FORWARD_ADVICE = (
    "Look for log/sqrt/pow/division of non-positive or zero values, or overflow, in its "
    "forward; clamp the input (x.clamp_min(1e-8) in torch, tf.maximum(x, 1e-8) in TF) or use "
    "a stable formulation (log_softmax, logsumexp)."
)
_BACKWARD_ADVICE = (
    "Its forward values were finite, so a derivative blew up: look for sqrt, pow or division "
    "at 0 (d/dx sqrt(x) is inf at 0) and add an epsilon, or clip gradients."
)


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Name the layer where NaN/Inf first appears, in forward order or else backward order."""
    records, events = evidence.records, evidence.events
    bad_rows = records[records["nan"] | records["inf"]] if not records.empty else records
    # A loss scaler's skipped step overflowed in backward by design (the overflow diagnosis
    # judges those); a NaN in its forward pass is no scaling artefact and stays a fault here.
    skipped = evidence.skipped_steps
    if skipped:
        bad_rows = bad_rows[~bad_rows["step"].isin(skipped)]
    forward = events[events["event"] == EventKind.FORWARD_NONFINITE.value]
    steps = sorted(set(bad_rows["step"]) | set(forward["step"]))
    # Only the first broken step has a meaningful origin: once an optimizer applies a NaN
    # update, every later step is NaN everywhere.
    for step in steps:
        origin = origin_of(int(step), bad_rows[bad_rows["step"] == step],
                         forward[forward["step"] == step], records[records["step"] == step])
        if origin is not None:
            later = len(steps) - 1
            if later:
                origin = origin._replace(
                    message=f"{origin.message} {later} later step(s) were non-finite too."
                )
            return [origin]
    return []


def _what(rows: pd.DataFrame) -> str:
    nan, inf = bool(rows["nan"].any()), bool(rows["inf"].any())
    return "NaN and Inf" if nan and inf else "Inf" if inf else "NaN"


def origin_of(step: int, bad: pd.DataFrame, forward: pd.DataFrame,
              step_rows: pd.DataFrame) -> Finding | None:
    """The ``nonfinite`` finding that names where NaN/Inf was born in ``step``.

    Args:
        step: The step.
        bad: Its non-finite record rows.
        forward: Its ``forward_nonfinite`` events (a forward birth wins).
        step_rows: All its record rows (backward order gives the origin).

    Returns:
        The finding, or None when nothing in the step is non-finite.
    """
    if not forward.empty:
        first = forward.sort_values("depth", kind="stable").iloc[0]
        return finding(
            Issue.NONFINITE, Severity.ERROR, step, first["layer"],
            (
                f"{first['layer']!r} is the first layer whose output held {first['detail']} in "
                f"the forward pass (step {step}); every gradient behind it is poisoned. "
                f"{_FORWARD_ADVICE}"
            ),
            tensor=first["tensor"],
        )
    if bad.empty:
        return None
    activations = bool((bad["kind"] == Kind.ACTIVATION.value).any())
    kind = Kind.ACTIVATION.value if activations else Kind.PARAMETER.value
    ordered = step_rows[step_rows["kind"] == kind].sort_values("depth", ascending=False,
                                                               kind="stable")
    previous = None
    for row in ordered.itertuples():
        if row.nan or row.inf:
            where = f"the output of {row.layer!r}" if activations else repr(row.layer)
            after = (
                f"while {previous!r}, just downstream, was finite: the backward of {previous!r} "
                "produced it. "
                if previous is not None
                else "at the layer closest to the loss: check the loss itself. "
            )
            return finding(
                Issue.NONFINITE, Severity.ERROR, step, row.layer,
                (
                    f"gradient first becomes {_what(bad)} at {where} (step {step}), {after}"
                    f"{_BACKWARD_ADVICE}"
                ),
                tensor=row.tensor,
            )
        previous = row.layer
    return None
