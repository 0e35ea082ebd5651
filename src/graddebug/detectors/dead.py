"""Dead units: features or channels whose gradient is zero for the whole batch."""

from __future__ import annotations

import pandas as pd

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding
from graddebug.hookspecs import hookimpl
from graddebug.records import Cause, Finding, Issue, Kind, Severity

_ALL = 0.99
"""A dead layer passes (nearly) no gradient down: the layers below it are all zero too."""


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Flag layers where most units got an all-zero gradient, in the median step.

    Steps with a NaN or Inf are left out: the gradients behind one are zeroed or poisoned,
    and the ``nonfinite`` finding names where it came from.
    """
    records = evidence.clean
    if records.empty:
        return []
    rows = records[(records["kind"] == Kind.ACTIVATION.value) & records["zero_frac"].notna()]
    gamma = thresholds.dead_fraction
    grouped = rows.groupby(["layer", "tensor"], sort=False, observed=True)
    stats = grouped.agg(frac=("zero_frac", "median"), steps=("step", "nunique"))
    dead = stats[stats["frac"] >= gamma]
    if dead.empty:
        return []
    above = rows[rows["zero_frac"] >= gamma]
    dead = dead.join(above.groupby(["layer", "tensor"], sort=False, observed=True)["step"].min())
    dead = dead.join(grouped["depth"].max())
    dead, victims = _without_victims(dead)
    return [
        finding(
            Issue.DEAD, Severity.WARNING, first, layer,
            (
                f"{frac:.0%} of the units of {layer!r} got an all-zero gradient over the "
                f"whole batch (median over {steps} steps): they are dead "
                f"and stop learning.{_below(victims.get((layer, tensor), 0))} Try a lower "
                "learning rate, LeakyReLU/GELU, He "
                "initialisation, or a normalisation layer before the activation."
            ),
            tensor=tensor, value=frac, threshold=gamma, cause=Cause.LAYER
        )
        for (layer, tensor), frac, steps, first in zip(
            dead.index, dead["frac"], dead["steps"], dead["step"], strict=True)
    ]


def _without_victims(dead: pd.DataFrame) -> tuple[pd.DataFrame, dict[tuple[str, str], int]]:
    """The dead layers without those whose gradient is all zero only because a deeper dead
    layer, dead since the same step or before, passes no gradient down to them.

    Returns:
        The layers to report, and for each the number of victims it stands for.
    """
    order = dead.sort_values("depth", ascending=False)
    fracs = dict(zip(order.index, order["frac"].astype(float), strict=True))
    firsts = dict(zip(order.index, order["step"].astype(int), strict=True))
    kept: list[tuple[str, str]] = []
    victims: dict[tuple[str, str], int] = {}
    for key, frac, step in zip(order.index, order["frac"], order["step"], strict=True):
        cover = next((k for k in kept if fracs[k] >= _ALL and firsts[k] <= step), None)
        if cover is not None and frac >= _ALL:
            victims[cover] = victims.get(cover, 0) + 1
            continue
        kept.append(key)
    return dead.loc[kept], victims


def _below(count: int) -> str:
    return (f" The gradient of {count} layer(s) below it is all zero because of it."
            if count else "")
