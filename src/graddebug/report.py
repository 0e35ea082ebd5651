"""Report: the frames of one run, live or loaded from disk, and what derives from them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd
import pluggy

from graddebug.config import Thresholds
from graddebug.detectors import Evidence
from graddebug.frames import finding_frame, summary_frame
from graddebug.plugins import get_plugin_manager
from graddebug.records import Finding

__all__ = ["Report", "diagnose"]


def diagnose(
    records: pd.DataFrame,
    events: pd.DataFrame,
    thresholds: Thresholds,
    *,
    extra: Iterable[Finding] = (),
    plugin_manager: pluggy.PluginManager | None = None,
) -> pd.DataFrame:
    """Run every detector plugin over recorded frames.

    Args:
        records: A record frame (``Watcher.frame()``).
        events: An event frame (``Watcher.events()``).
        thresholds: The thresholds the detectors apply.
        extra: Findings that come from elsewhere (internal errors) and join the result.
        plugin_manager: The manager whose detectors run; the process-wide one by default.

    Returns:
        The findings frame, ordered by step and severity.
    """
    pm = plugin_manager or get_plugin_manager()
    evidence = Evidence(records=records, events=events)
    found: list[Finding] = list(extra)
    for batch in pm.hook.graddebug_findings(evidence=evidence, thresholds=thresholds):
        found.extend(batch)
    return finding_frame(found)


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
        internal = self._findings[self._findings["issue"] == "internal_error"]
        extra = [Finding(*row) for row in internal.itertuples(index=False)]
        return diagnose(
            self._records, self._events, self.thresholds.replace(**thresholds), extra=extra
        )

    def __repr__(self) -> str:
        steps = self._records["step"].nunique() if not self._records.empty else 0
        return (
            f"<Report steps={steps} rows={len(self._records)} findings={len(self._findings)}>"
        )
