"""From the tensors that changed at one step to one finding that names the source.

When one tensor jumps, the others inherit: the gradient below a layer whose weight was scaled
moves with it, and the next step's gradients follow an update that was too large. One event is
one finding, naming where the change began:

1. when the update/weight ratios of most parameters jumped together (their median moved),
   nobody in particular: the cause is global, the learning rate or the optimizer;
2. else a parameter whose weight norm changed by the jump factor since the last recorded step
   (no optimizer step does that: the weights were edited, reloaded, or scaled by a bug);
3. else the first tensor in backward order (the deepest layer output, then the deepest
   parameter) where the change appears: what comes after it in backward order follows from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graddebug.config import Thresholds
from graddebug.detectors import finding, fmt
from graddebug.detectors._series import median_of
from graddebug.detectors._steprows import StepRows
from graddebug.records import Cause, Finding, Issue, Kind, Severity

__all__ = ["COOLDOWN", "STALL_MARGIN", "STALL_SLACK", "EventBuilder", "Family", "Moves",
           "Sustained", "stalled_floor"]

Family = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""One family's moves at a step: the rows that newly left their baseline, their deltas (log10),
their baselines' sizes, and every judged row."""

Family3 = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Every judged row of a family at one step: row indices, moves (log10), and the steps each
move spans."""

Sustained = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""The sustained shifts that became events at a step (see
:mod:`~graddebug.detectors._sustained`): their rows, their moves against the frozen baselines
(log10), those baselines' sizes, the shifts' first steps, and whether each is a gradient
(else an update/weight ratio)."""

_NO_SHIFT: Sustained = (np.empty(0, dtype=np.int64), np.empty(0), np.empty(0, dtype=np.int64),
                        np.empty(0, dtype=np.int64), np.empty(0, dtype=bool))

_PARAMETER, _ACTIVATION = Kind.PARAMETER.value, Kind.ACTIVATION.value

STALL_MARGIN = 1e3
"""The other layers count as learning, for the ``stalled`` floor, when their median
update/weight ratio is at least this many times the floor."""
STALL_SLACK = 10.0
"""A stall is the optimizer's only where its update is this many times below what its own rule
(the median update per unit of gradient) makes, and that rule clears this many floors."""

COOLDOWN = 3
"""Recorded steps after an event whose new changes belong to it: a learning rate that jumps
moves the updates at one step and, through the weights it ruined, the gradients at the next."""

_ADVICE = {
    Issue.VANISHING: "Look at what changed in it at that step (its weights, a scale, a mask); "
                     "a normalisation after a weight that grew hides it from the loss.",
    Issue.EXPLODING: "Look at what changed in it at that step; gradient clipping bounds the "
                     "damage, a lower learning rate or a normalisation prevents it.",
    Issue.STALLED: "It has stopped learning: a weight far too large in front of a "
                   "normalisation, or a learning rate of its own that fell to 0.",
    Issue.UPDATE_TOO_LARGE: "Check the learning rate (its schedule, a warm restart) and the "
                            "optimizer's state (a reloaded checkpoint, epsilon).",
}


@dataclass
class Moves:
    """The families' moves at one step (see :data:`Family`), the median move of every
    update/weight ratio (log10): where most of them moved together, and the sustained shifts
    that became events."""

    grad: Family
    weight: Family
    ratio: Family
    ratio_shift: float = 0.0
    sustained: Sustained = _NO_SHIFT
    weight_moves: Family3 = (np.empty(0, dtype=np.int64), np.empty(0),
                             np.empty(0, dtype=np.int64))
    """Every judged weight's largest move within the recent steps: rows, log10 deltas, and
    the steps each took."""


