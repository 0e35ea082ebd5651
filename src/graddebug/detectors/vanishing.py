"""Vanishing gradients: AUTOTRAINER's depth ratio, plus TorchLens' absolute floor."""

from __future__ import annotations

import operator

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding, fmt
from graddebug.detectors._depth import depth_ratio_hits
from graddebug.hookspecs import hookimpl
from graddebug.records import Finding, Issue, Kind, Severity

_ADVICE = (
    "Try ReLU/GELU instead of sigmoid/tanh, He or Xavier initialisation, a normalisation "
    "layer, or residual connections."
)


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Flag layers whose gradient is a vanishing fraction of the last layer's, or tiny."""
    if evidence.records.empty:
        return []
    ratio_t, first_t = thresholds.vanishing_ratio, thresholds.vanishing_first
    hits = depth_ratio_hits(
        evidence,
        fires=lambda ratio, first: ratio < ratio_t and first < first_t,
        flags=lambda ratio, norm: ratio < ratio_t and norm < first_t,
        worse=operator.lt,
    )
    total = evidence.steps()
    kind = evidence.basis
    findings = [
        finding(
            Issue.VANISHING, Severity.WARNING, hit.first_step, hit.layer,
            (
                f"gradient vanishes at {hit.layer!r}: its norm is {fmt(hit.worst)} times that "
                f"of the last layer {hit.last_layer!r} (threshold {ratio_t:g}) in {hit.steps} "
                f"of {total} steps. {_ADVICE}"
            ),
            tensor="output" if kind == Kind.ACTIVATION.value else "", value=hit.worst,
            threshold=ratio_t,
        )
        for hit in hits.values()
    ]
    findings.extend(_floor(evidence, thresholds, exclude=set(hits)))
    return findings


def _floor(evidence: Evidence, thresholds: Thresholds, exclude: set[str]) -> list[Finding]:
    norms = evidence.layer_norms()
    medians = norms.groupby("layer", sort=False).agg(
        norm=("norm", "median"), step=("step", "min"), depth=("depth", "min")
    )
    floor = thresholds.vanishing_floor
    low = medians[(medians["norm"] > 0) & (medians["norm"] < floor)].sort_values("depth")
    return [
        finding(
            Issue.VANISHING, Severity.WARNING, row.step, layer,
            (
                f"gradient at {layer!r} is vanishingly small: median norm {fmt(row.norm)} over "
                f"the recorded steps, below {floor:g}. {_ADVICE}"
            ),
            value=row.norm, threshold=floor,
        )
        for layer, row in low.iterrows()
        if layer not in exclude
    ]
