"""Escalation (``watch(..., escalate=True)``): op-level capture for one recorded step, after a
layer-level ``nonfinite`` or ``cut_graph`` finding.

Op-level capture names the operation and the source line behind a NaN or a cut graph, at a
cost per operation. Escalation pays it only when a problem shows: after a recorded step whose
layer-level rows would give a ``nonfinite`` or ``cut_graph`` finding, the next recorded step
captures operations too, and the findings of the run take the line from it where the problem
recurred there. Each (issue, layer) escalates once, so a problem that recurs every step (an
unused parameter starved of gradient) costs one op-level step, not one in two.

The check after each recorded step is cheap where nothing is wrong: one pass over the step's
rows and events. The detectors run on the step's rows only when a row is non-finite or a
structural event not seen before appears.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from graddebug.adapter import StepResult
from graddebug.config import Thresholds
from graddebug.detectors import Evidence, cutgraph, nonfinite
from graddebug.frames import event_frame, record_frame
from graddebug.records import EventKind, Finding, Issue

__all__ = ["Escalation"]

_STRUCTURAL = frozenset({
    EventKind.FORWARD_NONFINITE.value, EventKind.DETACHED_OUTPUT.value,
    EventKind.UNREACHED.value, EventKind.NO_GRAD.value,
})
_ESCALATING = frozenset({Issue.NONFINITE.value, Issue.CUT_GRAPH.value})


class Escalation:
    """Decides, after each recorded step, whether the next recorded step captures operations.

    Args:
        thresholds: The run's thresholds (the detectors' arguments).
        detectors: The diagnoses that escalate; ``nonfinite`` and ``cut_graph`` by default.
    """

    def __init__(self, thresholds: Thresholds,
                 detectors: tuple[Callable[[Evidence, Thresholds], list[Finding]], ...] = (
                     nonfinite.graddebug_findings, cutgraph.graddebug_findings)) -> None:
        self._thresholds = thresholds
        self._detectors = detectors
        self._seen_events: set[tuple[str, str, str]] = set()
        self._escalated: set[tuple[str, str]] = set()
        self.at: int | None = None
        """The step that captures operations, once a finding asked for one."""

    def after(self, step: int, result: StepResult, next_recorded: int) -> None:
        """Look at a recorded step; arm op-level capture for ``next_recorded`` when it shows a
        ``nonfinite`` or ``cut_graph`` finding about a layer that has not escalated before.

        Args:
            step: The step just closed.
            result: Its records and events.
            next_recorded: The index of the next step that will be recorded.
        """
        if step == self.at:
            return  # the op-level step itself: its findings come with their lines already
        if not self._suspect(result):
            return
        evidence = Evidence(records=record_frame(result.records),
                            events=event_frame(result.events))
        fresh = False
        for detect in self._detectors:
            for found in detect(evidence, self._thresholds):
                key = (found.issue, found.layer)
                if found.issue in _ESCALATING and key not in self._escalated:
                    self._escalated.add(key)
                    fresh = True
        if fresh:
            self.at = next_recorded

    def _suspect(self, result: StepResult) -> bool:
        """Whether the step may hold a finding not escalated yet: a non-finite row (until
        ``nonfinite`` has escalated once) or a structural event not seen before."""
        new = False
        for e in result.events:
            if e.event in _STRUCTURAL:
                key = (e.event, e.layer, e.tensor)
                if key not in self._seen_events:
                    self._seen_events.add(key)
                    new = True
        if new:
            return True
        if any(issue == Issue.NONFINITE.value for issue, _ in self._escalated):
            return False
        return any(r.nan or r.inf or not math.isfinite(r.norm) for r in result.records)
