"""The HTML report: one self-contained page (figures inlined as base64 PNG, no scripts, no
external resources) with the findings, the gradient-flow plot, the heatmap and the metadata.

Every string that comes from the run (layer names, messages, metadata) is HTML-escaped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from html import escape
from typing import TYPE_CHECKING, Any, Protocol

import pandas as pd

from graddebug.frames import format_cell, with_rank
from graddebug.records import FINDING_COLUMNS, Severity
from graddebug.report.digest import ISSUE_COLUMNS, WORST_COLUMNS, issue_table, worst_layers
from graddebug.report.plots import figure_png, flow_figure, heatmap_figure

if TYPE_CHECKING:
    from graddebug.config import Thresholds

__all__ = ["MAX_TABLE_ROWS", "ReportView", "render_html"]


class ReportView(Protocol):
    """What the page reads of a run; :class:`graddebug.Report` is one.

    This module does not import the Report: ``Report.to_html`` imports this module, and the
    import graph has no cycle, not even through type-checking imports.
    """

    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def thresholds(self) -> Thresholds: ...

    def frame(self) -> pd.DataFrame: ...

    def findings(self) -> pd.DataFrame: ...

    def summary(self) -> pd.DataFrame: ...

MAX_TABLE_ROWS = 1000
"""The findings and summary tables show at most this many rows (the page says how many)."""

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto;
       max-width: 1180px; color: #1d1d1f; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px;
     border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.banner { padding: 8px 12px; border-radius: 6px; margin: 12px 0; }
.bad { background: #fdecea; border: 1px solid #f5c2bd; }
.warn { background: #fff4e5; border: 1px solid #ffd8a8; }
.good { background: #e8f5e9; border: 1px solid #b7dfb9; }
table { border-collapse: collapse; margin: 8px 0; font-size: 12.5px; }
th, td { border: 1px solid #ddd; padding: 3px 7px; vertical-align: top; text-align: left; }
th { background: #f3f4f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.error td { background: #fff5f5; } tr.warning td { background: #fffaf0; }
.scroll { overflow-x: auto; max-width: 100%; }
img { max-width: 100%; border: 1px solid #eee; } .note { color: #666; font-size: 12px; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
pre { white-space: pre-wrap; margin: 0; }
"""


