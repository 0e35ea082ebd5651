"""Figures of a run: gradient flow by depth, and a steps x tensors heatmap of log10 norms.

Figures are built as ``matplotlib.figure.Figure`` objects directly, without pyplot, so that
nothing here changes the user's backend or opens a window. Rendering to PNG uses Agg.
"""

from __future__ import annotations

import base64
import io
import unicodedata
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from graddebug.errors import MissingFrameworkError
from graddebug.records import Kind, Severity
from graddebug.report.fonts import fallback_families, quiet_render

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["MAX_HEATMAP_STEPS", "USER_TEXT", "figure_png", "flow_figure", "heatmap_figure"]

USER_TEXT: dict[str, Any] = {"parse_math": False, "usetex": False}
"""Text properties of every label drawn from a user string (layer, tensor and tap names):
``$`` would start mathtext (``"cost$x"`` raises ``ValueError`` when drawn), and under
``rcParams["text.usetex"]`` the name would be fed to LaTeX. Names are drawn as they are, in a
font that has their glyphs where one is installed (:mod:`graddebug.report.fonts`)."""

MAX_HEATMAP_STEPS = 800
"""Above this many recorded steps, the heatmap averages log10 norms over bins of steps."""

MAX_LABEL_CHARS = 60
"""Tick labels longer than this are shortened in the middle (``"encoder.lay…attn.proj"``): a
300-character name left no room for the axes, and constrained layout gave up on the figure.
The tables of the report keep every name whole."""

_SEVERITY_STYLE: dict[str, tuple[str, str]] = {
    Severity.ERROR.value: ("X", "#d62728"),
    Severity.WARNING.value: ("v", "#ff7f0e"),
    Severity.INFO.value: ("o", "#1f77b4"),
}


def require_matplotlib() -> ModuleType:
    """Import matplotlib on first use.

    Raises:
        MissingFrameworkError: matplotlib is not installed.
    """
    try:
        import matplotlib
        import matplotlib.figure
    except ImportError as exc:
        raise MissingFrameworkError(
            f"graddebug's plots and HTML report need matplotlib ({exc}); "
            "install it with: pip install graddebug[report]"
        ) from exc
    return matplotlib


def _gradients(records: pd.DataFrame) -> pd.DataFrame:
    """The gradient rows of a record frame: the loss rows are no gradient."""
    if "kind" not in records:
        return records
    return records[records["kind"] != Kind.LOSS.value]


