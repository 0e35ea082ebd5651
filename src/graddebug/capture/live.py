"""The findings of a run while it records, built step by step at a cost that does not grow
with the run.

Two kinds of rules speak while a run records:

- the history rules (:class:`graddebug.detectors.history.History`) judge each recorded step
  as it closes, on its own rows: a few array operations per step;
- the whole-run rules (vanishing and exploding by depth, magnitude, growth, dead units,
  NaN/Inf, cut graphs, overflow) run over the last ``history_window`` recorded steps only,
  which this module keeps: at once when ``dbg.findings()`` asks, and when due for a step's
  own ``StepResult.findings`` (see :meth:`LiveFindings.new`). One such diagnosis costs some
  tens of milliseconds on a small model, whatever the length of the run
  (``benchmarks/live_findings.py``); when due, it waits until it costs at most
  :data:`WINDOW_BUDGET` of the time the steps took since the last one.

A finding is reported once: a later window that shows the same issue at the same tensor adds
nothing, and the steps after a NaN (every gradient behind one is poisoned) add no new
``nonfinite`` finding until a finite step has come between. Once the run has ended, the
Watcher diagnoses the whole run as a loaded run is (:func:`graddebug.diagnosis.diagnose`),
and keeps every finding reported live.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

import pandas as pd
import pluggy

from graddebug.adapter import StepResult
from graddebug.config import Thresholds
from graddebug.detectors._steprows import StepRows
from graddebug.detectors.history import History
from graddebug.diagnosis import diagnose
from graddebug.frames import event_frame, record_frame
from graddebug.records import Event, Finding, Issue, Record

__all__ = ["HISTORY_PLUGIN", "WINDOW_BUDGET", "LiveFindings", "as_findings"]

HISTORY_PLUGIN = "history"
"""The plugin name of the history rules, which run as steps close, not over windows."""

WINDOW_BUDGET = 0.005
"""The largest share of a run's time that the window rules take when a step's findings are
read on every step: a diagnosis that took 50 ms waits for 10 s of steps since the last one,
200 steps of 50 ms, or ``history_window`` steps where those take longer. A structural event
or a NaN runs them at once."""

_NONFINITE = Issue.NONFINITE.value
_clock = time.perf_counter


class LiveFindings:
    """What a recording run has found so far.

    Args:
        thresholds: The run's thresholds.
        plugin_manager: Whose detectors run over the recent window.
    """

    def __init__(self, thresholds: Thresholds, plugin_manager: pluggy.PluginManager) -> None:
        self._thresholds = thresholds
        self._pm = plugin_manager
        self._history = History(thresholds)
        self._window: deque[tuple[int, list[Record], list[Event]]] = deque(
            maxlen=thresholds.history_window)
        self._found: list[Finding] = []
        self._found_at: list[int] = []  # the latest step closed when each was found
        self._keys: set[tuple[str, str, str]] = set()
        self._latest = -1
        self._diagnosed = -1  # the latest step the window rules have seen
        self._diagnosed_at = 0.0  # when they last ran (the clock's seconds)
        self._cost = 0.0  # and how long that took
        self._broken_since: int | None = None  # first step of the current run of NaN steps
        self._nonfinite_reported = False  # a nonfinite finding in the current run of NaN steps
        self._alarm = False  # a step since the last window diagnosis turned NaN, or an event
        self._events_seen: set[tuple[str, str, str]] = set()

    def observe(self, step: int, result: StepResult) -> None:
        """Take a recorded step's rows: the history rules judge them now."""
        events = [*result.events, *result.peer_events] if result.peer_events else result.events
        rows = StepRows.from_records(step, result.records, events)
        fresh = {(e.event, e.layer, e.tensor) for e in events} - self._events_seen
        self._events_seen |= fresh
        if rows.broken:
            if self._broken_since is None:
                self._broken_since, self._nonfinite_reported = step, False
                fresh.add(("nonfinite", "", ""))
        else:
            self._broken_since = None
        self._latest = step
        self._alarm = self._alarm or bool(fresh)
        self._window.append((step, list(result.records), list(events)))
        self._add(self._history.observe(rows))

    def observe_loss(self, step: int, row: Record) -> None:
        """Take a loss that arrived after its step closed (``record_loss``)."""
        for kept_step, records, _ in reversed(self._window):
            if kept_step == step:
                records.append(row)
                break
        self._add(self._history.observe_loss(step, row.mean, not (row.nan or row.inf)))

    def findings(self) -> list[Finding]:
        """Every finding reported so far, after the window rules have seen the latest step."""
        self._catch_up()
        return list(self._found)

    def new(self, step: int) -> list[Finding]:
        """The findings first reported when ``step`` was the latest recorded step.

        The window rules run here only when due: on the first recorded step, at once after
        a step that turned non-finite or showed a structural event not seen before (no
        gradient, a detached output, a skipped step), and else after ``history_window``
        steps once the time since their last run is long enough that they take at most
        :data:`WINDOW_BUDGET` of it. A loop that reads every step's findings pays for the
        history rules and that share.
        """
        if step == self._latest and self._due():
            self._catch_up()
        found, at = self._found, self._found_at
        # Newest last: the findings of ``step`` are at the end, unless a later step came.
        i = len(at)
        while i and at[i - 1] > step:
            i -= 1
        j = i
        while j and at[j - 1] == step:
            j -= 1
        return found[j:i]

    def _due(self) -> bool:
        if self._diagnosed < 0 or self._alarm:
            return True
        if self._latest - self._diagnosed < self._thresholds.history_window:
            return False
        return (_clock() - self._diagnosed_at) * WINDOW_BUDGET >= self._cost

    def reported(self) -> list[Finding]:
        """The findings reported so far, without running the window rules again."""
        return list(self._found)

    def _catch_up(self) -> None:
        if self._diagnosed == self._latest or not self._window:
            return
        self._diagnosed, self._alarm = self._latest, False
        start = _clock()
        records = [r for _, rows, _ in self._window for r in rows]
        events = [e for _, _, rows in self._window for e in rows]
        window = diagnose(record_frame(records), event_frame(events), self._thresholds,
                          plugin_manager=self._pm, exclude=(HISTORY_PLUGIN,))
        self._add(as_findings(window))
        self._diagnosed_at = _clock()
        self._cost = self._diagnosed_at - start

    def _add(self, found: Iterable[Finding]) -> None:
        for f in found:
            key = (f.issue, f.layer, f.tensor)
            if key in self._keys:
                continue
            if f.issue == _NONFINITE and self._in_reported_episode(f.step):
                continue
            if f.issue == _NONFINITE and self._broken_since is not None \
                    and f.step >= self._broken_since:
                self._nonfinite_reported = True
            self._keys.add(key)
            self._found.append(f)
            self._found_at.append(self._latest)

    def _in_reported_episode(self, step: int) -> bool:
        """Whether a ``nonfinite`` finding at ``step`` belongs to the run of NaN steps that
        has one already (its later steps only show the victims)."""
        since = self._broken_since
        return since is not None and step >= since and self._nonfinite_reported


def as_findings(frame: pd.DataFrame) -> list[Finding]:
    """The rows of a findings frame as :class:`~graddebug.records.Finding` tuples."""
    return [Finding(*row) for row in frame.itertuples(index=False, name=None)]