class EventBuilder:
    """Turns each step's moves into at most one finding, and remembers the last event.

    Args:
        thresholds: The run's thresholds (``history_factor``).
    """

    def __init__(self, thresholds: Thresholds) -> None:
        self._t = thresholds
        self._last: tuple[int, str, str, Cause] | None = None
        self._shifted = False  # every update/weight ratio has moved away from its baselines

    def build(self, rows: StepRows, moves: Moves) -> list[Finding]:
        """The finding of the event that begins at this step, if one does."""
        limit = math.log10(self._t.history_factor)
        shift = moves.ratio_shift
        if self._shifted and abs(shift) >= limit / 2:
            shift = 0.0  # every ratio is still away from its baselines: the same event
        else:
            self._shifted = abs(shift) >= limit
        abrupt = bool(len(moves.grad[0]) or len(moves.ratio[0]))
        if (not abrupt and not len(moves.weight[0]) and abs(shift) < limit
                and not len(moves.sustained[0])):
            return []
        last = self._last
        if last is not None and rows.step - last[0] <= COOLDOWN:
            return []  # the aftermath of the last event
        if not abrupt and last is not None:
            # a shift that began within the cooldown of the last event is its aftermath
            moves.sustained = _since(moves.sustained, last[0] + COOLDOWN)
        if (not abrupt and not len(moves.weight[0]) and abs(shift) < limit
                and not len(moves.sustained[0])):
            return []
        if shift <= -limit:
            # Every update fell together: a schedule reaching its end (a cosine to 0) or a
            # learning rate set to 0 for the whole model; no layer to name, and no fault of
            # the gradients. What moves in the next steps is its aftermath.
            self._last = (rows.step, "", "", Cause.OPTIMIZER)
            return []
        found = (self._global(rows, moves, shift) if shift >= limit else None) \
            or self._moved_together(rows, moves) or self._edited(rows, moves) \
            or (self._first(rows, moves) if abrupt else self._sustained(rows, moves))
        self._last = (rows.step, found.layer, found.tensor, Cause(found.cause))
        return [found]

    @property
    def shifted(self) -> bool:
        """Every update/weight ratio has moved away from its baselines, and not back yet."""
        return self._shifted

    def recent_source(self, step: int) -> tuple[str, str, str]:
        """The source of an event at this step or the two before: its layer, tensor and a
        clause for a message; the loss itself where there was none."""
        last = self._last
        if last is None or step - last[0] > 2:
            return "loss", "loss", ""
        if not last[1]:
            return "", "", f", after every layer changed together at step {last[0]}"
        return last[1], last[2], f", after {last[1]}.{last[2]} changed at step {last[0]}"

    def recent_layer(self, step: int, within: int) -> str | None:
        """The layer named by an event at most ``within`` steps before ``step``, if any."""
        last = self._last
        return last[1] if last is not None and step - last[0] <= within else None

    def recent_cause(self, step: int) -> Cause:
        """The cause of an event at this step or the two before; else the data (a loss that
        jumps while no tensor did comes from the batch)."""
        last = self._last
        return last[3] if last is not None and step - last[0] <= 2 else Cause.DATA

    # -- the three sources ----------------------------------------------------------------

    def _moved_together(self, rows: StepRows, moves: Moves) -> Finding | None:
        """Most weights changed by the jump factor at once, in several layers: where the
        updates themselves are not known (a tape loop that hands graddebug the gradients
        only), this is how a learning rate that jumped shows."""
        at, delta, _, judged = moves.weight
        layers = set(rows.layer[at])
        if len(layers) < 3 or 2 * len(at) < len(judged):
            return None
        factor = 10 ** float(np.median(np.abs(delta)))
        message = (f"the weights of {len(layers)} layers ({len(at)} of {len(judged)} "
                   f"parameters) changed together at step {rows.step}, by {fmt(factor)}x "
                   "(median) since the step before: no single layer did that. The cause is "
                   "global: " + _ADVICE[Issue.UPDATE_TOO_LARGE])
        return finding(Issue.UPDATE_TOO_LARGE, Severity.WARNING, rows.step, "", message,
                       value=factor, threshold=self._t.history_factor, cause=Cause.OPTIMIZER)

    def _edited(self, rows: StepRows, moves: Moves) -> Finding | None:
        at, delta, steps, _ = moves.weight
        if not len(at):
            return None
        pick = int(np.argmax(np.abs(delta)))
        return self._edit(rows, moves, int(at[pick]), float(delta[pick]), int(steps[pick]))

    def _edit(self, rows: StepRows, moves: Moves, i: int, delta: float, steps: int
              ) -> Finding:
        """The finding of weights (row ``i``) that moved by ``delta`` (log10) over ``steps``
        recorded steps outside the optimizer."""
        layer, tensor = str(rows.layer[i]), str(rows.tensor[i])
        own = _same_tensor(rows, moves.ratio, layer, tensor)
        if own is not None and own < 0:
            issue = Issue.STALLED
        elif len(moves.grad[0]):
            issue = _direction(moves.grad[1], Issue.EXPLODING, Issue.VANISHING)
        elif len(moves.ratio[0]):
            issue = _direction(moves.ratio[1], Issue.UPDATE_TOO_LARGE, Issue.STALLED)
        else:  # a weight far larger than before learns slowly; a far smaller one passes less
            issue = Issue.STALLED if delta > 0 else Issue.VANISHING
        factor = 10 ** abs(delta)
        verb = "grew" if delta > 0 else "shrank"
        span = f"at step {rows.step}" if steps <= 1 else \
            f"over the {steps} recorded steps up to step {rows.step}"
        effect = _effect(rows, moves)
        message = (f"the weights of {layer}.{tensor} {verb} {fmt(factor)}x {span}, faster "
                   "than any optimizer step moves them: they were edited, reloaded or scaled "
                   f"outside the optimizer.{effect} {_ADVICE[issue]}")
        return finding(issue, Severity.WARNING, rows.step, layer, message, tensor=tensor,
                       value=factor, threshold=self._t.history_factor, cause=Cause.LAYER)

    def _global(self, rows: StepRows, moves: Moves, shift: float) -> Finding:
        """Most update/weight ratios jumped together (their median moved by the jump
        factor): the learning rate or the optimizer's state."""
        judged = len(moves.ratio[3])
        factor = 10 ** shift
        message = (f"every layer's update/weight ratio jumped together at step {rows.step}: "
                   f"by {fmt(factor)}x (the median over {judged} parameters) against their own "
                   "recent history. The cause is global, not a layer: "
                   + _ADVICE[Issue.UPDATE_TOO_LARGE])
        return finding(Issue.UPDATE_TOO_LARGE, Severity.WARNING, rows.step, "", message,
                       value=factor, threshold=self._t.history_factor, cause=Cause.OPTIMIZER)

    def _sustained(self, rows: StepRows, moves: Moves) -> Finding:
        return _sustained_finding(self._t, rows, moves.sustained)

    def _first(self, rows: StepRows, moves: Moves) -> Finding:
        at, delta, count, _ = moves.grad
        cause, what = Cause.LAYER, "gradient"
        if not len(at):  # only updates moved: that layer's own learning rate
            at, delta, count, _ = moves.ratio
            cause, what = Cause.OPTIMIZER, "update/weight ratio"
        kinds = rows.kind[at]
        pool = np.flatnonzero(kinds == _ACTIVATION)
        if not len(pool):
            pool = np.arange(len(at))
        pick = pool[int(np.argmax(rows.depth[at[pool]]))]
        i = at[pick]
        if what != "gradient":
            edit = self._weight_behind(rows, moves, int(i), float(delta[pick]))
            if edit is not None:
                return edit
        layer, tensor = str(rows.layer[i]), str(rows.tensor[i])
        up = delta[pick] > 0
        if what == "gradient":
            issue = Issue.EXPLODING if up else Issue.VANISHING
        else:
            issue = Issue.UPDATE_TOO_LARGE if up else Issue.STALLED
        factor = 10 ** abs(float(delta[pick]))
        others = len(at) - 1
        tail = (f" {others} other tensor(s) changed at the same step, after it in backward "
                "order: they follow from it." if others else "")
        message = (f"the {what} at {layer}.{tensor} {'jumped' if up else 'fell'} "
                   f"{fmt(factor)}x at step {rows.step}, against its median of the last "
                   f"{int(count[pick])} steps.{tail} {_ADVICE[issue]}")
        return finding(issue, Severity.WARNING, rows.step, layer, message, tensor=tensor,
                       value=factor, threshold=self._t.history_factor, cause=cause)


    def _weight_behind(self, rows: StepRows, moves: Moves, i: int, ratio: float
                       ) -> Finding | None:
        """An update/weight ratio that moved because its weights did: they moved the other
        way by at least half as much (log10) within the recent steps, which no optimizer step
        does (a weight divided by 3 at each of two steps makes Adam's next update 9x its
        share); None where the update itself moved."""
        rows_at, deltas, steps = moves.weight_moves
        where = np.flatnonzero(rows_at == i)
        if not len(where):
            return None
        moved = float(deltas[where[0]])
        if moved * ratio >= 0 or 2 * abs(moved) < abs(ratio):
            return None
        return self._edit(rows, moves, i, moved, int(steps[where[0]]))


