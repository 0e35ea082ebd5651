"""The documented DataFrames, built once from plain record tuples, and the one cell formatter
that every table (terminal, Markdown, HTML, assertion text) uses."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from graddebug.records import (
    EVENT_COLUMNS,
    EVENT_DTYPES,
    FINDING_COLUMNS,
    FINDING_DTYPES,
    RECORD_COLUMNS,
    RECORD_DTYPES,
    Event,
    Finding,
    Kind,
    Record,
    Severity,
)

__all__ = [
    "SUMMARY_COLUMNS",
    "event_frame",
    "finding_frame",
    "format_cell",
    "record_frame",
    "summary_frame",
]

SUMMARY_COLUMNS: tuple[str, ...] = (
    "layer",
    "tensor",
    "kind",
    "depth",
    "steps",
    "norm_median",
    "norm_min",
    "norm_max",
    "norm_last",
    "absmax_max",
    "zero_frac_median",
    "nonfinite_steps",
    "issues",
)


def _typed(rows: Sequence[tuple[object, ...]], columns: Sequence[str],
           dtypes: dict[str, str]) -> pd.DataFrame:
    # Column by column from one transpose: about 2x faster than from_records plus astype on
    # 100,000 rows, and each column has its schema dtype from the start.
    values = list(zip(*rows, strict=True)) if rows else [()] * len(columns)
    data = {
        column: pd.Series(col, dtype=object) if dtypes[column] == "object"
        else np.array(col, dtype=dtypes[column])
        for column, col in zip(columns, values, strict=False)
    }
    return pd.DataFrame(data, columns=list(columns))


def record_frame(records: Sequence[Record]) -> pd.DataFrame:
    """Return one row per (step, tensor), columns in contract order.

    ``pre_norm`` is appended only when at least one intervention acted.
    """
    has_pre = any(not math.isnan(r.pre_norm) for r in records)
    columns = (*RECORD_COLUMNS, "pre_norm") if has_pre else RECORD_COLUMNS
    return _typed(records, columns, RECORD_DTYPES)  # a missing pre_norm column drops it


def event_frame(events: Sequence[Event]) -> pd.DataFrame:
    """Return the structural events (no gradient, detached output, ...) as a DataFrame."""
    return _typed(events, EVENT_COLUMNS, EVENT_DTYPES)


def finding_frame(findings: Sequence[Finding]) -> pd.DataFrame:
    """Return the findings as a DataFrame ordered by step, severity and depth of discovery."""
    ranked = sorted(findings, key=lambda f: (f.step, -Severity.rank(f.severity)))
    return _typed(ranked, FINDING_COLUMNS, FINDING_DTYPES)


def summary_frame(records: pd.DataFrame, findings: pd.DataFrame) -> pd.DataFrame:
    """Aggregate the record frame over steps: one row per (layer, tensor), in depth order.

    Args:
        records: A frame as returned by :func:`record_frame`.
        findings: A frame as returned by :func:`finding_frame`.

    Returns:
        A frame with :data:`SUMMARY_COLUMNS`; ``issues`` lists the distinct findings of the
        layer, comma-separated.
    """
    if records.empty:
        return pd.DataFrame({c: pd.Series(dtype="object") for c in SUMMARY_COLUMNS})
    keys = ["layer", "tensor", "kind"]
    nonfinite = records["nan"] | records["inf"]
    grouped = records.assign(_nonfinite=nonfinite).groupby(keys, sort=False)
    out = grouped.agg(
        depth=("depth", "first"),
        steps=("step", "nunique"),
        norm_median=("norm", "median"),
        norm_min=("norm", "min"),
        norm_max=("norm", "max"),
        norm_last=("norm", "last"),
        absmax_max=("absmax", "max"),
        zero_frac_median=("zero_frac", "median"),
        nonfinite_steps=("_nonfinite", "sum"),
    ).reset_index()
    issues: dict[str, list[str]] = {}
    for layer, issue in zip(findings["layer"], findings["issue"], strict=True):
        bucket = issues.setdefault(layer, [])
        if issue not in bucket:
            bucket.append(issue)
    out["issues"] = [", ".join(issues.get(layer, ())) for layer in out["layer"]]
    out["nonfinite_steps"] = out["nonfinite_steps"].astype("int64")
    kind_rank = np.where(out["kind"] == Kind.ACTIVATION.value, 0, 1)
    out = out.assign(_rank=kind_rank).sort_values(["depth", "_rank", "tensor"], kind="stable")
    return out.drop(columns="_rank").reset_index(drop=True)[list(SUMMARY_COLUMNS)]


def format_cell(value: object) -> str:
    """A frame value as table text: ``-`` for NaN, 4 significant digits for ordinary floats,
    scientific notation for tiny and huge ones; other values as ``str``."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0 or 1e-3 <= abs(value) < 1e4:
            return f"{value:.4g}"
        return f"{value:.2e}"
    return str(value)
