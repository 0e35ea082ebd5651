"""Vanishing gradients: AUTOTRAINER's depth ratio, plus TorchLens' absolute floor.

Each rule gives at most one finding, which names the layer where the gradient collapses when
one layer accounts for most of the drop, and otherwise the layer farthest from the loss. The
victims are counted in the message.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding, fmt
from graddebug.detectors._depth import Jump, depth_trend, find_jump, profile
from graddebug.hookspecs import hookimpl
from graddebug.records import Cause, Finding, Issue, Kind, Severity

_ADVICE = (
    "Try ReLU/GELU instead of sigmoid/tanh, He or Xavier initialisation, a normalisation "
    "layer, or residual connections."
)


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Flag layers whose gradient is a vanishing fraction of the last layer's, or tiny."""
    if evidence.clean.empty:
        return []
    found = _depth(evidence, thresholds)
    covered = {f.layer for f in found}
    floor = _floor(evidence, thresholds)
    return found + [f for f in floor if f.layer not in covered]


def _depth(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    ratio_t, first_t = thresholds.vanishing_ratio, thresholds.vanishing_first
    rows = profile(evidence.layer_norms())
    flags = ((rows["ratio"] < ratio_t) & (rows["norm"] < first_t)
             & (rows["gain"] < thresholds.vanishing_gain))
    trend = depth_trend(flags, rows, grow=False,
                        share=thresholds.source_share)
    if not trend.victims:
        return []
    worst_layer = min(trend.victims, key=lambda k: trend.victims[k])
    scope = (
        f"{len(trend.victims)} layer(s) have a gradient (root mean square per entry) down to "
        f"{fmt(trend.victims[worst_layer])} times that of the last layer {trend.last_layer!r} "
        f"(at {worst_layer!r}; threshold {ratio_t:g}) in {trend.steps} of "
        f"{evidence.clean_steps()} steps"
    )
    if trend.jump is not None:
        message = (
            f"gradient vanishes in the backward of {trend.jump.layer!r}: the gradient at its "
            f"input (the output of {trend.jump.below!r}) is {fmt(trend.jump.gain)} times the "
            f"one at its output. Below it, {scope}. {_ADVICE}"
        )
    else:
        message = (
            f"gradient vanishes at {trend.named!r}: the gradient shrinks layer by layer "
            f"towards it, the layer farthest from the loss; {scope}. {_ADVICE}"
        )
    return [
        finding(
            Issue.VANISHING, Severity.WARNING, trend.first_step, trend.named, message,
            tensor="output" if evidence.basis == Kind.ACTIVATION.value else "",
            value=trend.victims[worst_layer], threshold=ratio_t, cause=Cause.LAYER
        )
    ]


def _floor(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    norms = evidence.layer_norms()
    medians = norms.groupby("layer", sort=False).agg(
        norm=("norm", "median"), rms=("rms", "median"), step=("step", "min"),
        depth=("depth", "min"),
    ).sort_values("depth", kind="stable")
    floor = thresholds.vanishing_floor
    low = medians[(medians["norm"] > 0) & (medians["norm"] < floor)]
    if low.empty:
        return []
    smallest = str(low["norm"].idxmin())
    smallest_norm = float(low["norm"].min())
    count = len(low)
    scope = (
        f"{count} layer(s) get a median gradient norm below {floor:g} over the recorded steps, "
        f"down to {fmt(smallest_norm)} at {smallest!r}"
    )
    collapse, recovery = _collapse(medians.reset_index(), thresholds.source_share, low)
    if collapse is None:
        if str(medians.index[0]) not in low.index:
            # The first layer gets a healthy gradient: the tiny layers are side branches the
            # gradient bypasses on its way to the input (ConvNeXt's blocks, scaled by a learned
            # 1e-6 at initialisation), not a gradient that vanishes before reaching it.
            return []
        first = str(low.index[0])
        message = f"gradient at {first!r} is vanishingly small: {scope}. {_ADVICE}"
        return [finding(Issue.VANISHING, Severity.WARNING, low.loc[first, "step"], first,
                        message, value=float(low["norm"].min()), threshold=floor,
                        cause=Cause.LAYER)]
    if recovery is not None:
        message = (
            f"gradient collapses {fmt(1 / collapse.gain)}-fold in the backward of "
            f"{collapse.layer!r} and is restored {fmt(recovery.gain)}-fold in the backward of "
            f"{recovery.layer!r}. Between them, {scope}. A weight of {recovery.layer!r} far "
            f"too large does this: its outputs are huge, and the normalisation or saturation "
            f"at {collapse.layer!r} divides the gradient by as much. Check its initialisation "
            "and scale."
        )
        named = recovery.layer
    else:
        message = (
            f"gradient collapses {fmt(1 / collapse.gain)}-fold in the backward of "
            f"{collapse.layer!r}. Below it, {scope}. {_ADVICE}"
        )
        named = collapse.layer
    return [finding(Issue.VANISHING, Severity.WARNING, low["step"].min(), named, message,
                    value=float(low["norm"].min()), threshold=floor, cause=Cause.LAYER)]


_BAND = 100.0
"""How far below its two ends (per entry) every layer of a collapsed band must be."""


def _collapse(medians: pd.DataFrame, share: float,
              low: pd.DataFrame) -> tuple[Jump | None, Jump | None]:
    """Where the median gradient collapses towards the tiny layers, and where, below them,
    it is restored, each when one layer accounts for most of it.

    Both are judged on the per-layer median over steps, the statistic the floor compares,
    and claimed only when the tiny layers lie between them in forward order and every layer
    between them is at least ``_BAND`` times below both ends. A residual network interleaves
    its branches in that order; where tiny layers alternate with healthy ones (ConvNeXt's
    branches, scaled by 1e-6 at initialisation), neighbours in depth are not neighbours in the
    graph, and no single layer is named.
    """
    usable = medians[np.isfinite(medians["rms"]) & (medians["rms"] > 0)].reset_index(drop=True)
    collapse = find_jump(usable, grow=False, share=share)
    if collapse is None or collapse.layer in low.index:
        return None, None
    position = {str(layer): i for i, layer in enumerate(usable["layer"])}
    end = position[collapse.below]
    recovery = find_jump(usable.iloc[: end + 1], grow=True, share=share) if end >= 1 else None
    start = position[recovery.layer] if recovery is not None else 0
    band = usable.iloc[start:end + 1]
    if not set(low.index) <= set(band["layer"]):
        return None, None
    # Every layer between them must sit far below both ends: a band the gradient collapsed
    # into, not healthy layers interleaved with tiny ones.
    ends = [float(usable["rms"].iloc[end + 1])]
    if recovery is not None:
        ends.append(float(usable["rms"].iloc[start - 1]))
    if float(band["rms"].max()) * _BAND > min(ends):
        return None, None
    return collapse, recovery
