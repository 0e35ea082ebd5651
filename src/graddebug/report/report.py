"""Report: the frames of one run, live or loaded from disk, and what derives from them."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from graddebug.config import Thresholds
from graddebug.diagnosis import diagnose
from graddebug.errors import RunFileError
from graddebug.frames import summary_frame
from graddebug.records import Finding, Issue

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["NOTEBOOK_FINDINGS", "Report", "notebook_html"]


NOTEBOOK_FINDINGS = 20
"""The notebook view lists at most this many findings (``findings()`` has them all)."""


def notebook_html(records: pd.DataFrame, findings: pd.DataFrame) -> str:
    """The HTML fragment a notebook shows for a run: verdict, findings, a small flow plot.

    Args:
        records: The record frame.
        findings: The findings frame.

    Returns:
        An HTML fragment (no scripts, no external resources), every run string escaped.
    """
    from graddebug.errors import MissingFrameworkError
    from graddebug.frames import with_rank
    from graddebug.records import FINDING_COLUMNS, Severity
    from graddebug.report.html import _table

    steps = records["step"].nunique() if not records.empty else 0
    errors = int((findings["severity"] == Severity.ERROR.value).sum())
    tensors = len(records[["layer", "tensor", "kind"]].drop_duplicates())
    verdict = (f"{errors} error finding(s), {len(findings)} in all" if len(findings)
               else "no finding: the gradients look healthy")
    parts = [f"<div><b>graddebug</b>: {steps} recorded step(s), {tensors} tensor(s); "
             f"{escape(verdict)}.</div>"]
    if not findings.empty:
        parts.append(_table(findings, with_rank(findings, FINDING_COLUMNS), "findings",
                            limit=NOTEBOOK_FINDINGS))
    if steps:
        try:
            from graddebug.report.plots import figure_png, flow_figure

            png = figure_png(flow_figure(records, findings), dpi=72)
            parts.append(f'<img alt="gradient flow by depth" style="max-width:100%" '
                         f'src="data:image/png;base64,{png}">')
        except MissingFrameworkError:
            parts.append("<p>(the flow plot needs matplotlib: "
                         "pip install graddebug[report])</p>")
    return f'<div class="graddebug">{"".join(parts)}</div>'


class Report:
    """The frames of one recorded run: what ``Watcher.report()``, ``graddebug.check()`` and
    ``graddebug.load()`` return.

    A Report holds finished frames only, no tensors, so it outlives the model and the process
    that recorded it.

    Args:
        records: The record frame.
        events: The structural events.
        findings: The findings as the run diagnosed them, with its thresholds.
        thresholds: The thresholds the findings were computed with.
        metadata: Facts about the run (framework, versions, model class, options, host, ...).
    """

    def __init__(
        self,
        records: pd.DataFrame,
        events: pd.DataFrame,
        findings: pd.DataFrame,
        *,
        thresholds: Thresholds,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self._records = records
        self._events = events
        self._findings = findings
        self.thresholds = thresholds
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._summary: pd.DataFrame | None = None

    def frame(self) -> pd.DataFrame:
        """Return one row per (step, tensor), as :meth:`graddebug.Watcher.frame` does."""
        return self._records

    def events(self) -> pd.DataFrame:
        """Return the structural events, as :meth:`graddebug.Watcher.events` does."""
        return self._events

    def findings(self) -> pd.DataFrame:
        """Return the findings of the run, as :meth:`graddebug.Watcher.findings` does."""
        return self._findings

    def summary(self) -> pd.DataFrame:
        """Return the per-layer aggregate, as :meth:`graddebug.Watcher.summary` does."""
        if self._summary is None:
            self._summary = summary_frame(self._records, self._findings)
        return self._summary

    def rediagnose(self, **thresholds: float) -> pd.DataFrame:
        """Return the findings under other thresholds, without touching this Report.

        Args:
            **thresholds: Overrides of :class:`graddebug.Thresholds` fields.

        Raises:
            ConfigError: A name is not a threshold, or a value is unusable.
        """
        if not thresholds:
            return self._findings
        internal = self._findings[self._findings["issue"] == Issue.INTERNAL_ERROR.value]
        extra = [Finding(*row) for row in internal.itertuples(index=False)]
        return diagnose(
            self._records, self._events, self.thresholds.replace(**thresholds), extra=extra
        )

    def plot_flow(self) -> Figure:
        """Return the gradient-flow figure: each tensor's median norm by depth, with its
        min-max range over steps (a ``matplotlib.figure.Figure``; pyplot is not used).

        Raises:
            MissingFrameworkError: matplotlib is missing (``pip install graddebug[report]``).
        """
        from graddebug.report.plots import flow_figure

        return flow_figure(self._records, self._findings)

    def plot_heatmap(self) -> Figure:
        """Return the heatmap of log10 gradient norms, tensors by steps, findings marked.

        Raises:
            MissingFrameworkError: matplotlib is missing (``pip install graddebug[report]``).
        """
        from graddebug.report.plots import heatmap_figure

        return heatmap_figure(self._records, self._findings)

    def to_html(self, path: str | os.PathLike[str] | None = None) -> str:
        """Return the self-contained HTML report, and write it to ``path`` when given.

        Args:
            path: Where to write the page (UTF-8), or None.

        Raises:
            MissingFrameworkError: matplotlib is missing (``pip install graddebug[report]``).
        """
        from graddebug.report.html import render_html

        page = render_html(self)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the run to the directory ``path``, in the format :func:`graddebug.load` reads.

        Parquet files hold the three frames and ``graddebug.json`` the thresholds and the
        metadata (values that are not JSON are stored as their ``str``). A run already at
        ``path`` is replaced; any other non-empty directory is refused.

        Args:
            path: The run directory to write.

        Returns:
            The run directory.

        Raises:
            RunFileError: ``path`` is a file or a directory that holds something else, is not
                valid UTF-8, or lies under a file.
            MissingFrameworkError: pyarrow is missing (``pip install graddebug[report]``).
        """
        from graddebug.runs.layout import check_run_path
        from graddebug.runs.writer import write_run

        check_run_path(path, "save(path)", RunFileError)
        return write_run(path, self._records, self._events, self._findings,
                         thresholds=self.thresholds.as_dict(), metadata=self.metadata)

    def assert_healthy(self, ignore: Iterable[str] | str = (), **thresholds: float) -> None:
        """Raise an ``AssertionError`` whose message is the findings table, unless none remain.

        Args:
            ignore: What to accept: issue names (``"dead"``), ``"issue:layer-glob"``
                (``"vanishing:embed*"``), or ``"*:layer-glob"`` for every issue of some layers.
            **thresholds: Overrides of :class:`graddebug.Thresholds` fields; the findings are
                recomputed under them (:meth:`rediagnose`).

        Raises:
            AssertionError: A finding is left; the message lists step, layer, issue and message.
            ConfigError: An ``ignore=`` entry names an unknown issue, or a threshold is unknown.
        """
        __tracebackhide__ = True  # pytest points at the test's line, not at graddebug
        from graddebug.report.verdict import assert_healthy

        assert_healthy(self, ignore, **thresholds)

    def _repr_html_(self) -> str:
        """The notebook view: a one-line verdict, the findings table and a small flow plot.

        Every string from the run is HTML-escaped; without matplotlib the plot is left out
        and the view says so.
        """
        return notebook_html(self._records, self._findings)

    def __repr__(self) -> str:
        steps = self._records["step"].nunique() if not self._records.empty else 0
        return (
            f"<Report steps={steps} rows={len(self._records)} findings={len(self._findings)}>"
        )
