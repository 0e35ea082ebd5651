"""Exploding gradients: absolute magnitude, depth ratio, and growth of the smoothed norm."""

from __future__ import annotations

import operator

import numpy as np
import pandas as pd

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding, fmt
from graddebug.detectors._depth import depth_ratio_hits
from graddebug.hookspecs import hookimpl
from graddebug.records import Finding, Issue, Kind, Severity

_ADVICE = (
    "Try gradient clipping (torch clip_grad_norm_, Keras clipnorm= on the optimizer), a lower "
    "learning rate, smaller initial weights (He/Xavier), or a normalisation layer."
)


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Flag gradients that are huge, that grow with distance from the loss, or over time."""
    if evidence.records.empty:
        return []
    # One finding per layer: the rule that saw it first.
    found: dict[str, Finding] = {}
    for candidate in (*_magnitude(evidence, thresholds), *_depth(evidence, thresholds),
                      *_growth(evidence, thresholds)):
        known = found.get(candidate.layer)
        if known is None or candidate.step < known.step:
            found[candidate.layer] = candidate
    return list(found.values())


def _magnitude(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    limit = thresholds.exploding_norm
    rows = evidence.records
    big = rows[np.isfinite(rows["norm"]) & (rows["norm"] > limit)]
    out = []
    for (layer, tensor), group in big.groupby(["layer", "tensor"], sort=False):
        worst = float(group["norm"].max())
        out.append(
            finding(
                Issue.EXPLODING, Severity.WARNING, group["step"].min(), layer,
                (
                    f"gradient explodes at {layer!r} ({tensor}): norm up to {fmt(worst)}, above "
                    f"{limit:g}, in {group['step'].nunique()} of {evidence.steps()} steps. "
                    f"{_ADVICE}"
                ),
                tensor=tensor, value=worst, threshold=limit,
            )
        )
    return out


def _depth(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    limit = thresholds.exploding_ratio
    hits = depth_ratio_hits(
        evidence,
        fires=lambda ratio, first: ratio > limit,
        flags=lambda ratio, norm: ratio > limit,
        worse=operator.gt,
    )
    return [
        finding(
            Issue.EXPLODING, Severity.WARNING, hit.first_step, hit.layer,
            (
                f"gradient explodes towards the input at {hit.layer!r}: its norm is "
                f"{fmt(hit.worst)} times that of the last layer {hit.last_layer!r} (threshold "
                f"{limit:g}) in {hit.steps} of {evidence.steps()} steps. {_ADVICE}"
            ),
            tensor="output" if evidence.basis == Kind.ACTIVATION.value else "", value=hit.worst,
            threshold=limit,
        )
        for hit in hits.values()
    ]


def _smoothed_growth(series: pd.Series, window: int) -> tuple[float, int]:
    """Largest ratio of a later rolling median to the first window's median, and its step."""
    values = series.to_numpy(dtype=float)
    base = float(np.median(values[:window]))
    if not np.isfinite(base) or base <= 0:
        return 1.0, -1
    rolling = series.rolling(window).median().to_numpy()[2 * window - 1:]
    if rolling.size == 0 or not np.isfinite(rolling).any():
        return 1.0, -1
    at = int(np.nanargmax(rolling))
    return float(rolling[at]) / base, int(series.index[2 * window - 1 + at])


def _growth(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    window, factor = thresholds.growth_window, thresholds.growth_factor
    norms = evidence.layer_norms()
    norms = norms[np.isfinite(norms["norm"])]
    total = np.sqrt((norms["norm"] ** 2).groupby(norms["step"]).sum())
    if len(total) < 2 * window:
        return []
    growth, step = _smoothed_growth(total, window)
    if growth <= factor:
        return []
    # Name the layer whose own smoothed norm grew the most.
    per_layer = norms.pivot_table(index="step", columns="layer", values="norm")
    best_layer, best = "", 0.0
    for layer in per_layer.columns:
        g, _ = _smoothed_growth(per_layer[layer].dropna(), window)
        if g > best:
            best_layer, best = str(layer), g
    return [
        finding(
            Issue.EXPLODING, Severity.WARNING, step, best_layer,
            (
                f"the total gradient norm grew {fmt(growth)}-fold (median over {window} steps) "
                f"by step {step}; {best_layer!r} grew the most ({fmt(best)}-fold). The run is "
                f"diverging: {_ADVICE}"
            ),
            value=growth, threshold=factor,
        )
    ]
