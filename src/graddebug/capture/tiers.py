"""Tiered statistics: which recorded steps measure every statistic of layer-output gradients.

Every recorded step measures each layer-output gradient's sentinel: its sum of squares and its
sum, which give the norm, the mean, the standard deviation, and whether it holds NaN or Inf.
The per-unit extremes behind ``absmax`` and ``zero_frac`` cost two more passes over every
gradient, the largest part of graddebug's work on models with large activations, so they are
measured on one recorded step in ``full_stats_every`` only, and on the recorded step after a
sentinel looked unusual:

- a layer-output gradient was NaN or Inf;
- a layer output's norm moved by more than :data:`JUMP` times (either way) from its norm at the
  last step that measured everything.

With ``every=`` greater than 1 every recorded step measures everything: recorded steps are then
rare already. On the other steps, ``absmax`` and ``zero_frac`` of layer-output rows are NaN.
"""

from __future__ import annotations

import math

from graddebug.adapter import StepResult
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
    """

    def __init__(self, every: int, full_every: int) -> None:
        self.full_every = 1 if every > 1 else full_every
        self._armed = False
        self._reference: dict[tuple[str, str], float] = {}

    def full(self, step: int) -> bool:
        """Whether recorded step ``step`` measures every statistic of layer outputs."""
        return self._armed or step % self.full_every == 0

    def after(self, step: int, result: StepResult) -> None:
        """Read the rows of recorded step ``step``: a full step sets the reference norms; an
        unusual sentinel makes the next recorded step full."""
        if self.full_every == 1:
            return
        reference = self._reference
        if self.full(step):
            self._armed = False
            for r in result.records:
                if r.kind == _ACTIVATION and math.isfinite(r.norm):
                    reference[(r.layer, r.tensor)] = r.norm
            return
        for r in result.records:
            if r.kind != _ACTIVATION:
                continue
            norm = r.norm
            if not math.isfinite(norm):
                self._armed = True
                return
            before = reference.get((r.layer, r.tensor))
            if before is not None and (norm > JUMP * before or before > JUMP * norm):
                self._armed = True
                return
