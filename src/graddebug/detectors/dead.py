"""Dead units: features or channels whose gradient is zero for the whole batch."""

from __future__ import annotations

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding
from graddebug.hookspecs import hookimpl
from graddebug.records import Finding, Issue, Kind, Severity


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Flag layers where most units got an all-zero gradient, in the median step."""
    records = evidence.records
    if records.empty:
        return []
    rows = records[(records["kind"] == Kind.ACTIVATION.value) & records["zero_frac"].notna()]
    gamma = thresholds.dead_fraction
    out = []
    for (layer, tensor), group in rows.groupby(["layer", "tensor"], sort=False):
        median = float(group["zero_frac"].median())
        if median < gamma:
            continue
        first = int(group.loc[group["zero_frac"] >= gamma, "step"].min())
        out.append(
            finding(
                Issue.DEAD, Severity.WARNING, first, layer,
                (
                    f"{median:.0%} of the units of {layer!r} got an all-zero gradient over the "
                    f"whole batch (median over {group['step'].nunique()} steps): they are dead "
                    "and stop learning. Try a lower learning rate, LeakyReLU/GELU, He "
                    "initialisation, or a normalisation layer before the activation."
                ),
                tensor=tensor, value=median, threshold=gamma,
            )
        )
    return out
