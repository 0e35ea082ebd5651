"""Dead units: features or channels whose gradient is zero for the whole batch."""

from __future__ import annotations

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding
from graddebug.hookspecs import hookimpl
from graddebug.records import Cause, Finding, Issue, Kind, Severity


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
    return [
        finding(
            Issue.DEAD, Severity.WARNING, first, layer,
            (
                f"{frac:.0%} of the units of {layer!r} got an all-zero gradient over the "
                f"whole batch (median over {steps} steps): they are dead "
                "and stop learning. Try a lower learning rate, LeakyReLU/GELU, He "
                "initialisation, or a normalisation layer before the activation."
            ),
            tensor=tensor, value=frac, threshold=gamma, cause=Cause.LAYER
        )
        for (layer, tensor), frac, steps, first in zip(
            dead.index, dead["frac"], dead["steps"], dead["step"], strict=True)
    ]
