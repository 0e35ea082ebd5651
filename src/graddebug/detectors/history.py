"""Mid-training events: every tensor against its own recent history.

A model that learns for a while and then breaks shows it in one tensor's own history, not in a
comparison between layers at one step: a weight scaled up in front of a normalisation makes its
own gradient collapse while everything around it stays put, and a learning rate that jumps
moves every update at once. These rules follow, step by step:

- the log10 of each gradient norm (layer outputs, taps, parameters),
- the log10 of each parameter's update/weight ratio, and its weight norm against those of
  its last ``history_sustain_steps`` recorded steps (an edit outside the optimizer, at once
  or over a few steps),
- the loss, and the zero fraction of layer-output gradients,

each against the median and the MAD of its own last ``history_window`` recorded steps, net of
what the step did to every tensor of its kind at once (a hard batch, the learning-rate
schedule). An abrupt change is an event, reported on the step it happens, once: the tensors
that change at the same step, or within :data:`~graddebug.detectors._events.COOLDOWN` steps
after, are counted in its message. Slow drift moves the median with it and never fires.

The rules are causal (a step is judged on the steps before it), so the live Watcher runs them
as steps close (:class:`History`, through :mod:`graddebug.capture.live`) and a loaded run
replays its frame through the same code: both give the same findings.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding
from graddebug.detectors._events import (
    COOLDOWN,
    STALL_MARGIN,
    EventBuilder,
    Family,
    Family3,
    Moves,
    common_move,
    stalled_floor,
)
from graddebug.detectors._loss import LossHistory
from graddebug.detectors._series import Layout, Rings, Zeros, grown, median_of
from graddebug.detectors._steprows import StepRows
from graddebug.detectors._sustained import Streaks
from graddebug.hookspecs import hookimpl
from graddebug.records import Cause, Finding, Issue, Kind, Severity

__all__ = ["COOLDOWN", "STALL_MARGIN", "History", "graddebug_findings"]

_PARAMETER, _ACTIVATION = Kind.PARAMETER.value, Kind.ACTIVATION.value

class History:
    """The streaming rules of one run, fed one recorded step at a time.

    Args:
        thresholds: The run's thresholds (``history_*``, ``stall_floor``, ``loss_*``,
            ``dead_fraction``).
    """

    def __init__(self, thresholds: Thresholds) -> None:
        self._t = thresholds
        window = thresholds.history_window
        # Two rings per tensor (see Layout.ids): its log10 gradient norm and (parameters)
        # update/weight ratio; and a short one of its log10 weight norms, the last
        # history_sustain_steps (see _edits).
        self._layout = Layout()
        self._rings = Rings(window)
        self._streaks = Streaks(thresholds.history_sustain_steps, thresholds.history_sigma)
        self._weights = Rings(thresholds.history_sustain_steps)
        self._steps_seen = 0
        self._events = EventBuilder(thresholds)
        self._loss = LossHistory(thresholds, self._events)
        # Per series id: reported as stalled at the floor (until it moves again), and the
        # zero fractions of its last two known steps (see Zeros).
        self._frozen = np.zeros(16, dtype=bool)
        self._zeros = Zeros(thresholds.dead_fraction, window)
        self._broken: int | None = None  # the last step skipped or left out for a NaN
        # A step is quiet when no series can cross a factor (see _quiet); while the rules
        # hold no excursion, streak, report or shift (calm), such a step skips them.
        self._calm = False
        self._all_full = False  # every series of the layout full (see _quiet)
        self._quiet_grad = min(math.log10(thresholds.history_grad_factor),
                               math.log10(thresholds.history_sustain_grad_factor))
        self._quiet_ratio = min(math.log10(thresholds.history_factor),
                                math.log10(thresholds.history_sustain_factor))

    def observe(self, rows: StepRows) -> list[Finding]:
        """Judge one recorded step against the history so far, then add it to the history.

        Steps a loss scaler skipped are left out (their gradients overflowed by design), and
        so are steps with a NaN or Inf (the ``nonfinite`` diagnosis speaks for them, and a
        NaN would poison every baseline) but for their loss.

        Returns:
            The findings of events that began at this step.
        """
        if rows.skipped or rows.broken:
            self._broken = rows.step
            return []
        if not self._layout.update(rows.kind, rows.layer, rows.tensor):
            size = 2 * len(self._layout)
            self._rings.reserve(size)
            self._streaks.reserve(size)
            self._weights.reserve(size)
            self._frozen = grown(self._frozen, size, False)
            self._zeros.reserve(size)
            self._calm = False
        if not (self._calm and self._quiet(rows)):
            found = self._changes(rows)
            found += self._stalled_floor(rows)
            found += self._dead_units(rows)
            self._calm = self._is_calm(rows)
            return found + self._loss.judge(rows.step, rows.loss, rows.loss_finite)
        return self._loss.judge(rows.step, rows.loss, rows.loss_finite)

    def observe_loss(self, step: int, loss: float, finite: bool) -> list[Finding]:
        """Judge a loss that arrived after its step was observed (the step's other rules have
        run); nothing for a step that was skipped or held a NaN."""
        if step in (self._broken, None):
            return []
        return self._loss.judge(step, loss, finite)

    # -- the quiet step -----------------------------------------------------------------------

    def _quiet(self, rows: StepRows) -> bool:
        """Take a step that none of the rules can report, as they would; False (and nothing
        taken) where the step may be near a threshold, for the full rules to judge.

        A healthy step is quiet: every norm positive and finite, every gradient within
        half the smaller of its abrupt and sustained factors of its median (its move net of
        the step's common move, which moves at most as much, stays within the factor), and
        so every update/weight ratio; no weight norm moved by ``history_factor``, no ratio
        at the stall floor, no zero fraction at ``dead_fraction`` but in a layer reported
        dead. Live, after a training step has evicted numpy's code from the caches, each numpy
        function a step touches is slow the first time: these checks touch some 15 of them,
        the full rules several times as many, so that the quiet path more than halves
        ``History.observe`` (the Performance page has the timings).
        """
        t = self._t
        layout = self._layout
        params = layout.params
        norm, weight, update = rows.norm, rows.weight_norm[params], rows.update_norm[params]
        every = np.concatenate((norm, weight, update))
        # "not (x < y)": a NaN anywhere fails every check. The usual step: every gradient and
        # weight norm positive, every norm finite, in 4 calls where one check each took 7.
        if _least(every[:len(norm) + len(weight)]) > 0 and _most(every) < math.inf:
            low = _least(update)
            whole, moving = low >= 0, low > 0
        elif not (norm.min() > 0 and norm.max() < math.inf):
            return False  # no log below can warn: np.errstate alone cost 12 us
        else:
            whole = moving = False  # a weight norm not sampled (NaN), 0 or infinite
        if whole and rows.numel.min() >= t.history_numel:
            series = self._whole_series(norm, weight, update, moving)
        else:
            series = self._some_series(rows, norm, weight, update)
        if series is None:
            return False
        slots, values, logs, weights, grads = series
        size = np.abs(values - self._rings.medians(slots))
        if not (2 * _most(size[:grads], initial=0.0) < self._quiet_grad
                and 2 * _most(size[grads:], initial=0.0) < self._quiet_ratio):
            return False
        # NaN (a weight with fewer recorded steps than the window) fails the check too
        if not _most(np.abs(logs[:, None] - self._weights.held(weights)), axis=None,
                     initial=0.0) < math.log10(t.history_factor):
            return False
        zero = rows.zero_frac[layout.outputs]
        # The fractions measured at this step (zero_frac is sampled: NaN on most steps for
        # large outputs, while staged small ones are measured on every step).
        top = np.fmax.reduce(zero) if len(zero) else math.nan
        if top == top:
            measured = zero == zero
            if not self._zeros.advance(rows.step, layout.ids[layout.outputs][measured],
                                       zero[measured], top):
                return False
        self._steps_seen += 1
        self._rings.push(slots, values)
        self._weights.push(weights, logs)
        return True

    def _whole_series(self, norm: np.ndarray, weight: np.ndarray, update: np.ndarray,
                      moving: bool
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
        """The quiet checks' series where every row is judged (every tensor of
        ``history_numel`` entries or more, every weight norm positive and finite, every update
        norm finite), as :meth:`_some_series` gives them, in fewer array operations: every
        ratio where every update is positive (``moving``), else those of the updates that
        moved the weights (a conv's bias before a batch norm, a layer whose gradient vanished,
        gets an update of 0). None where a series is not full or the stall floor could speak.

        Returns:
            As :meth:`_some_series`.
        """
        t, layout = self._t, self._layout
        ratio = update / weight
        if moving:
            if not (self._all_full or self._rings.full(layout.slots)):
                return None  # calm was judged on a step where some series were left out
            self._all_full = True
            if not _least(ratio) > t.stall_floor:
                return None
            slots = layout.slots
        else:
            frozen = ratio <= t.stall_floor
            learning = ratio[~frozen]
            if len(learning) and median_of(learning) >= t.stall_floor * STALL_MARGIN:
                return None
            moved = ratio > 0
            ratio = ratio[moved]
            grads = len(norm)
            slots = np.concatenate((layout.slots[:grads], layout.slots[grads:][moved]))
            if not self._rings.full(slots):
                return None
        # one log10 for both families (the values of _changes, to the last bit)
        values = np.log10(np.concatenate((norm, ratio)))
        return slots, values, np.log10(weight), layout.param_ids, len(norm)

    def _some_series(self, rows: StepRows, norm: np.ndarray, weight: np.ndarray,
                     update: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
        """The quiet checks' series where some rows have none, as the full rules leave them
        out: tensors under ``history_numel`` entries (a 10-class head's bias), weights and
        ratios that were not sampled (NaN), and ratios whose update was too small for the
        weights' precision to move them (0: a conv's bias before a batch norm gets a gradient
        of about 1e-7). None where the stall floor could speak, a weight norm is 0 or
        infinite, or a series is not full yet.

        Returns:
            The judged slots, their values, the judged weights' log10 norms and series ids,
            and how many of the values are gradients.
        """
        t, layout = self._t, self._layout
        params = layout.params
        known = weight > 0  # NaN: not sampled
        if not weight[known].max(initial=1.0) < math.inf or (weight <= 0).any():
            return None
        sampled = known & np.isfinite(update)
        ratio = np.where(sampled, update, 0.0) / np.where(known, weight, 1.0)
        frozen = sampled & (ratio <= t.stall_floor)
        if frozen.any():
            learning = ratio[sampled & ~frozen]
            if len(learning) and median_of(learning) >= t.stall_floor * STALL_MARGIN:
                return None
        big = rows.numel >= t.history_numel
        kept = big[params] & known
        moving = kept & (ratio > 0)
        grads = len(norm)
        slots = np.concatenate((layout.slots[:grads][big], layout.slots[grads:][moving]))
        if not self._rings.full(slots):
            return None
        values = np.concatenate((np.log10(norm[big]), np.log10(ratio[moving])))
        return (slots, values, np.log10(weight[kept]), layout.ids[params][kept],
                int(big.sum()))

    def _is_calm(self, rows: StepRows) -> bool:
        """Whether a quiet step would change nothing but the baselines: the rings of the
        layout's tensors full (those the rules judge: ``history_numel`` entries or more), and
        no excursion, streak, stalled report or global shift held (a layer reported dead
        may stay so: :meth:`Zeros.advance` takes its steps as the full rules would)."""
        layout = self._layout
        big = rows.numel >= self._t.history_numel
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = rows.update_norm[layout.params] / rows.weight_norm[layout.params]
        judged = layout.slots[np.concatenate((big, big[layout.params] & (ratio > 0)
                                              & (ratio < math.inf)))]
        self._all_full = self._rings.full(layout.slots)
        return (layout.unique and self._steps_seen >= self._t.history_min
                and bool(layout.gradient.all()) and bool(layout.parameter.any())
                and self._rings.full(judged) and self._streaks.idle()
                and not self._frozen.any() and not self._events.shifted)

    # -- jumps and collapses ----------------------------------------------------------------

    def _changes(self, rows: StepRows) -> list[Finding]:
        """Judge every tensor's series at once, gradients and update/weight ratios in one pass
        (a few array operations a step, whatever the number of tensors), then turn what moved
        into an event."""
        t = self._t
        layout = self._layout
        big = (rows.numel >= t.history_numel) & layout.gradient
        param = big & layout.parameter
        with np.errstate(divide="ignore", invalid="ignore"):
            grads = np.log10(rows.norm)
            weights = np.log10(rows.weight_norm)
            ratios = np.log10(rows.update_norm / rows.weight_norm)
        self._steps_seen += 1
        at_grad = _where(big & np.isfinite(grads))
        at_ratio = _where(param & np.isfinite(ratios))
        at = np.concatenate((at_grad, at_ratio))
        slots = np.concatenate((2 * layout.ids[at_grad], 2 * layout.ids[at_ratio] + 1))
        values = np.concatenate((grads[at_grad], ratios[at_ratio]))
        dev = self._rings.judge(slots, values, t.history_min)
        self._rings.push(slots, values)
        judged = at[dev.rows]
        split = int(np.searchsorted(dev.rows, len(at_grad)))  # grads first, then ratios
        shift = common_move(rows, judged[:split], dev.delta[:split], by_depth=True)
        ratio_shift = common_move(rows, judged[split:], dev.delta[split:], by_depth=False)
        shifts = np.empty(len(dev.delta))
        shifts[:split], shifts[split:] = shift, ratio_shift
        delta = dev.delta - shifts
        limit = np.empty(len(delta))
        limit[:split] = math.log10(t.history_grad_factor)
        limit[split:] = math.log10(t.history_factor)
        size = np.abs(delta)
        state = self._rings.state
        was = state[dev.slots]
        new = (size >= limit) & (size >= t.history_sigma * dev.spread) & (was == 0)
        state[dev.slots[new]] = np.sign(delta[new]).astype(np.int8)
        state[dev.slots[(was != 0) & (size < limit / 2)]] = 0
        sustain = np.empty(len(delta))
        sustain[:split] = math.log10(t.history_sustain_grad_factor)
        sustain[split:] = math.log10(t.history_sustain_factor)
        done, move, count, start = self._streaks.take(
            rows.step, dev.slots, values[dev.rows], dev.median, dev.spread, dev.count, shifts,
            sustain, state[dev.slots] == 0)
        grad, ratio = new[:split], new[split:]
        edits, recent = self._edits(layout, param, weights)
        moves = Moves(
            grad=(judged[:split][grad], delta[:split][grad], dev.count[:split][grad],
                  judged[:split]),
            weight=edits,
            weight_moves=recent,
            ratio=(judged[split:][ratio], delta[split:][ratio], dev.count[split:][ratio],
                   judged[split:]),
            ratio_shift=ratio_shift,
            sustained=(judged[done], move, count, start, done < split))
        return self._events.build(rows, moves)

    def _edits(self, layout: Layout, where: np.ndarray, logs: np.ndarray
               ) -> tuple[Family, Family3]:
        """Weights whose norm changed by ``history_factor`` within the last
        ``history_sustain_steps`` recorded steps: no optimizer does that (a healthy weight
        norm moves by 1.5x in a step at most, measured on tensors of 1024 entries and more),
        an edit, a reload or a bug outside the optimizer does, at once or a few steps in a row
        (a weight divided by 3 at three steps).

        Returns:
            The family of the weights that moved (their counts: the steps the move took), and
            every judged weight's largest recent move (rows, log10 deltas, steps).
        """
        t = self._t
        at = _where(where & np.isfinite(logs))
        ids = layout.ids[at]
        window = self._weights.window
        # The held values newest first: the move against 1, 2, ... recorded steps back.
        back = np.arange(1, window + 1)
        columns = (self._weights.counts(ids)[:, None] - back) % window
        moved = logs[at][:, None] - np.take_along_axis(self._weights.held(ids), columns, 1)
        size = np.abs(moved)
        seen = ~np.isnan(size).all(axis=1)
        # The most recent move past the factor (an edit at one step is that step's move),
        # else the largest.
        limit = math.log10(t.history_factor)
        # A move is judged once the steps it spans were all recorded after the first
        # history_min (a run's first steps move weights the most).
        past = (size >= limit) & (back <= self._steps_seen - t.history_min)
        pick = np.where(past.any(axis=1), past.argmax(axis=1),
                        np.where(np.isnan(size), -1.0, size).argmax(axis=1))
        delta = moved[np.arange(len(at)), pick][seen]
        steps = (pick + 1)[seen]
        self._weights.push(ids, logs[at])
        judged = at[seen]
        if self._steps_seen <= t.history_min:
            empty = np.empty(0, dtype=np.int64)
            return (empty, np.empty(0), empty, judged), (judged, delta, steps)
        new = past.any(axis=1)[seen]
        return (judged[new], delta[new], steps[new], judged), (judged, delta, steps)

    # -- the optimizer stopped moving a layer -------------------------------------------------

    def _stalled_floor(self, rows: StepRows) -> list[Finding]:
        return stalled_floor(self._t, rows, self._layout.parameter, self._layout.ids,
                             self._frozen)

    # -- units that die --------------------------------------------------------------------

    def _dead_units(self, rows: StepRows) -> list[Finding]:
        """``dead`` over the recent window: the last two steps whose zero fraction is known,
        both within ``history_window`` steps, at or above ``dead_fraction``. A gradient that
        is all zero has every unit dead, measured or not."""
        t = self._t
        layout = self._layout
        if not layout.has_activation:
            return []
        zero = np.where(np.isnan(rows.zero_frac) & (rows.norm == 0), 1.0, rows.zero_frac)
        act = _where(layout.activation & (rows.numel > 0) & ~np.isnan(zero))
        if not len(act):
            return []
        fresh = self._zeros.take(rows.step, layout.ids[act], zero[act], layout.unique)
        if not len(fresh):
            return []
        at = act[fresh]
        source = max(at, key=lambda i: (rows.depth[i], rows.layer[i], rows.tensor[i]))
        layer, tensor = str(rows.layer[source]), str(rows.tensor[source])
        if self._events.recent_layer(rows.step, t.history_window) == layer:
            return []  # the units died of an event already reported there (a weight edited)
        below = len(at) - 1
        victims = (f" The gradient of {below} layer(s) below it is zero because of it."
                   if below else "")
        frac = float(np.where(np.isnan(rows.zero_frac[source]), 1.0, rows.zero_frac[source]))
        return [finding(
            Issue.DEAD, Severity.WARNING, rows.step, layer,
            (f"{frac:.0%} of the units of {layer!r} got an all-zero gradient over the whole "
             f"batch at steps {self._zeros.before(layout.ids[source])} and {rows.step}: they "
             f"died and stop learning.{victims} Look for a bias pushed far negative or a "
             "weight update that overshot; try a lower learning rate, LeakyReLU/GELU, or a "
             "normalisation layer before the activation."),
            tensor=tensor, value=frac, threshold=t.dead_fraction, cause=Cause.LAYER)]

    # -- the loss ----------------------------------------------------------------------------


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Replay a recorded run through :class:`History`, step by step."""
    records = evidence.history_rows
    if records.empty:
        return []
    history = History(thresholds)
    columns = {name: records[name].to_numpy() for name in records.columns}
    events = evidence.events
    by_step = (events.groupby("step").indices if len(events) else {})
    event_kinds = events["event"].to_numpy() if len(events) else np.empty(0, dtype=object)
    found: list[Finding] = []
    groups: dict[Any, Any] = records.groupby("step", sort=True).indices
    for step in sorted(groups):
        kinds = event_kinds[by_step[step]] if step in by_step else np.empty(0, dtype=object)
        found += history.observe(StepRows.from_columns(int(step), columns,
                                                       np.asarray(groups[step]), kinds))
    return found


_least, _most = np.minimum.reduce, np.maximum.reduce
"""``a.min()`` and ``a.max()`` of a 1-d array without their Python layers."""


def _where(mask: np.ndarray) -> np.ndarray:
    """The indices where a 1-d mask is true (``np.flatnonzero`` without its Python layers)."""
    return mask.nonzero()[0]