def _cell(value: object) -> tuple[str, bool]:
    """The escaped text of a cell, and whether it is a number (right-aligned)."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return escape(format_cell(value)), numeric


def _table(frame: pd.DataFrame, columns: Sequence[str], caption: str = "",
           limit: int = MAX_TABLE_ROWS) -> str:
    if frame.empty:
        return f"<p>{escape(caption)}: none.</p>" if caption else "<p>none.</p>"
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = []
    severities = frame.get("severity")
    for i, row in enumerate(frame[list(columns)].head(limit).itertuples(index=False)):
        cells = []
        for value in row:
            text, numeric = _cell(value)
            cells.append(f'<td class="num">{text}</td>' if numeric else f"<td>{text}</td>")
        css = f' class="{escape(str(severities.iloc[i]))}"' if severities is not None else ""
        body.append(f"<tr{css}>{''.join(cells)}</tr>")
    more = (f'<p class="note">showing {limit} of {len(frame)} rows; the CSV/JSON output of '
            "<code>graddebug report</code> has them all.</p>") if len(frame) > limit else ""
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>{more}")


def _metadata_table(metadata: Mapping[str, Any]) -> str:
    rows = []
    for key, value in metadata.items():
        text = value if isinstance(value, str) else json.dumps(value, indent=1, default=str)
        rows.append(f"<tr><th>{escape(str(key))}</th><td><pre>{escape(text)}</pre></td></tr>")
    return f"<table>{''.join(rows)}</table>" if rows else "<p>none.</p>"


def _banner(report: ReportView) -> str:
    findings = report.findings()
    run = report.metadata.get("run", {})
    parts = []
    if isinstance(run, Mapping) and run.get("status") == "incomplete":
        parts.append(
            '<div class="banner warn">This run did not finish: graddebug recovered '
            f"{escape(str(run.get('steps')))} recorded steps, up to step "
            f"{escape(str(run.get('last_step')))} (what was flushed before the process "
            "stopped). Findings were diagnosed again from them.</div>")
    errors = int((findings["severity"] == Severity.ERROR.value).sum())
    warnings = int((findings["severity"] == Severity.WARNING.value).sum())
    if errors:
        css, text = "bad", f"{errors} error finding(s), {warnings} warning(s)"
    elif warnings:
        css, text = "warn", f"no error finding, {warnings} warning(s)"
    else:
        css, text = "good", "no finding: the gradients look healthy"
    parts.append(f'<div class="banner {css}"><b>{escape(text)}</b></div>')
    return "".join(parts)


def _page_name(metadata: Mapping[str, Any], title: str | None) -> str:
    """The page's title.

    Args:
        metadata: The run's metadata.
        title: The title the caller asked for, if any.

    Returns:
        ``title``, else the run's path, else the model class, else ``"graddebug run"``.
    """
    run = metadata.get("run", {}) if isinstance(metadata.get("run"), Mapping) else {}
    return title or str(run.get("path") or metadata.get("model") or "graddebug run")


def _facts(metadata: Mapping[str, Any], records: pd.DataFrame, summary: pd.DataFrame,
           findings: pd.DataFrame) -> str:
    """The line under the page's title: steps, tensors, findings, framework and model.

    Args:
        metadata: The run's metadata.
        records: The record frame.
        summary: The per-layer summary (one row per tensor).
        findings: The findings frame.

    Returns:
        The line, not yet HTML-escaped.
    """
    framework = " ".join(str(metadata[k]) for k in ("framework", "framework_version")
                         if metadata.get(k))
    return (f"{records['step'].nunique()} recorded steps, {len(summary)} tensors, "
            f"{len(findings)} findings; framework {framework or '?'}, "
            f"model {metadata.get('model') or '?'}")


def render_html(report: ReportView, *, title: str | None = None,
                progress: Callable[[str], None] | None = None) -> str:
    """Build the self-contained HTML page of a run.

    Args:
        report: The run.
        title: The page title; by default the run's path or model class.
        progress: Called with the name of each stage as it starts (for a progress bar).

    Returns:
        The page, as a string.

    Raises:
        MissingFrameworkError: matplotlib is missing (``pip install graddebug[report]``).
    """
    def stage(name: str) -> None:
        if progress is not None:
            progress(name)

    records, findings, summary = report.frame(), report.findings(), report.summary()
    meta = report.metadata
    name = _page_name(meta, title)
    stage("gradient flow plot")
    flow = figure_png(flow_figure(records, findings))
    stage("heatmap")
    heat = figure_png(heatmap_figure(records, findings))
    stage("tables")
    body = [
        f"<h1>graddebug report: {escape(name)}</h1>",
        f'<p class="note">{escape(_facts(meta, records, summary, findings))}</p>',
        _banner(report),
        "<h2>Findings by issue</h2>",
        _table(issue_table(findings), ISSUE_COLUMNS, "findings"),
        "<h2>Gradient flow</h2>",
        f'<img alt="gradient flow by depth" src="data:image/png;base64,{flow}">',
        "<h2>Gradient norms over steps</h2>",
        f'<img alt="heatmap of log10 gradient norm, steps by tensors" '
        f'src="data:image/png;base64,{heat}">',
        "<h2>Worst layers</h2>",
        _table(worst_layers(summary, findings), WORST_COLUMNS, "layers"),
        "<h2>All findings</h2>",
        _table(findings, with_rank(findings, FINDING_COLUMNS), "findings"),
        "<h2>Per-layer summary</h2>",
        _table(summary, list(summary.columns), "layers"),
        "<h2>Metadata</h2>",
        _metadata_table(meta),
        "<h2>Thresholds</h2>",
        _metadata_table(report.thresholds.as_dict()),
    ]
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>graddebug report: {escape(name)}</title><style>{_STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