def _sustained_finding(t: Thresholds, rows: StepRows, shifted: Sustained) -> Finding:
    """The finding of sustained shifts: the first in backward order, gradients before
    update/weight ratios (as :meth:`EventBuilder._first`)."""
    at, move, count, start, is_grad = shifted
    pool = np.flatnonzero(is_grad)
    grad = bool(len(pool))
    if not grad:
        pool = np.arange(len(at))
    kinds = rows.kind[at[pool]]
    if (kinds == _ACTIVATION).any():
        pool = pool[kinds == _ACTIVATION]
    pick = pool[int(np.argmax(rows.depth[at[pool]]))]
    i = at[pick]
    layer, tensor = str(rows.layer[i]), str(rows.tensor[i])
    up = move[pick] > 0
    if grad:
        issue = Issue.EXPLODING if up else Issue.VANISHING
        what, cause, limit = "gradient", Cause.LAYER, t.history_sustain_grad_factor
    else:
        issue = Issue.UPDATE_TOO_LARGE if up else Issue.STALLED
        what, cause, limit = "update/weight ratio", Cause.OPTIMIZER, t.history_sustain_factor
    factor = 10 ** abs(float(move[pick]))
    steps = rows.step - int(start[pick]) + 1
    others = len(at) - 1
    tail = (f" {others} other tensor(s) shifted with it." if others else "")
    message = (f"the {what} at {layer}.{tensor} has stayed {fmt(factor)}x "
               f"{'above' if up else 'below'} its median of the {int(count[pick])} steps "
               f"before step {int(start[pick])} for {steps} steps: a sustained shift, not "
               f"drift.{tail} {_ADVICE[issue]}")
    return finding(issue, Severity.WARNING, rows.step, layer, message, tensor=tensor,
                   value=factor, threshold=limit, cause=cause)


