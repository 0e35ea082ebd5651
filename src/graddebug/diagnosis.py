"""Diagnosing a run: every detector plugin (built-in or installed) over its frames.

The live Watcher (:mod:`graddebug.capture.results`), a loaded run (:func:`graddebug.load`) and
``Report.rediagnose`` call :func:`diagnose`. It lives outside :mod:`graddebug.detectors` because
it asks the plugin manager for the detectors, and :mod:`graddebug.plugins` loads the detector
modules by name: no module that the plugin manager loads imports it back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from graddebug.detectors import Evidence
from graddebug.frames import combine_ranks, finding_frame
from graddebug.plugins import get_plugin_manager
from graddebug.records import ALL_RANKS, EventKind, Finding, Issue

if TYPE_CHECKING:
    import pandas as pd
    import pluggy

    from graddebug.config import Thresholds

__all__ = ["diagnose"]


def diagnose(
    records: pd.DataFrame,
    events: pd.DataFrame,
    thresholds: Thresholds,
    *,
    extra: Iterable[Finding] = (),
    plugin_manager: pluggy.PluginManager | None = None,
    exclude: Iterable[str] = (),
) -> pd.DataFrame:
    """Run every detector plugin over recorded frames.

    Args:
        records: A record frame (``Watcher.frame()``).
        events: An event frame (``Watcher.events()``).
        thresholds: The thresholds the detectors apply.
        extra: Findings that come from elsewhere (internal errors) and join the result.
        plugin_manager: The manager whose detectors run; the process-wide one by default.
        exclude: Names of detector plugins to leave out (the live Watcher runs the history
            rules step by step, not over its window).

    Returns:
        The findings frame, ordered by step and severity. The rows of a multi-rank run are
        diagnosed combined (:func:`graddebug.frames.combine_ranks`), and each finding says
        which rank shows it.
    """
    pm = plugin_manager or get_plugin_manager()
    evidence = Evidence(records=combine_ranks(records), events=events)
    combined = evidence.records
    left_out = [pm.get_plugin(name) for name in exclude]
    hook = (pm.subset_hook_caller("graddebug_findings", [p for p in left_out if p is not None])
            if left_out else pm.hook.graddebug_findings)
    batches = hook(evidence=evidence, thresholds=thresholds)
    return finding_frame([*extra, *_with_ranks(_once(batches), combined, events)])


def _once(batches: list[list[Finding]]) -> list[Finding]:
    """The detectors' findings, each issue at each layer from one detector: where two report
    the same one (the whole-run ``dead`` rule and the recent-window one, the depth rule and
    the history rule on a weight scaled mid-run), the detector that saw it first keeps it, and
    at the same step the one that ran first."""
    owner: dict[tuple[str, str], tuple[int, int]] = {}
    for b, batch in enumerate(batches):
        for f in batch:
            key = (f.issue, f.layer)
            owner[key] = min(owner.get(key, (f.step, b)), (f.step, b))
    return [f for b, batch in enumerate(batches) for f in batch
            if owner[(f.issue, f.layer)][1] == b]


def _with_ranks(found: list[Finding], records: pd.DataFrame, events: pd.DataFrame
                ) -> list[Finding]:
    """Findings with the rank whose rows show them.

    In one rank's rows that rank. In a multi-rank run's combined rows (see
    :func:`graddebug.frames.combine_ranks`), a ``nonfinite`` finding names the lowest rank
    where its tensor was not finite, in the backward rows or a forward event; other findings
    concern every rank (:data:`~graddebug.records.ALL_RANKS`).
    """
    ranks = set(records["rank"].unique()) | set(events["rank"].unique())
    if not found or ranks <= {0}:
        return found
    if len(ranks) == 1:
        only = int(ranks.pop())
        return [f._replace(rank=only) for f in found]
    birth: dict[tuple[int, str, str], int] = {}
    marked = records[records["rank"] != ALL_RANKS]
    nonfinite = events[events["event"] == EventKind.FORWARD_NONFINITE.value]
    for frame in (marked, nonfinite):
        for step, layer, tensor, rank in zip(frame["step"], frame["layer"], frame["tensor"],
                                             frame["rank"], strict=True):
            key = (int(step), str(layer), str(tensor))
            birth[key] = min(int(rank), birth.get(key, int(rank)))
    out = []
    for f in found:
        rank = birth.get((f.step, f.layer, f.tensor), ALL_RANKS) \
            if f.issue == Issue.NONFINITE.value else ALL_RANKS
        if rank != ALL_RANKS:
            f = f._replace(message=f"{f.message} It appeared on rank {rank}.")
        out.append(f._replace(rank=rank))
    return out
