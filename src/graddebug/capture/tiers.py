"""Tiered statistics: which recorded steps measure every statistic of layer-output gradients.

Every recorded step measures each layer-output gradient's sentinel: its sum of squares and its
sum, which give the norm, the mean, the standard deviation, and whether it holds NaN or Inf.
The per-unit extremes behind ``absmax`` and ``zero_frac`` cost two more passes over every
gradient, the largest part of graddebug's work on models with large activations, so they are
measured on one recorded step in ``full_stats_every`` only, and on the recorded step after a
sentinel looked unusual:

- a layer-output gradient was NaN or Inf;
- a layer output's norm moved by more than :data:`JUMP` times (either way) from its norm at the
  last step that measured everything;
- units died: a 1-D parameter's ``zero_frac`` (a bias's entries whose gradient is exactly 0,
  measured on every recorded step: a unit that got no gradient from the whole batch gives its
  bias none) reached ``dead_fraction`` on this step and had not on the last, or a full step
  found a layer output's units dead that were not at the full step before. Units that die
  mid-run are then measured on the next two recorded steps, which the ``dead`` rule needs.

With ``every=`` greater than 1 every recorded step measures everything: recorded steps are then
rare already. On the other steps, ``absmax`` and ``zero_frac`` of layer-output rows are NaN.
"""

from __future__ import annotations

import math

from graddebug.adapter import StepResult
from graddebug.config import Thresholds
from graddebug.records import Kind

__all__ = ["JUMP", "StatTiers"]

JUMP = 10.0
"""How far (a factor, up or down) a layer output's norm may move from its norm at the last full
step before the next recorded step measures everything."""

_ACTIVATION = Kind.ACTIVATION.value


class StatTiers:
    """Decides, for each recorded step, whether layer outputs get every statistic.

    Args:
        every: The watch's ``every=``; above 1, every recorded step is full.
        full_every: The watch's ``full_stats_every=``: one recorded step in this many is
            full (1: all of them).
        dead_fraction: The fraction of dead units that arms the next step
            (:attr:`~graddebug.config.Thresholds.dead_fraction`).
    """

    def __init__(self, every: int, full_every: int,
                 dead_fraction: float = Thresholds.dead_fraction) -> None:
        self.full_every = 1 if every > 1 else full_every
        self._dead = dead_fraction
        self._armed = False
        self._reference: dict[tuple[str, str], float] = {}
        self._zeroed: set[tuple[str, str]] = set()  # rows whose zero_frac was >= dead

    def full(self, step: int) -> bool:
        """Whether recorded step ``step`` measures every statistic of layer outputs."""
        return self._armed or step % self.full_every == 0

    def after(self, step: int, result: StepResult) -> None:
        """Read the rows of recorded step ``step``: a full step sets the reference norms; an
        unusual sentinel, or units that died, make the next recorded step full."""
        if self.full_every == 1:
            return
        reference, zeroed, dead = self._reference, self._zeroed, self._dead
        full = self.full(step)
        armed = unusual = False
        for r in result.records:
            zero = r.zero_frac
            if zero == zero:  # measured: a 1-D parameter's always, an output's on full steps
                key = (r.layer, r.tensor)
                if zero < dead:
                    zeroed.discard(key)
                elif key not in zeroed:
                    zeroed.add(key)
                    armed = True
            if r.kind != _ACTIVATION:
                continue
            norm = r.norm
            if full:  # the reference of the sentinels to come
                if math.isfinite(norm):
                    reference[(r.layer, r.tensor)] = norm
            elif not unusual:
                before = reference.get((r.layer, r.tensor))
                unusual = not math.isfinite(norm) or (before is not None and (
                    norm > JUMP * before or before > JUMP * norm))
        self._armed = armed or unusual
