"""Rolling per-tensor baselines: the last few values of many series, and how far a new value
lies from their median.

The history rules (:mod:`graddebug.detectors.history`) keep two families of rolling series,
two slots per tensor (:meth:`Layout.ids`): the log10 of its gradient norm (slot ``2 * id``)
and of its update/weight ratio (slot ``2 * id + 1``), judged together, in one pass a step. A
baseline is the median of the last ``window`` values and its spread the median absolute
deviation (MAD) around it: a NaN never enters (non-finite steps are left out before), and a
single outlier moves neither, so one bad step cannot hide the next.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from graddebug.records import Kind

__all__ = ["MAD_TO_SIGMA", "Deviation", "Layout", "Rings", "Zeros", "grown", "median_of"]

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
        self._values = np.full((16, window), np.nan)
        self._count = np.zeros(16, dtype=np.int64)
        self.state = np.zeros(16, dtype=np.int8)
        """Per series: +1 or -1 while it is in an excursion (a jump or a collapse already
        reported or absorbed), 0 otherwise; the rules set and clear it."""

    def reserve(self, size: int) -> None:
        """Make room for slots ``0 .. size - 1``."""
        if size <= len(self._count):
            return
        size = max(size, 2 * len(self._count))
        extra = size - len(self._count)
        self._values = np.vstack([self._values, np.full((extra, self.window), np.nan)])
        self._count = np.concatenate([self._count, np.zeros(extra, dtype=np.int64)])
        self.state = np.concatenate([self.state, np.zeros(extra, dtype=np.int8)])

    def judge(self, slots: np.ndarray, values: np.ndarray, minimum: int) -> Deviation:
        """Compare ``values`` (one per slot) with their series' baselines, before they join.

        Args:
            slots: Slot numbers (below the size given to :meth:`reserve`).
            values: Finite values.
            minimum: Series with fewer values than this are not judged.
        """
        count = self._count[slots]
        window = self.window
        if len(count) and np.minimum.reduce(count) >= window:
            return self._judge_full(slots, values)
        rows = np.flatnonzero(count >= min(minimum, window))
        judged = slots[rows]
        if not len(judged):
            empty = np.empty(0)
            return Deviation(judged, rows, empty, empty, empty, count[rows])
        held = self._values[judged]
        filled = np.minimum(count[rows], window)
        median = _medians(held, filled)
        apart = np.abs(held - median[:, None])
        # The MAD is 0 when most values are equal, and a series that alternates between two
        # levels has mostly equal ones: the mean absolute deviation keeps its spread.
        mean_apart = np.nansum(apart, axis=1) / filled
        spread = MAD_TO_SIGMA * np.maximum(_medians(apart, filled), mean_apart)
        return Deviation(judged, rows, values[rows] - median, spread, median, filled)

    def _judge_full(self, slots: np.ndarray, values: np.ndarray) -> Deviation:
        """:meth:`judge` where every ring is full (a run's usual step): the same numbers,
        with slices where the general case needs gathers."""
        window = self.window
        held = self._values[slots]
        low, high = (window - 1) // 2, window // 2
        ordered = np.sort(held, axis=1)
        median = 0.5 * (ordered[:, low] + ordered[:, high])
        apart = np.abs(held - median[:, None])
        ordered = np.sort(apart, axis=1)
        spread = MAD_TO_SIGMA * np.maximum(0.5 * (ordered[:, low] + ordered[:, high]),
                                           apart.sum(axis=1) / window)
        filled = np.full(len(slots), window, dtype=np.int64)
        return Deviation(slots, np.arange(len(slots)), values - median, spread, median, filled)

    def full(self, slots: np.ndarray) -> bool:
        """Whether every slot's ring is full and none is in an excursion."""
        return bool(len(slots)) and int(self._count[slots].min()) >= self.window \
            and not self.state.any()

    def medians(self, slots: np.ndarray) -> np.ndarray:
        """The baselines of full rings: the medians of :meth:`judge`, without the spreads."""
        window = self.window
        ordered = self._values[slots]  # a copy, sorted in place: np.sort would copy it again
        ordered.sort(axis=1)
        median: np.ndarray = 0.5 * (ordered[:, (window - 1) // 2] + ordered[:, window // 2])
        return median

    def held(self, slots: np.ndarray) -> np.ndarray:
        """Each slot's last ``window`` values, in ring order (NaN where fewer were pushed)."""
        return np.asarray(self._values[slots])

    def counts(self, slots: np.ndarray) -> np.ndarray:
        """How many values each slot's series has been given."""
        return np.asarray(self._count[slots])

    def push(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Add one value to each slot's series (the oldest leaves a full ring)."""
        if not len(slots):
            return
        count = self._count
        at = count[slots]
        self._values[slots, at % self.window] = values
        count[slots] = at + 1


def _medians(values: np.ndarray, filled: np.ndarray) -> np.ndarray:
    """The median of each row's first ``filled`` values (a ring not full yet holds NaN in the
    others, which sort last). ``np.nanmedian`` does the same some 50 times slower on rows
    this short."""
    ordered = np.sort(values, axis=1)
    rows = np.arange(len(values))
    return np.asarray(0.5 * (ordered[rows, (filled - 1) // 2] + ordered[rows, filled // 2]),
                      dtype=float)


_ACTIVATION, _PARAMETER, _LOSS = Kind.ACTIVATION.value, Kind.PARAMETER.value, Kind.LOSS.value


class Layout:
    """The series id of each row of a step, by (kind, layer, tensor), and what the rows' kinds
    say: cached while a step's rows repeat the previous step's, which is the usual case (the
    same model, the same capture), so that a step costs no dictionary lookup per row.

    Attributes:
        ids: Per row, its series id (ids count from 0 in order of first appearance).
        activation, parameter, gradient: Per row, whether it is a layer output's gradient, a
            parameter's, and any gradient (not a loss row).
        has_activation: Some row is a layer output's gradient.
        unique: No two rows of the step share a key (a loaded run of several ranks may).
        params, outputs: The parameter rows and the layer-output rows, as a slice where they
            are contiguous (the frame order puts them so), else as indices.
        slots: The ring slots of every row's gradient, then of every parameter row's
            update/weight ratio (see :class:`Rings`), in that order.
        param_ids: The series ids of the parameter rows (``ids[params]``).
    """

    def __init__(self) -> None:
        self._index: dict[Hashable, int] = {}
        self._keys: tuple[list[object], list[object], list[object]] | None = None
        empty = np.empty(0, dtype=bool)
        self.ids = np.empty(0, dtype=np.int64)
        self.activation, self.parameter, self.gradient = empty, empty, empty
        self.has_activation, self.unique = False, True
        self.params: slice | np.ndarray = slice(0, 0)
        self.outputs: slice | np.ndarray = slice(0, 0)
        self.slots = np.empty(0, dtype=np.int64)
        self.param_ids = np.empty(0, dtype=np.int64)
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        """How many series have been seen."""
        return len(self._index)

    def update(self, kind: np.ndarray, layer: np.ndarray, tensor: np.ndarray) -> bool:
        """Take a step's rows; returns whether the layout is the previous step's."""
        arrays = self._arrays
        if arrays is not None and kind is arrays[0] and layer is arrays[1] \
                and tensor is arrays[2] and not kind.flags.writeable:
            return True  # the read-only arrays a live run's steps share (see _steprows)
        self._arrays = (kind, layer, tensor)
        keys = (kind.tolist(), layer.tolist(), tensor.tolist())
        if keys == self._keys:
            return True
        self._keys = keys
        index = self._index
        ids = [index.setdefault(key, len(index)) for key in zip(*keys, strict=True)]
        self.ids = np.asarray(ids, dtype=np.int64)
        self.unique = len(set(ids)) == len(ids)
        self.activation = kind == _ACTIVATION
        self.has_activation = bool(self.activation.any())
        self.parameter = kind == _PARAMETER
        self.gradient = kind != _LOSS
        self.params = _as_slice(self.parameter.nonzero()[0])
        self.outputs = _as_slice(self.activation.nonzero()[0])
        self.param_ids = self.ids[self.params]
        self.slots = np.concatenate((2 * self.ids, 2 * self.param_ids + 1))
        return False


def _as_slice(at: np.ndarray) -> slice | np.ndarray:
    """``at`` as a slice where its indices are contiguous: a view where indices copy."""
    if not len(at):
        return slice(0, 0)
    first, last = int(at[0]), int(at[-1])
    return slice(first, last + 1) if last - first + 1 == len(at) else at


class Zeros:
    """The zero fraction of each layer output's gradient at its last two known steps, for the
    recent-window ``dead`` rule.

    Args:
        fraction: ``dead_fraction``.
        window: ``history_window``: both steps must lie within it.
    """

    def __init__(self, fraction: float, window: int) -> None:
        self._fraction, self._window = fraction, window
        self._before = np.full(16, -1, dtype=np.int64)  # the step before the last known one
        self._step = np.full(16, -1, dtype=np.int64)
        self._zero = np.full(16, np.nan)
        self._dead = np.zeros(16, dtype=bool)  # reported, until its fraction falls again

    def reserve(self, size: int) -> None:
        """Make room for series ids ``0 .. size - 1``."""
        self._before = grown(self._before, size, -1)
        self._step = grown(self._step, size, -1)
        self._zero = grown(self._zero, size, np.nan)
        self._dead = grown(self._dead, size, False)

    def before(self, series: int) -> int:
        """The known step before the last one of a series (-1: none)."""
        return int(self._before[series])

    def advance(self, step: int, ids: np.ndarray, zero: np.ndarray, top: float) -> bool:
        """:meth:`take` where no unit can die at this step, which is then only remembered
        (and a series reported dead whose fraction fell below ``fraction`` cleared); False,
        and nothing taken, where one could: a fraction at or above ``fraction`` (``top``: the
        largest) in a series not reported dead.

        Args:
            step: The step.
            ids: The series measured at this step (no id twice).
            zero: Their fractions (none NaN).
            top: ``zero``'s largest.
        """
        dead = self._dead
        if not top < self._fraction and not (dead[ids] | (zero < self._fraction)).all():
            return False
        if top >= self._fraction or dead.any():
            dead[ids[zero < self._fraction]] = False
        self._before[ids] = self._step[ids]
        self._step[ids] = step
        self._zero[ids] = zero
        return True

    def take(self, step: int, ids: np.ndarray, zero: np.ndarray, unique: bool) -> np.ndarray:
        """Add a step's zero fractions; returns the positions (in ``ids``) of the series
        whose units just died: at or above the fraction at this step and at the last known
        one, within the window, and not reported yet."""
        if not unique:  # the same series twice in a step: each row sees the one before
            return np.asarray([i for i in range(len(ids))
                               if len(self.take(step, ids[i:i + 1], zero[i:i + 1], True))],
                              dtype=np.int64)
        last, last_zero = self._step[ids], self._zero[ids]
        self._before[ids] = last
        self._step[ids] = step
        self._zero[ids] = zero
        low = zero < self._fraction
        self._dead[ids[low]] = False
        # NaN (no step known yet) is never at or above the fraction
        fresh = np.flatnonzero(~low & (last_zero >= self._fraction) & ~self._dead[ids]
                               & (step - last < self._window))
        self._dead[ids[fresh]] = True
        return fresh


def grown(values: np.ndarray, size: int, fill: object) -> np.ndarray:
    """``values``, or a copy of it extended with ``fill`` to at least ``size`` entries (twice
    its length, where that is more: a run adds its series at its first steps)."""
    if size <= len(values):
        return values
    out = np.full(max(size, 2 * len(values)), fill, dtype=values.dtype)
    out[:len(values)] = values
    return out


def median_of(values: np.ndarray) -> float:
    """``np.median`` of a non-empty 1-d array, to the last bit (the middle value, or half the
    sum of the two middle ones). ``np.median`` goes through ``partition`` and ``mean``: on a
    step's path, after the training step has evicted numpy's code from the caches, it took
    several times as long as a sort, cold and warm."""
    ordered = np.sort(values)
    n = len(ordered)
    if n % 2:
        return float(ordered[n // 2])
    return float((ordered[n // 2 - 1] + ordered[n // 2]) / 2)
