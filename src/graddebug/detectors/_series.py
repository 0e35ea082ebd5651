"""Rolling per-tensor baselines: the last few values of many series, and how far a new value
lies from their median.

The history rules (:mod:`graddebug.detectors.history`) keep three families of series, one row
per tensor: the log10 of its gradient norm, of its weight norm and of its update/weight ratio.
A baseline is the median of the last ``window`` values and its spread the median absolute
deviation (MAD) around it: a NaN never enters (non-finite steps are left out before), and a
single outlier moves neither, so one bad step cannot hide the next.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["MAD_TO_SIGMA", "Deviation", "Rings"]

MAD_TO_SIGMA = 1.4826
"""MAD times this estimates a normal distribution's standard deviation."""


class Deviation:
    """Where a step's values stand against their baselines.

    Attributes:
        slots: The series judged (those with enough history), as slot numbers.
        rows: For each judged slot, the index of its value in the step's arrays.
        delta: ``value - median`` of each judged series (log10 units for the log families).
        spread: Its robust standard deviation: ``MAD_TO_SIGMA`` times the MAD, or times the
            mean absolute deviation from the median where that is larger.
        median: The baseline itself.
        count: How many values the baseline holds.
    """

    __slots__ = ("count", "delta", "median", "rows", "slots", "spread")

    def __init__(self, slots: np.ndarray, rows: np.ndarray, delta: np.ndarray,
                 spread: np.ndarray, median: np.ndarray, count: np.ndarray) -> None:
        self.slots, self.rows, self.delta = slots, rows, delta
        self.spread, self.median, self.count = spread, median, count


class Rings:
    """The last ``window`` values of a growing set of series, one ring buffer each.

    Args:
        window: Values held per series.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._index: dict[Hashable, int] = {}
        self._values = np.full((16, window), np.nan)
        self._count = np.zeros(16, dtype=np.int64)
        self.state = np.zeros(16, dtype=np.int8)
        """Per series: +1 or -1 while it is in an excursion (a jump or a collapse already
        reported or absorbed), 0 otherwise; the rules set and clear it."""

    def slots(self, keys: Sequence[Hashable]) -> np.ndarray:
        """The slot of each key, adding series for keys not seen before."""
        index = self._index
        out = np.empty(len(keys), dtype=np.int64)
        for i, key in enumerate(keys):
            slot = index.get(key)
            if slot is None:
                slot = index[key] = len(index)
            out[i] = slot
        if len(index) > len(self._count):
            self._grow(len(index))
        return out

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * len(self._count))
        extra = size - len(self._count)
        self._values = np.vstack([self._values, np.full((extra, self.window), np.nan)])
        self._count = np.concatenate([self._count, np.zeros(extra, dtype=np.int64)])
        self.state = np.concatenate([self.state, np.zeros(extra, dtype=np.int8)])

    def judge(self, slots: np.ndarray, values: np.ndarray, minimum: int) -> Deviation:
        """Compare ``values`` (one per slot) with their series' baselines, before they join.

        Args:
            slots: From :meth:`slots`.
            values: Finite values.
            minimum: Series with fewer values than this are not judged.
        """
        count = self._count[slots]
        rows = np.flatnonzero(count >= min(minimum, self.window))
        judged = slots[rows]
        if not len(judged):
            empty = np.empty(0)
            return Deviation(judged, rows, empty, empty, empty, count[rows])
        held = self._values[judged]
        filled = np.minimum(count[rows], self.window)
        median = _medians(held, filled)
        apart = np.abs(held - median[:, None])
        # The MAD is 0 when most values are equal, and a series that alternates between two
        # levels has mostly equal ones: the mean absolute deviation keeps its spread.
        mean_apart = np.nansum(apart, axis=1) / filled
        spread = MAD_TO_SIGMA * np.maximum(_medians(apart, filled), mean_apart)
        return Deviation(judged, rows, values[rows] - median, spread, median, filled)

    def push(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Add one value to each slot's series (the oldest leaves a full ring)."""
        if not len(slots):
            return
        count = self._count
        self._values[slots, count[slots] % self.window] = values
        count[slots] += 1


def _medians(values: np.ndarray, filled: np.ndarray) -> np.ndarray:
    """The median of each row's first ``filled`` values (a ring not full yet holds NaN in the
    others, which sort last). ``np.nanmedian`` does the same some 50 times slower on rows
    this short."""
    ordered = np.sort(values, axis=1)
    rows = np.arange(len(values))
    return np.asarray(0.5 * (ordered[rows, (filled - 1) // 2] + ordered[rows, filled // 2]),
                      dtype=float)
