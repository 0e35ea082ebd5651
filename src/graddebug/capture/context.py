"""The side of the Watcher that hooks see (:class:`graddebug.adapter.WatchContext`): where the
run stands (active, the open step, whether it is recorded, its statistics tier, whether it
captures operations) and the fail-open rule's two outlets, internal errors and warnings.

The Watcher owns one and moves it from step to step; the adapter it builds receives it instead
of the Watcher, so the user's ``dbg`` shows none of these hook-facing members.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from graddebug.adapter import CallbackContext
from graddebug.capture.buffer import RunBuffer
from graddebug.capture.escalation import Escalation
from graddebug.capture.tiers import StatTiers
from graddebug.errors import GradDebugInternalError, GradDebugWarning
from graddebug.records import Finding, Issue, Severity

__all__ = ["HookSide"]


class HookSide:
    """Implements :class:`graddebug.adapter.WatchContext` for one Watcher.

    Args:
        watcher: The user-facing side, handed on to the callbacks an adapter builds.
        buffer: The run's rows, where internal errors are recorded.
        every: Record one step in ``every``.
        full_stats_every: One recorded step in this many measures every statistic.
        escalation: Op-level capture armed by findings (``escalate=True``), or None.
        ops: Op-level capture on every recorded step (``ops=True``).
        strict: Raise on a bug inside a hook instead of recording it.
        dead_fraction: The share of dead units that makes the next recorded step full.

    Attributes:
        active: Whether the ``with`` block is running (the Watcher sets it).
        step: Index of the open step (the Watcher moves it).
    """

    def __init__(self, watcher: CallbackContext, buffer: RunBuffer, *, every: int,
                 full_stats_every: int, escalation: Escalation | None, ops: bool,
                 strict: bool, dead_fraction: float) -> None:
        self._watcher = watcher
        self._buffer = buffer
        self.every = every
        self.tiers = StatTiers(every, full_stats_every, dead_fraction)
        self.escalation = escalation
        self._ops = ops
        self.strict = strict
        self.active = False
        self.step = 0
        self._warned = False
        self._warned_keys: set[str] = set()
        self._quiet = False

    @property
    def watcher(self) -> CallbackContext:
        """The user-facing side of the Watcher."""
        return self._watcher

    @property
    def recording(self) -> bool:
        """Whether the open step is recorded (``every=N`` records steps 0, N, 2N, ...)."""
        return self.active and self.step % self.every == 0

    @property
    def step_index(self) -> int:
        """Index of the open step, counted from 0."""
        return self.step

    @property
    def full_stats(self) -> bool:
        """Whether the open step measures every statistic of layer-output gradients: one
        recorded step in ``full_stats_every``, and the one after an unusual sentinel (see
        :mod:`graddebug.capture.tiers`)."""
        return self.tiers.full(self.step)

    @property
    def capture_ops(self) -> bool:
        """Whether the open step captures operations: every recorded step with ``ops=True``;
        with ``escalate=True``, the recorded step after a layer-level ``nonfinite`` or
        ``cut_graph`` finding about a layer that had not escalated before."""
        if not self.recording:
            return False
        escalation = self.escalation
        return self._ops or (escalation is not None and escalation.at == self.step)

    def internal_error(self, exc: BaseException, where: str) -> None:
        """Record a bug caught inside a graddebug hook, or raise it when ``strict=True``.

        Args:
            exc: The exception the hook caught.
            where: Which hook or layer it happened in.

        Raises:
            GradDebugInternalError: ``strict=True`` was given.
        """
        if self.strict:
            raise GradDebugInternalError(f"graddebug hook failed in {where}: {exc!r}") from exc
        self._buffer.add_internal(Finding(
            step=self.step,
            layer=where,
            tensor="",
            issue=Issue.INTERNAL_ERROR.value,
            severity=Severity.WARNING.value,
            value=math.nan,
            threshold=math.nan,
            message=(
                f"graddebug failed inside its hook for {where!r} ({type(exc).__name__}: "
                f"{exc}); training went on untouched but this step's records may be "
                "incomplete. Please report it; strict=True raises instead."
            ),
        ))
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"graddebug: internal error in {where!r}: {exc!r}. Recorded as an "
                "'internal_error' finding; training continues.",
                GradDebugWarning,
                stacklevel=2,
            )

    def warn_once(self, key: str, message: str) -> None:
        """Emit ``message`` as a :class:`GradDebugWarning`, once per ``key`` and Watcher.

        For conditions that are not bugs and not errors, but that leave gaps in the records
        (a tensor graddebug cannot hook, gradients nobody handed over).

        Args:
            key: What the warning is about; a second warning with the same key is dropped.
            message: The text, which says what to do.
        """
        if key in self._warned_keys or self._quiet:
            return
        self._warned_keys.add(key)
        warnings.warn(message, GradDebugWarning, stacklevel=3)

    @property
    def warned(self) -> frozenset[str]:
        """The keys :meth:`warn_once` has warned about so far."""
        return frozenset(self._warned_keys)

    @contextmanager
    def quiet(self, quiet: bool) -> Iterator[None]:
        """Drop :meth:`warn_once` warnings inside the block when ``quiet``: while an
        exception ends the run, warnings about gaps would only bury it."""
        self._quiet = quiet
        try:
            yield
        finally:
            self._quiet = False