def _since(shifted: Sustained, step: int) -> Sustained:
    """The sustained shifts that began after ``step``."""
    keep = shifted[3] > step
    at, move, count, start, is_grad = shifted
    return at[keep], move[keep], count[keep], start[keep], is_grad[keep]


def _direction(delta: np.ndarray, up: Issue, down: Issue) -> Issue:
    """``up`` when the largest move was a jump, else ``down``."""
    return up if delta[int(np.argmax(np.abs(delta)))] > 0 else down


def _same_tensor(rows: StepRows, family: Family, layer: str, tensor: str) -> float | None:
    at, delta, _, _ = family
    for i, d in zip(at, delta, strict=True):
        if rows.layer[i] == layer and rows.tensor[i] == tensor:
            return float(d)
    return None


def _effect(rows: StepRows, moves: Moves) -> str:
    """A clause on what the change did to the gradients and updates."""
    parts = []
    for family, what in ((moves.grad, "gradient"), (moves.ratio, "update/weight ratio")):
        at, delta, _, _ = family
        if not len(at):
            continue
        pick = int(np.argmax(np.abs(delta)))
        where = f"{rows.layer[at[pick]]}.{rows.tensor[at[pick]]}"
        verb = "jumped" if delta[pick] > 0 else "fell"
        count = f" ({len(at)} tensors moved)" if len(at) > 1 else ""
        parts.append(f"the {what} at {where} {verb} {fmt(10 ** abs(float(delta[pick])))}x"
                     f"{count}")
    return (" At that step " + "; ".join(parts) + ".") if parts else ""


