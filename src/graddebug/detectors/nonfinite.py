"""NaN/Inf gradients, traced to the layer where they were born, and, where op-level capture ran
(``ops=True``, or ``escalate=True`` on a later step), to the operation and its source line."""

from __future__ import annotations

import pandas as pd

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding
from graddebug.hookspecs import hookimpl
from graddebug.records import WEIGHTED_DETAIL, Cause, EventKind, Finding, Issue, Kind, Severity

_FORWARD_ADVICE = (
    "Look for log/sqrt/pow/division of non-positive or zero values, or overflow, in its "
    "forward; clamp the input (x.clamp_min(1e-8) in torch, tf.maximum(x, 1e-8) in TF) or use "
    "a stable formulation (log_softmax, logsumexp)."
)
_BACKWARD_ADVICE = (
    "Its forward values were finite, so a derivative blew up: look for sqrt, pow or division "
    "at 0 (d/dx sqrt(x) is inf at 0) and add an epsilon, or clip gradients."
)
_WEIGHTS_ADVICE = (
    "Check its parameters with torch.isfinite(p).all() / tf.reduce_all(tf.math.is_finite(v)), "
    "and what last wrote them: a checkpoint, an in-place edit, an update from outside the "
    "optimizer."
)
_FORWARD_OUTPUT = EventKind.FORWARD_NONFINITE.value
_BETWEEN = EventKind.LAYER_INPUT_NONFINITE.value
_OP_FORWARD = EventKind.OP_NONFINITE.value
_OP_BACKWARD = EventKind.OP_GRAD_NONFINITE.value


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Name the layer where NaN/Inf first appears, in forward order or else backward order;
    name the operation and its line where op-level capture saw it."""
    records, events = evidence.records, evidence.events
    bad_rows = records[records["nan"] | records["inf"]] if not records.empty else records
    # A loss scaler's skipped step overflowed in backward by design (the overflow diagnosis
    # judges those); a NaN in its forward pass is no scaling artefact and stays a fault here.
    skipped = evidence.skipped_steps
    if skipped:
        bad_rows = bad_rows[~bad_rows["step"].isin(skipped)]
    # Forward births: outputs, and layer inputs that code between recorded layers made NaN
    # (an Inf there may be an additive mask, which is by design).
    forward = events[(events["event"] == _FORWARD_OUTPUT)
                     | ((events["event"] == _BETWEEN)
                        & events["detail"].astype(str).str.startswith("NaN"))]
    op_events = events[events["event"].isin((_OP_FORWARD, _OP_BACKWARD))]
    if skipped:
        op_events = op_events[(op_events["event"] == _OP_FORWARD)
                              | ~op_events["step"].isin(skipped)]
    # Op-level events only pin a layer-level finding down: an op may hold -inf by design (an
    # attention mask) where every layer stays finite.
    steps = sorted(set(bad_rows["step"]) | set(forward["step"]))
    # Only the first broken step has a meaningful origin: once an optimizer applies a NaN
    # update, every later step is NaN everywhere.
    for step in steps:
        origin = _layer_origin(int(step), bad_rows, forward, records)
        pinned = _op_origin(int(step), origin, op_events, bad_rows, forward, records)
        found = pinned if pinned is not None else origin
        if found is not None:
            found = _from_data(found, int(step), events, records)
            later = len(steps) - 1
            if later:
                found = found._replace(
                    message=f"{found.message} {later} later step(s) were non-finite too."
                )
            return [found]
    return []


_INPUT = EventKind.INPUT_NONFINITE.value


def _from_data(found: Finding, step: int, events: pd.DataFrame,
               records: pd.DataFrame) -> Finding:
    """``found``, told that the data brought the NaN/Inf where the model's input held one at
    ``step``.

    An input that was non-finite at every step recorded since the first (an additive
    attention mask of ``-inf``) is the model's by design, not a bad batch, and does not
    count.
    """
    inputs = events[events["event"] == _INPUT]
    now = inputs[inputs["step"] == step]
    if now.empty:
        return found
    recorded = {int(s) for s in records["step"]} | {step}
    so_far = len([s for s in recorded if s <= step])
    if so_far > 1:
        always = {t for t, rows in inputs[inputs["step"] <= step].groupby("tensor")
                  if rows["step"].nunique() == so_far}
        now = now[~now["tensor"].isin(always)]
        if now.empty:
            return found
    held = ", ".join(f"{t} ({d})" for t, d in zip(now["tensor"], now["detail"], strict=True))
    return found._replace(cause=Cause.DATA.value, message=(
        f"the model's input held NaN/Inf at step {step}: {held}. The data, not the model, "
        f"brought it; {found.layer!r} is the first layer it reached. Check the batch (a "
        "corrupt sample, a division or log in preprocessing, a missing value), or skip "
        "batches that fail torch.isfinite(x).all() / tf.reduce_all(tf.math.is_finite(x)) / "
        "jnp.isfinite(x).all()."))


def _layer_origin(step: int, bad_rows: pd.DataFrame, forward: pd.DataFrame,
                  records: pd.DataFrame) -> Finding | None:
    return origin_of(step, bad_rows[bad_rows["step"] == step],
                     forward[forward["step"] == step], records[records["step"] == step])


def _op_origin(step: int, origin: Finding | None, op_events: pd.DataFrame,
               bad_rows: pd.DataFrame, forward: pd.DataFrame,
               records: pd.DataFrame) -> Finding | None:
    """The finding that names the operation where NaN/Inf was born, from op-level events.

    They come from ``step`` itself (``ops=True``), or from a later step that op-level capture
    recorded after the problem appeared (``escalate=True``). A later step counts only where
    the same layer-level origin recurred: once a NaN update has reached the weights, the first
    operation to go non-finite is merely the first to read them.
    """
    if op_events.empty or origin is None:
        return None
    born_forward = not forward[forward["step"] == step].empty
    for at in sorted({int(s) for s in op_events["step"] if s >= step}):
        if at != step:
            again = _layer_origin(at, bad_rows, forward, records)
            same_birth = not forward[forward["step"] == at].empty
            if origin is None or again is None or same_birth != born_forward or (
                    again.layer, again.tensor) != (origin.layer, origin.tensor):
                continue
        rows = op_events[op_events["step"] == at]
        pinned = _pin(step, at, rows, born_forward)
        if pinned is not None:
            return pinned
    return None


def _pin(step: int, at: int, rows: pd.DataFrame, born_forward: bool) -> Finding | None:
    when = f"step {step}" if at == step else (
        f"step {step}; op-level capture of step {at}, where it recurred, found it")
    forward = rows[rows["event"] == _OP_FORWARD]
    if born_forward and not forward.empty:
        first = forward.sort_values("depth", kind="stable").iloc[0]
        op = _op_name(first["tensor"])
        return finding(
            Issue.NONFINITE, Severity.ERROR, step, first["layer"],
            (
                f"{op} in {first['layer']!r} ({_where(first['source'])}) is the first "
                f"operation whose output held {first['detail']} in the forward pass ({when}); "
                f"every gradient behind it is poisoned. {_FORWARD_ADVICE}"
            ),
            tensor=first["tensor"], source=first["source"], cause=Cause.NUMERICS
        )
    backward = rows[rows["event"] == _OP_BACKWARD]
    if born_forward or backward.empty:
        return None  # a forward birth the ops did not see is left to the layer-level finding
    # The first to happen in backward is the one closest to the loss: deepest in forward order.
    last = backward.sort_values("depth", ascending=False, kind="stable").iloc[0]
    op = _op_name(last["tensor"])
    return finding(
        Issue.NONFINITE, Severity.ERROR, step, last["layer"],
        (
            f"the backward of {op} in {last['layer']!r} ({_where(last['source'])}) turned a "
            f"finite gradient into {last['detail']} ({when}): the gradient at its output was "
            f"finite. {_BACKWARD_ADVICE}"
        ),
        tensor=last["tensor"], source=last["source"], cause=Cause.NUMERICS
    )


def _op_name(site: object) -> str:
    """The operation of an op site ``op@file:line``."""
    return str(site).partition("@")[0]


def _where(source: object) -> str:
    return str(source) or "source line unknown"


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
        return _forward_origin(step, forward)
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
                tensor=row.tensor, cause=Cause.NUMERICS
            )
        previous = row.layer
    return None


def _forward_origin(step: int, forward: pd.DataFrame) -> Finding:
    """The finding of a NaN/Inf born in the forward pass of ``step``: the first event in
    forward order (a layer's input before its output), from ``forward``'s events of it."""
    # A layer's own output comes after its input, whichever order the adapter listed them in.
    order = forward.assign(_out=forward["event"] == _FORWARD_OUTPUT)
    first = order.sort_values(["depth", "_out"], kind="stable").iloc[0]
    layer, detail = str(first["layer"]), str(first["detail"])
    what = detail.removesuffix(WEIGHTED_DETAIL)
    if first["event"] == _BETWEEN:
        parent = layer.rpartition(".")[0]
        maker = (f"{parent!r} made it in its own forward, between its children"
                 if parent else f"the model's own forward made it before {layer!r}")
        return finding(
            Issue.NONFINITE, Severity.ERROR, step, parent or layer,
            (
                f"the input of {layer!r} held {what} in the forward pass (step {step}) while "
                f"every recorded output before it was finite: {maker}; every gradient behind "
                f"it is poisoned. {_FORWARD_ADVICE}"
            ),
            tensor="" if parent else str(first["tensor"]), cause=Cause.NUMERICS
        )
    if detail.endswith(WEIGHTED_DETAIL) and what == "NaN":
        return finding(
            Issue.NONFINITE, Severity.ERROR, step, layer,
            (
                f"{layer!r} is the first layer whose output held NaN in the forward pass (step "
                f"{step}), from a finite input. Its output is fixed by its input and its own "
                "parameters, which cannot make a NaN from finite values: its parameters hold "
                f"NaN/Inf, and every gradient behind it is poisoned. {_WEIGHTS_ADVICE}"
            ),
            tensor=str(first["tensor"]), cause=Cause.LAYER
        )
    return finding(
        Issue.NONFINITE, Severity.ERROR, step, layer,
        (
            f"{layer!r} is the first layer whose output held {what} in the forward pass "
            f"(step {step}); every gradient behind it is poisoned. {_FORWARD_ADVICE}"
        ),
        tensor=str(first["tensor"]), cause=Cause.NUMERICS
    )
