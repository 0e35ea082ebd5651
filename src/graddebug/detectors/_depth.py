"""The depth-ratio rule shared by the vanishing and exploding detectors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from graddebug.detectors import Evidence, as_int

__all__ = ["DepthHit", "depth_ratio_hits"]


@dataclass
class DepthHit:
    """Where a layer crossed the depth-ratio rule, across steps."""

    layer: str
    first_step: int
    worst: float
    last_layer: str
    steps: int = 0


def depth_ratio_hits(
    evidence: Evidence,
    fires: Callable[[float, float], bool],
    flags: Callable[[float, float], bool],
    worse: Callable[[float, float], bool],
) -> dict[str, DepthHit]:
    """Apply a first/last-layer rule per step and collect the layers it flags.

    Per step, layers are taken in depth order with finite, positive norms. ``first`` is the
    shallowest, ``last`` the deepest.

    Args:
        evidence: The run's evidence.
        fires: ``fires(ratio, first_norm)``: whether the step shows the problem at all.
        flags: ``flags(layer_ratio, layer_norm)``: whether a layer takes part in it.
        worse: ``worse(a, b)``: whether ratio ``a`` is worse than ``b``.

    Returns:
        Hits by layer name, in depth order of first appearance.
    """
    hits: dict[str, DepthHit] = {}
    norms = evidence.layer_norms()
    for step, rows in norms.groupby("step", sort=True):
        values = rows["norm"].to_numpy()
        usable = np.isfinite(values) & (values > 0)
        if usable.sum() < 2:
            continue
        layers = rows["layer"].to_numpy()[usable]
        values = values[usable]
        last = float(values[-1])
        if not fires(float(values[0]) / last, float(values[0])):
            continue
        for layer, value in zip(layers[:-1], values[:-1], strict=True):
            ratio = float(value) / last
            if not flags(ratio, float(value)):
                continue
            hit = hits.get(layer)
            if hit is None:
                hit = hits[layer] = DepthHit(str(layer), as_int(step), ratio, str(layers[-1]))
            elif worse(ratio, hit.worst):
                hit.worst = ratio
            hit.steps += 1
    return hits
