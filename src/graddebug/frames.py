"""The documented DataFrames, built once from plain record tuples, and the one cell formatter
that every table (terminal, Markdown, HTML, assertion text) uses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from graddebug.records import (
    ALL_RANKS,
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
    "combine_ranks",
    "event_frame",
    "finding_frame",
    "format_cell",
    "record_frame",
    "summary_frame",
    "with_rank",
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


def _typed(rows: Sequence[tuple[object, ...]], fields: Sequence[str], columns: Sequence[str],
           dtypes: dict[str, str]) -> pd.DataFrame:
    """The frame of ``rows`` (tuples with ``fields``), keeping ``columns`` in their order."""
    # Column by column from one transpose: about 2x faster than from_records plus astype on
    # 100,000 rows, and each column has its schema dtype from the start.
    values = dict(zip(fields, zip(*rows, strict=True), strict=True)) if rows else {}
    data = {
        column: pd.Series(values.get(column, ()), dtype=object) if dtypes[column] == "object"
        else np.array(values.get(column, ()), dtype=dtypes[column])
        for column in columns
    }
    return pd.DataFrame(data, columns=list(columns))


_PRE_NORM = Record._fields.index("pre_norm")


def record_frame(records: Sequence[tuple[Any, ...]]) -> pd.DataFrame:
    """Return one row per (step, tensor), columns in contract order.

    ``records`` are :class:`~graddebug.records.Record` rows, or plain tuples in its field
    order. ``pre_norm`` (before ``rank``) is there only when at least one intervention acted.
    """
    has_pre = any(not math.isnan(r[_PRE_NORM]) for r in records)
    columns = Record._fields if has_pre else RECORD_COLUMNS
    return _typed(records, Record._fields, columns, RECORD_DTYPES)


def event_frame(events: Sequence[Event]) -> pd.DataFrame:
    """Return the structural events (no gradient, detached output, ...) as a DataFrame."""
    return _typed(events, EVENT_COLUMNS, EVENT_COLUMNS, EVENT_DTYPES)


def finding_frame(findings: Sequence[Finding]) -> pd.DataFrame:
    """Return the findings as a DataFrame ordered by step, severity and depth of discovery."""
    ranked = sorted(findings, key=lambda f: (f.step, -Severity.rank(f.severity)))
    return _typed(ranked, FINDING_COLUMNS, FINDING_COLUMNS, FINDING_DTYPES)


_KEYS = ["step", "layer", "tensor", "kind"]
_ONE_PER_RUN = (Kind.PARAMETER.value, Kind.LOSS.value)


def combine_ranks(records: pd.DataFrame) -> pd.DataFrame:
    """The rows of a multi-rank run combined into one global row per (step, tensor).

    Each rank's activation rows are its local slice of the global batch: the combined norm is
    the norm of their concatenation (the square root of the summed squares), ``numel`` and
    the mean are pooled, ``absmax`` is the largest, and ``nan``/``inf`` hold if they hold on
    any rank. A unit is dead only if it is dead on every rank, which the per-rank fractions
    cannot show exactly: ``zero_frac`` is the smallest of them, an upper bound. ``shape`` is
    the lowest rank's, and ``rank`` is the lowest rank whose gradient is not finite (where a
    NaN or Inf was born), else :data:`~graddebug.records.ALL_RANKS`.

    Parameter rows hold the global gradient on every rank (DDP averages it, and sharded
    gradients are measured whole), so one row is kept, with ``rank`` ALL_RANKS.

    How the loss reduction enters: each rank records the activation gradient of its own loss.
    With the usual loss, a mean over the local batch, which DDP's gradient averaging turns
    into the mean over the global batch, the gradient of that global loss at each rank's
    activations is the recorded one divided by the world size: the combined norm is then
    ``world_size`` times the activation norm of one process trained on the global batch.
    With a summed loss, or a loss already divided by the global batch size (Keras ``fit`` under
    a ``tf.distribute`` strategy, ``tf.nn.compute_average_loss``), the two are equal.

    A frame from one rank is returned unchanged. A torch run of several ranks records global
    rows already (:mod:`graddebug.adapter.ranks`), each once, with ``rank``
    :data:`~graddebug.records.ALL_RANKS` or, for a row that is not finite, the rank where it
    was born: pooling one row gives it back.
    """
    if records.empty or records["rank"].nunique() <= 1:
        return records
    # Op rows, like activation rows, hold each rank's own slice of the batch. Loss rows are
    # kept as parameter rows are: one, the lowest rank's.
    is_act = ~records["kind"].isin(_ONE_PER_RUN).to_numpy()
    act, par = records[is_act], records[~is_act]
    par = (par.sort_values("rank", kind="stable")
           .drop_duplicates(_KEYS).assign(rank=ALL_RANKS))
    out = _pool_slices(act)[list(records.columns)]
    combined = pd.concat([out, par], ignore_index=True)
    return combined.sort_values("step", kind="stable", ignore_index=True)


def _pool_slices(act: pd.DataFrame) -> pd.DataFrame:
    """Pool every rank's slice of the activation (and op) gradients into global rows.

    Args:
        act: The activation and op rows of every rank.

    Returns:
        One row per ``(step, layer, tensor, kind)``, its statistics combined as
        :func:`combine_ranks` describes, in the record dtypes; the columns are not yet in the
        frame's order.
    """
    norm = act["norm"].to_numpy(dtype=float)
    numel = act["numel"].to_numpy(dtype=float)
    broken = (act["nan"] | act["inf"]).to_numpy()
    parts = {
        "_sq": norm * norm, "_sum": act["mean"].to_numpy(dtype=float) * numel,
        "_birth": np.where(broken, act["rank"].to_numpy(), np.iinfo(np.int64).max),
    }
    # pandas' sums and maxima skip NaN; a NaN in any slice is a NaN of the whole.
    parts.update({f"{name}_nan": np.isnan(parts[name] if name != "absmax" else
                                          act["absmax"].to_numpy(dtype=float))
                  for name in ("_sq", "_sum", "absmax")})
    if "pre_norm" in act:
        pre = act["pre_norm"].to_numpy(dtype=float)
        parts["_pre"] = pre * pre
    grouped = act.assign(**parts).groupby(_KEYS, sort=False)
    agg = {"depth": ("depth", "min"), "shape": ("shape", "first"), "numel": ("numel", "sum"),
           "_sq": ("_sq", "sum"), "_sum": ("_sum", "sum"), "absmax": ("absmax", "max"),
           "zero_frac": ("zero_frac", "min"), "nan": ("nan", "any"), "inf": ("inf", "any"),
           "_birth": ("_birth", "min"), "weight_norm": ("weight_norm", "first"),
           "update_norm": ("update_norm", "first"), "clipped_norm": ("clipped_norm", "first"),
           **{f"{name}_nan": (f"{name}_nan", "any") for name in ("_sq", "_sum", "absmax")}}
    if "_pre" in parts:
        agg["_pre"] = ("_pre", "sum")
    out = grouped.agg(**agg).reset_index()
    for name in ("_sq", "_sum", "absmax"):
        out[name] = out[name].where(~out.pop(f"{name}_nan").to_numpy(), np.nan)
    size = out["numel"].to_numpy(dtype=float)
    squares = out.pop("_sq").to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(size > 0, out.pop("_sum").to_numpy() / size, np.nan)
        var = np.where(size > 0, squares / size - mean * mean, np.nan)
    out["norm"] = np.sqrt(squares)
    out["mean"] = mean
    out["std"] = np.sqrt(np.maximum(var, 0.0))
    birth = out.pop("_birth").to_numpy()
    out["rank"] = np.where(birth == np.iinfo(np.int64).max, ALL_RANKS, birth)
    if "_pre" in out:
        out["pre_norm"] = np.sqrt(out.pop("_pre").to_numpy())
    return out.astype({c: RECORD_DTYPES[c] for c in out.columns})


def summary_frame(records: pd.DataFrame, findings: pd.DataFrame) -> pd.DataFrame:
    """Aggregate the record frame over steps: one row per (layer, tensor) of a gradient (the
    loss rows are left out), in depth order.

    The rows of a multi-rank run are combined first (:func:`combine_ranks`): the summary is
    the global view.

    Args:
        records: A frame as returned by :func:`record_frame`.
        findings: A frame as returned by :func:`finding_frame`.

    Returns:
        A frame with :data:`SUMMARY_COLUMNS`; ``issues`` lists the distinct findings of the
        layer, comma-separated.
    """
    records = records[records["kind"] != Kind.LOSS.value] if "kind" in records else records
    if records.empty:
        return pd.DataFrame({c: pd.Series(dtype="object") for c in SUMMARY_COLUMNS})
    records = combine_ranks(records)
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


def with_rank(frame: pd.DataFrame, columns: Sequence[str]) -> list[str]:
    """The columns of a table of ``frame``: ``columns``, with ``rank`` after the first one when
    some row of ``frame`` comes from a rank other than 0 (a multi-rank run); in one process
    every rank is 0 and the table leaves it out. Likewise ``source`` (of findings) is shown
    only when some row has one, just before ``message``, which stays the last column, and
    ``cause`` only when some row has one, just after ``issue``."""
    shown = [c for c in columns if c not in ("rank", "source", "cause")]
    if "rank" in frame and len(frame) and bool((frame["rank"] != 0).any()):
        shown.insert(1, "rank")
    if "cause" in columns and _any_text(frame, "cause"):
        at = shown.index("issue") + 1 if "issue" in shown else len(shown)
        shown.insert(at, "cause")
    if _any_text(frame, "source"):
        at = shown.index("message") if "message" in shown else len(shown)
        shown.insert(at, "source")
    return shown


def _any_text(frame: pd.DataFrame, column: str) -> bool:
    return column in frame and len(frame) > 0 and bool((frame[column] != "").any())


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
