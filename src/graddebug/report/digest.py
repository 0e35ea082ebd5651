"""Short digests of a run for people in a hurry: the worst layers, the findings by issue, and
per-layer norm ratios between two runs. The CLI and the HTML page both show these."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from graddebug.records import Kind, Severity

__all__ = [
    "COMPARE_COLUMNS",
    "ISSUE_COLUMNS",
    "WORST_COLUMNS",
    "compare_runs",
    "issue_table",
    "worst_layers",
]

ISSUE_COLUMNS: tuple[str, ...] = (
    "issue", "severity", "count", "layers", "first_step", "first_layer", "message",
)
"""Columns of :func:`issue_table`."""

WORST_COLUMNS: tuple[str, ...] = (
    "layer", "tensor", "kind", "depth", "steps", "norm_median", "norm_min", "norm_max",
    "nonfinite_steps", "issues",
)
"""Columns of :func:`worst_layers` shown by the CLI."""


def issue_table(findings: pd.DataFrame) -> pd.DataFrame:
    """Group findings by issue: how many, on how many layers, and where it showed first.

    Args:
        findings: A findings frame.

    Returns:
        One row per issue, worst severity first, then by first step. ``severity`` is the worst
        severity of the issue's findings; ``first_layer`` and ``message`` are those of its
        earliest finding (the most severe one at that step).
    """
    rows = []
    for issue, group in findings.groupby("issue", sort=False):
        ranks = group["severity"].map(Severity.rank)
        ordered = group.assign(_rank=-ranks).sort_values(["step", "_rank"], kind="stable")
        first = ordered.iloc[0]
        rows.append((
            str(issue),
            str(group["severity"].iloc[int(np.argmax(ranks.to_numpy()))]),
            len(group),
            group["layer"].nunique(),
            int(first["step"]),
            str(first["layer"]),
            str(first["message"]),
        ))
    table = pd.DataFrame(rows, columns=list(ISSUE_COLUMNS)).astype(
        {"issue": object, "severity": object, "count": "int64", "layers": "int64",
         "first_step": "int64", "first_layer": object, "message": object})
    rank = table["severity"].map(Severity.rank)
    order = table.assign(_rank=-rank).sort_values(["_rank", "first_step"], kind="stable")
    return order.drop(columns="_rank").reset_index(drop=True)


def _layer_severity(findings: pd.DataFrame) -> dict[str, int]:
    worst: dict[str, int] = {}
    for layer, severity in zip(findings["layer"], findings["severity"], strict=True):
        worst[layer] = max(worst.get(layer, 0), Severity.rank(severity))
    return worst


def worst_layers(summary: pd.DataFrame, findings: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """Rank the tensors of a run from most to least suspicious.

    The order: the worst severity of a finding on the layer, then the number of steps with a
    non-finite gradient, then how far the median norm lies from the run's typical median norm
    (in decades, on a log scale). A healthy layer therefore ranks by how unusual its norm is.

    Args:
        summary: The per-layer summary (``Report.summary()``).
        findings: The findings frame.
        n: How many rows to return.

    Returns:
        The first ``n`` rows of ``summary``, most suspicious first, with a ``decades`` column
        (distance of the median norm from the typical one, in powers of ten).
    """
    if summary.empty:
        return summary.assign(decades=pd.Series(dtype="float64"))
    severity = _layer_severity(findings)
    with np.errstate(divide="ignore", invalid="ignore"):
        log = np.log10(summary["norm_median"].astype("float64").to_numpy())
    finite = log[np.isfinite(log)]
    typical = float(np.median(finite)) if finite.size else 0.0
    decades = np.where(np.isfinite(log), np.abs(log - typical), math.inf)
    ranked = summary.assign(
        decades=decades,
        _sev=[severity.get(layer, 0) for layer in summary["layer"]],
    ).sort_values(["_sev", "nonfinite_steps", "decades"], ascending=False, kind="stable")
    return ranked.drop(columns="_sev").head(n).reset_index(drop=True)


COMPARE_COLUMNS: tuple[str, ...] = (
    "layer", "tensor", "kind", "depth", "norm_a", "norm_b", "ratio", "issues_a", "issues_b",
)


def compare_runs(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Per-layer median gradient norms of two runs, and their ratio B / A.

    Args:
        a: The summary of run A (``Report.summary()``), e.g. before a fix.
        b: The summary of run B, e.g. after it.

    Returns:
        One row per (layer, tensor, kind) found in either run, in depth order (A's depth
        where the layer is in A). ``ratio`` is NaN where a layer is missing from one run or A's
        norm is 0.
    """
    keys = ["layer", "tensor", "kind"]
    left = a[[*keys, "depth", "norm_median", "issues"]].rename(
        columns={"norm_median": "norm_a", "issues": "issues_a", "depth": "depth_a"})
    right = b[[*keys, "depth", "norm_median", "issues"]].rename(
        columns={"norm_median": "norm_b", "issues": "issues_b", "depth": "depth_b"})
    both = left.merge(right, on=keys, how="outer", sort=False)
    both["depth"] = both["depth_a"].fillna(both["depth_b"]).astype("int64")
    norm_a = both["norm_a"].astype("float64")
    norm_b = both["norm_b"].astype("float64")
    with np.errstate(divide="ignore", invalid="ignore"):
        both["ratio"] = np.where(norm_a > 0, norm_b / norm_a, math.nan)
    both["norm_a"], both["norm_b"] = norm_a, norm_b
    for col in ("issues_a", "issues_b"):
        both[col] = both[col].astype(object).where(both[col].notna(), "")
    kind_rank = np.where(both["kind"] == Kind.ACTIVATION.value, 0, 1)
    both = both.assign(_rank=kind_rank).sort_values(["depth", "_rank", "tensor"], kind="stable")
    return both[list(COMPARE_COLUMNS)].reset_index(drop=True)