def _rows(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (layer, tensor, kind) in the summary's order: depth, activations first."""
    keys = records[["layer", "tensor", "kind", "depth"]].drop_duplicates(["layer", "tensor",
                                                                          "kind"])
    rank = np.where(keys["kind"] == Kind.ACTIVATION.value, 0, 1)
    keys = keys.assign(_rank=rank).sort_values(["depth", "_rank", "tensor"], kind="stable")
    return keys.drop(columns="_rank").reset_index(drop=True)


def _label(layer: str, tensor: str, kind: str) -> str:
    """A tensor's tick label: its layer (and tensor), shortened past :data:`MAX_LABEL_CHARS`."""
    label = layer if kind == Kind.ACTIVATION.value and tensor == "output" else f"{layer}.{tensor}"
    if len(label) <= MAX_LABEL_CHARS:
        return label
    head = (MAX_LABEL_CHARS - 1) // 2
    return f"{label[:head]}\u2026{label[len(label) - (MAX_LABEL_CHARS - 1 - head):]}"


def _label_inches(labels: list[str], fontsize: float) -> float:
    """About how long the longest of ``labels`` is when drawn, in inches: a wide East Asian
    character takes 1 em, any other about 0.62 em (DejaVu Sans averages 0.55 over ASCII names)."""
    ems = max((sum(1.0 if unicodedata.east_asian_width(c) in "WF" else 0.62 for c in label)
               for label in labels), default=0.0)
    return ems * fontsize / 72.0


def _user_text(labels: list[str]) -> dict[str, Any]:
    """The text properties of tick labels drawn from ``labels``: :data:`USER_TEXT`, and a font
    list that has their glyphs where the user's font lacks some (see
    :mod:`graddebug.report.fonts`; set on the labels, not in ``rcParams``)."""
    family = fallback_families(labels)
    return USER_TEXT if family is None else {**USER_TEXT, "fontfamily": family}


def flow_figure(records: pd.DataFrame, findings: pd.DataFrame) -> Figure:
    """Gradient flow: the median gradient norm of each tensor by depth, with its min-max range
    over steps, activations and parameters as two series; flagged layers in red.

    Args:
        records: A record frame.
        findings: The findings frame (their layers are drawn in red).

    Returns:
        A matplotlib Figure.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    records = _gradients(records)
    rows = _rows(records)
    finite = records[np.isfinite(records["norm"]) & (records["norm"] > 0)]
    stats = finite.groupby(["layer", "tensor", "kind"], sort=False)["norm"].agg(
        ["median", "min", "max"])
    labels = [_label(*k) for k in zip(rows["layer"], rows["tensor"], rows["kind"], strict=True)]
    fontsize = 7 if len(rows) > 30 else 8
    width = min(max(6.0, 0.28 * len(rows) + 2.0), 24.0)
    # The labels stand upright under the axes: the figure grows with the longest one.
    height = min(max(4.8, 2.4 + _label_inches(labels, fontsize)), 12.0)
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(rows))
    for kind, color in ((Kind.ACTIVATION.value, "#1f77b4"), (Kind.PARAMETER.value, "#2ca02c")):
        sel = (rows["kind"] == kind).to_numpy()
        if not sel.any():
            continue
        keys = list(zip(rows["layer"][sel], rows["tensor"][sel], rows["kind"][sel],
                        strict=True))
        got = stats.reindex(pd.MultiIndex.from_tuples(keys, names=stats.index.names))
        ax.fill_between(x[sel], got["min"], got["max"], color=color, alpha=0.2, step=None,
                        linewidth=0)
        ax.plot(x[sel], got["median"], "o-", color=color, markersize=3, linewidth=1.2,
                label=f"{kind} gradients (median, min-max over steps)")
    _mark_nonfinite(ax, records, rows)
    if finite.empty:  # a log axis has no room for norms that are all 0 (or NaN)
        ax.text(0.5, 0.5, "no gradient norm above 0 was recorded", transform=ax.transAxes,
                ha="center", va="center")
        ax.set_yticks([])
    else:
        ax.set_yscale("log")
    ax.set_xlim(-0.5, max(len(rows) - 0.5, 0.5))
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=90, fontsize=fontsize, **_user_text(labels))
    flagged = set(findings["layer"])
    for tick, layer in zip(ax.get_xticklabels(), rows["layer"], strict=True):
        if layer in flagged:
            tick.set_color("#d62728")
    ax.set_xlabel("tensor, in forward order (red: layers with findings)")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Gradient flow by depth")
    ax.grid(True, which="major", axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    return fig


def _mark_nonfinite(ax: Any, records: pd.DataFrame, rows: pd.DataFrame) -> None:
    """A red cross above each tensor of the flow plot whose gradient was NaN/Inf at some step."""
    bad = records.loc[~np.isfinite(records["norm"]), ["layer", "tensor", "kind"]]
    if bad.empty:
        return
    index = {key: i for i, key in enumerate(zip(rows["layer"], rows["tensor"], rows["kind"],
                                                strict=True))}
    hits = sorted({index[k] for k in bad.itertuples(index=False, name=None) if k in index})
    ax.plot(hits, [1.0] * len(hits), "X", color="#d62728", markersize=8,
            transform=ax.get_xaxis_transform(), clip_on=False, label="NaN/Inf at some step")


def _heat_matrix(records: pd.DataFrame, rows: pd.DataFrame, max_steps: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    steps = np.sort(records["step"].unique())
    per_bin = max(1, int(np.ceil(len(steps) / max_steps)))
    col_of_step = {int(s): i // per_bin for i, s in enumerate(steps)}
    n_cols = (len(steps) + per_bin - 1) // per_bin
    row_of = {k: i for i, k in enumerate(zip(rows["layer"], rows["tensor"], rows["kind"],
                                             strict=True))}
    keys = pd.MultiIndex.from_frame(records[["layer", "tensor", "kind"]])
    r = np.asarray(pd.Index(list(row_of)).get_indexer(keys))
    c = records["step"].map(col_of_step).to_numpy()
    norm = records["norm"].to_numpy(dtype="float64")
    bad = ~np.isfinite(norm)
    with np.errstate(divide="ignore", invalid="ignore"):
        log = np.log10(norm)
    ok = ~bad & np.isfinite(log) & (r >= 0)
    total = np.zeros((len(rows), n_cols))
    count = np.zeros((len(rows), n_cols))
    np.add.at(total, (r[ok], c[ok]), log[ok])
    np.add.at(count, (r[ok], c[ok]), 1)
    with np.errstate(invalid="ignore"):
        matrix = total / count
    nonfinite = np.zeros((len(rows), n_cols), dtype=bool)
    nonfinite[r[bad & (r >= 0)], c[bad & (r >= 0)]] = True
    edges = steps[::per_bin]
    return matrix, nonfinite, edges, per_bin


def heatmap_figure(records: pd.DataFrame, findings: pd.DataFrame,
                   max_steps: int = MAX_HEATMAP_STEPS) -> Figure:
    """Heatmap of log10 gradient norms, tensors (rows, forward order) by steps (columns), with
    each finding marked where it was first seen and non-finite gradients in red.

    Args:
        records: A record frame.
        findings: The findings frame.
        max_steps: Columns at most; more steps are averaged in bins (of log10 norm).

    Returns:
        A matplotlib Figure.
    """
    require_matplotlib()
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    records = _gradients(records)
    rows = _rows(records)
    height = min(max(3.5, 0.2 * len(rows) + 1.8), 30.0)
    fig = Figure(figsize=(11.0, height), layout="constrained")
    ax = fig.add_subplot()
    if rows.empty:
        ax.text(0.5, 0.5, "no gradients were recorded", ha="center", va="center")
        ax.set_axis_off()
        return fig
    matrix, nonfinite, edges, per_bin = _heat_matrix(records, rows, max_steps)
    n_cols = matrix.shape[1]
    extent = (-0.5, n_cols - 0.5, len(rows) - 0.5, -0.5)
    image = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", interpolation="nearest",
                      cmap="viridis", extent=extent)
    if nonfinite.any():
        ax.imshow(np.ma.masked_equal(nonfinite.astype(float), 0), aspect="auto",
                  interpolation="nearest", cmap=ListedColormap(["#d62728"]), extent=extent)
    fig.colorbar(image, ax=ax, label="log10 gradient norm", pad=0.01)
    labels = [_label(*k) for k in zip(rows["layer"], rows["tensor"], rows["kind"], strict=True)]
    every = max(1, len(labels) // 60)
    ax.set_yticks(np.arange(0, len(labels), every))
    ax.set_yticklabels(labels[::every], fontsize=7 if len(labels) > 30 else 8,
                       **_user_text(labels[::every]))
    ticks = np.arange(0, n_cols, max(1, int(np.ceil(n_cols / 10))))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(int(edges[t])) for t in ticks])
    binned = f" (columns average {per_bin} steps)" if per_bin > 1 else ""
    ax.set_xlabel(f"step{binned}")
    ax.set_title("log10 gradient norm per step; markers: findings at their first step, "
                 "red cells: NaN/Inf", fontsize=10)
    _mark_findings(ax, findings, rows, edges)
    return fig


def _mark_findings(ax: Any, findings: pd.DataFrame, rows: pd.DataFrame, edges: np.ndarray
                   ) -> None:
    first_row: dict[str, int] = {}
    exact: dict[tuple[str, str], int] = {}
    for i, (layer, tensor) in enumerate(zip(rows["layer"], rows["tensor"], strict=True)):
        first_row.setdefault(layer, i)
        exact.setdefault((layer, tensor), i)
    seen: set[str] = set()
    lined = False
    for severity, (marker, color) in _SEVERITY_STYLE.items():
        part = findings[findings["severity"] == severity]
        xs, ys = [], []
        for step, layer, tensor in zip(part["step"], part["layer"], part["tensor"],
                                       strict=True):
            column = max(int(np.searchsorted(edges, step, side="right")) - 1, 0)
            row = exact.get((layer, tensor), first_row.get(layer))
            if row is None:  # an event of no single layer (the optimizer, the loss)
                ax.axvline(column, color=color, linestyle="--", linewidth=1.2, zorder=2,
                           label=None if lined else "event of no single layer")
                lined = True
                continue
            xs.append(column)
            ys.append(row)
        if xs:
            label = f"{severity} finding" if severity not in seen else None
            seen.add(severity)
            ax.scatter(xs, ys, marker=marker, s=60, c=color, edgecolors="white",
                       linewidths=0.8, label=label, zorder=3)
    if seen or lined:
        ax.legend(loc="upper right", fontsize=8, framealpha=0.8)


def figure_png(fig: Figure, dpi: int = 100) -> str:
    """Render a figure to PNG with Agg and return it base64-encoded, for a data: URI.

    matplotlib's warnings about glyphs that no installed font has (drawn as boxes) and about a
    layout with no room for the axes are kept quiet here (see
    :data:`graddebug.report.fonts.QUIET_WARNINGS`); any other warning goes through.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    with quiet_render():  # a glyph no installed font has, a layout with no room: not errors
        fig.savefig(buffer, format="png", dpi=dpi)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
