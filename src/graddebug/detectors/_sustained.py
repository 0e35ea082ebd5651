"""Sustained shifts: a series that stays beyond a smaller factor from its baseline for several
recorded steps in a row, where an abrupt change would have to cross a large one at once.

A gradient that falls 70x over two steps, or one layer's update/weight ratio that drops 7x
and stays there while the others keep learning, never crosses the abrupt factors
(``history_grad_factor``, ``history_factor``) in one step; it is still no healthy move. A
streak begins at the first step a series lies beyond ``history_sustain_grad_factor`` or
``history_sustain_factor`` (and ``history_sigma`` robust deviations) from the median of its
window, net of the step's common move; from then on it is judged against that baseline, frozen
(the median of the window *before* the streak, so the shifted values do not drag it along),
and it continues while every step stays beyond the factor in the same direction. After
``history_sustain_steps`` steps it is an event. Slow drift never fires: it moves the baseline
along before it is ever a factor away from it.
"""

from __future__ import annotations

import numpy as np

from graddebug.detectors._series import grown

__all__ = ["Streaks"]


class Streaks:
    """The current streak of every series slot (see :class:`~graddebug.detectors._series.Rings`).

    Args:
        steps: ``history_sustain_steps``.
        sigma: ``history_sigma``.
    """

    def __init__(self, steps: int, sigma: float) -> None:
        self._steps, self._sigma = steps, sigma
        self._length = np.zeros(16, dtype=np.int64)  # steps in the streak; 0: none
        self._base = np.zeros(16)  # the frozen median (log10)
        self._spread = np.zeros(16)  # and its robust standard deviation
        self._sign = np.zeros(16, dtype=np.int8)
        self._start = np.zeros(16, dtype=np.int64)  # the streak's first step
        self._count = np.zeros(16, dtype=np.int64)  # values the frozen baseline held
        self._held = np.zeros(16, dtype=np.int8)  # reported: until back near its median

    def reserve(self, size: int) -> None:
        """Make room for slots ``0 .. size - 1``."""
        self._length = grown(self._length, size, 0)
        self._base = grown(self._base, size, 0.0)
        self._spread = grown(self._spread, size, 0.0)
        self._sign = grown(self._sign, size, 0)
        self._start = grown(self._start, size, 0)
        self._count = grown(self._count, size, 0)
        self._held = grown(self._held, size, 0)

    def idle(self) -> bool:
        """Whether no streak is running and none is held as reported."""
        return not (self._length.any() or self._held.any())

    def take(self, step: int, slots: np.ndarray, values: np.ndarray, median: np.ndarray,
             spread: np.ndarray, count: np.ndarray, shift: np.ndarray, limit: np.ndarray,
             free: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Extend the streaks with one step's judged values.

        Args:
            step: The step.
            slots: The judged series' slots (no slot twice).
            values: Their values at this step (log10).
            median, spread, count: Their rolling baselines (see ``Rings.judge``).
            shift: The step's common move, per judged series.
            limit: log10 of the sustained factor, per judged series.
            free: Not in an abrupt excursion (its streak ends where not).

        Returns:
            Positions (in ``slots``) of the streaks that reach ``history_sustain_steps`` at
            this step, their moves against the frozen baselines (log10, net of the common
            move), their baselines' sizes and their first steps.
        """
        length = self._length[slots]
        rolling = values - median - shift
        frozen = values - self._base[slots] - shift
        sigma = self._sigma
        beyond_rolling = (np.abs(rolling) >= limit) & (np.abs(rolling) >= sigma * spread)
        beyond_frozen = (np.abs(frozen) >= limit) \
            & (np.abs(frozen) >= sigma * self._spread[slots]) \
            & (np.sign(frozen) == self._sign[slots])
        held = self._held[slots]
        back = (held != 0) & (np.abs(rolling) < limit / 2)
        self._held[slots[back]] = 0
        open_ = free & (self._held[slots] == 0)
        going = open_ & (length > 0) & beyond_frozen
        starting = open_ & ~going & beyond_rolling
        new = slots[starting]
        self._length[slots] = 0
        self._length[slots[going]] = length[going] + 1
        self._length[new] = 1
        self._base[new], self._spread[new] = median[starting], spread[starting]
        self._sign[new] = np.sign(rolling[starting]).astype(np.int8)
        self._start[new], self._count[new] = step, count[starting]
        done = np.flatnonzero(self._length[slots] >= self._steps)
        fired = slots[done]
        self._held[fired] = self._sign[fired]
        self._length[fired] = 0
        move = np.where(starting, rolling, frozen)  # a streak of one step has no frozen base
        return done, move[done], self._count[fired], self._start[fired]
