"""The loss against its own recent history: ``loss_spike``, and a non-finite loss whose
gradients stayed finite (the loss function made it)."""

from __future__ import annotations

import math
import statistics
from collections import deque

from graddebug.config import Thresholds
from graddebug.detectors import finding
from graddebug.detectors._events import EventBuilder
from graddebug.detectors._series import MAD_TO_SIGMA
from graddebug.records import Cause, Finding, Issue, Severity

__all__ = ["LossHistory"]


class LossHistory:
    """The loss of one run, step by step, against the median and the spread of its last
    ``history_window`` values (its values, not logs: a loss may be negative or 0).

    Args:
        thresholds: The run's thresholds (``history_window``, ``history_min``,
            ``loss_sigma``, ``loss_rise``).
        events: The run's gradient events, to which a spike is attributed.
    """

    def __init__(self, thresholds: Thresholds, events: EventBuilder) -> None:
        self._t = thresholds
        self._events = events
        self._losses: deque[float] = deque(maxlen=thresholds.history_window)
        self._first: list[float] = []  # the run's first history_window losses
        self._spiking = False

    def judge(self, step: int, loss: float, finite: bool) -> list[Finding]:
        """Judge a step's loss (NaN: none recorded), then add it to the history.

        Returns:
            A ``nonfinite`` finding for a NaN/Inf loss (``finite`` False), a ``loss_spike``
            for the first step of a spike, else nothing.
        """
        t = self._t
        if not finite:
            return [finding(
                Issue.NONFINITE, Severity.ERROR, step, "loss",
                (f"the loss was {loss} at step {step} while every gradient stayed "
                 "finite: the loss function made it (a log of 0, a division by a zero count, "
                 "an empty mask). Add an epsilon or a clamp to the loss."),
                tensor="loss", cause=Cause.NUMERICS)]
        if math.isnan(loss):
            return []
        past = list(self._losses)
        self._losses.append(loss)
        if len(self._first) < t.history_window:
            self._first.append(loss)
        count = len(past)
        if count < min(t.history_min, t.history_window):
            return []
        median = statistics.median(past)
        apart = [abs(v - median) for v in past]
        spread = MAD_TO_SIGMA * max(statistics.median(apart), sum(apart) / count)
        delta = loss - median
        # A loss near 0 late in a run triples on a batch with one hard example: the rise is
        # judged against the loss's scale at the start of the run too.
        scale = max(abs(median), abs(statistics.median(self._first)))
        spiked = delta > t.loss_sigma * spread and delta > t.loss_rise * scale
        was = self._spiking
        self._spiking = spiked or (was and delta > 0)
        if not spiked or was:
            return []
        layer, tensor, where = self._events.recent_source(step)
        return [finding(
            Issue.LOSS_SPIKE, Severity.WARNING, step, layer,
            (f"the loss jumped to {loss:.4g} at step {step}, against its median of "
             f"{median:.4g} over the last {count} steps{where}. Check the batch "
             "of that step and the learning rate; gradient clipping bounds such a step."),
            tensor=tensor, value=loss, threshold=median + t.loss_rise * scale,
            cause=self._events.recent_cause(step))]