def common_move(rows: StepRows, judged: np.ndarray, delta: np.ndarray, *, by_depth: bool
                 ) -> float:
    """What a step did to every series of a family at once (log10).

    For gradients, the move of the gradient next to the loss (the deepest layer output, else
    the deepest parameter): a batch that is harder than the others scales every gradient
    behind the loss with it, while a change inside one layer moves only the gradients that
    its backward feeds, below it, and leaves the one at the loss alone. For update/weight
    ratios, the median move: a learning rate scales every update alike. 0 with fewer than 3
    judged series.
    """
    if len(delta) < 3:
        return 0.0
    if not by_depth:
        return median_of(delta)
    kinds = rows.kind[judged]
    pool = np.flatnonzero(kinds == _ACTIVATION)
    if not len(pool):
        pool = np.arange(len(judged))
    return float(delta[pool[int(np.argmax(rows.depth[judged[pool]]))]])


def stalled_floor(t: Thresholds, rows: StepRows, parameter: np.ndarray, ids: np.ndarray,
                  frozen_ids: np.ndarray) -> list[Finding]:
    """``stalled`` at the floor: parameters whose update/weight ratio is at or below
    ``stall_floor`` while the other layers learn, and while the optimizer's own rule (the
    median update per unit of gradient) would have moved them.

    Args:
        t: The run's thresholds.
        rows: The step.
        parameter: Per row, whether it is a parameter's.
        ids: Per row, its series id.
        frozen_ids: Per series id, reported as stalled (until it moves again); updated here.

    Returns:
        The finding, or nothing.
    """
    if not np.isfinite(rows.update_norm).any():
        return []
    param = parameter & (rows.norm > 0) & np.isfinite(rows.norm) \
        & (rows.weight_norm > 0) & np.isfinite(rows.update_norm)
    if not param.any():
        return []
    ratio = np.where(param, rows.update_norm / np.where(param, rows.weight_norm, 1.0), np.nan)
    frozen = param & (ratio <= t.stall_floor)
    learning = param & ~frozen
    frozen_ids[ids[learning]] = False
    if not frozen.any() or not learning.any():
        return []
    if median_of(ratio[learning]) < t.stall_floor * STALL_MARGIN:
        return []
    fresh = np.flatnonzero(frozen & ~frozen_ids[ids])
    # An update that small because the gradient is (a vanishing layer, a bias before a
    # normalisation) is the gradient's own finding, or none: not the optimizer's fault.
    rule = median_of(rows.update_norm[learning] / rows.norm[learning]) * rows.norm[fresh]
    fresh = fresh[(rows.update_norm[fresh] * STALL_SLACK < rule)
                  & (rule > rows.weight_norm[fresh] * t.stall_floor * STALL_SLACK)]
    if not len(fresh):
        return []
    frozen_ids[ids[fresh]] = True
    keys = [(str(rows.layer[i]), str(rows.tensor[i])) for i in fresh]
    pick = max(range(len(fresh)), key=lambda k: (rows.depth[fresh[k]], keys[k]))
    source = fresh[pick]
    layer, tensor = keys[pick]
    others = len({key[0] for key in keys}) - 1
    also = f" ({others} other layer(s) too)" if others > 0 else ""
    return [finding(
        Issue.STALLED, Severity.WARNING, rows.step, layer,
        (f"the optimizer did not move {layer}.{tensor} at step {rows.step}{also}: its "
         f"update/weight ratio is {ratio[source]:.1e} while its gradient is "
         f"{rows.norm[source]:.2g} and the other layers' median ratio is "
         f"{median_of(ratio[learning]):.1e}. It has stopped learning: check its "
         "parameter group's learning rate, and that the optimizer holds it."),
        tensor=tensor, value=float(ratio[source]), threshold=t.stall_floor,
        cause=Cause.OPTIMIZER)]
