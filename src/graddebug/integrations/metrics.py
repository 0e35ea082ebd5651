"""What the training callbacks log through their host, at the host's cadence.

A callback adds each recorded step to an :class:`IntervalMetrics` and takes the metrics out
when its host logs (the Trainer's ``logging_steps``, Lightning's ``log_every_n_steps``, the
``logs`` of a Keras epoch). Each metric comes as its latest value and as its maximum over the
steps since the last log (``.../max``), so that a spike between two logs is not lost. The
default set is compact, a few numbers a layer:

- ``graddebug/grad_norm``: the norm of all parameter gradients together, before any clip by
  the host (the Trainer's own ``grad_norm``);
- ``graddebug/grad_norm/<layer>``: the norm of each layer's parameter gradients together;
- ``graddebug/update_ratio/<layer>``: each layer's update/weight ratio, ``||update|| /
  ||weights||`` over its parameters, once the optimizer has stepped;
- ``graddebug/findings``: how many findings the steps since the last log brought.

``every_tensor=True`` adds ``graddebug/norm/<layer>.<tensor>`` for every recorded tensor
(layer outputs included). Nothing here imports a framework.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from graddebug.records import Kind, Record

__all__ = ["IntervalMetrics", "step_metrics"]

_PARAMETER, _LOSS = Kind.PARAMETER.value, Kind.LOSS.value
PREFIX = "graddebug"


def _root_sum(squares: float) -> float:
    return math.sqrt(squares) if squares >= 0 else math.nan


def step_metrics(records: Iterable[Record], *, every_tensor: bool = False) -> dict[str, float]:
    """The metrics of one recorded step, without their maxima.

    Args:
        records: The step's rows.
        every_tensor: Add the norm of every recorded tensor.
    """
    total = 0.0
    grads: dict[str, float] = {}
    weights: dict[str, float] = {}
    updates: dict[str, float] = {}
    tensors: dict[str, float] = {}
    seen = False
    for r in records:
        if r.kind == _LOSS:
            continue
        if every_tensor:
            tensors[f"{PREFIX}/norm/{r.layer}.{r.tensor}"] = r.norm
        if r.kind != _PARAMETER:
            continue
        seen = True
        square = r.norm * r.norm
        total += square
        grads[r.layer] = grads.get(r.layer, 0.0) + square
        if math.isfinite(r.weight_norm) and math.isfinite(r.update_norm):
            weights[r.layer] = weights.get(r.layer, 0.0) + r.weight_norm * r.weight_norm
            updates[r.layer] = updates.get(r.layer, 0.0) + r.update_norm * r.update_norm
    out: dict[str, float] = {}
    if seen:
        out[f"{PREFIX}/grad_norm"] = _root_sum(total)
    for layer, square in grads.items():
        out[f"{PREFIX}/grad_norm/{layer}"] = _root_sum(square)
    for layer, square in updates.items():
        weight = weights[layer]
        if weight > 0:
            out[f"{PREFIX}/update_ratio/{layer}"] = math.sqrt(square / weight)
    out.update(tensors)
    return out


def _larger(a: float, b: float) -> float:
    """The larger of two values; NaN wins, so that a non-finite step shows in the maximum."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a if a >= b else b


class IntervalMetrics:
    """The metrics of the steps since the host last logged.

    Args:
        every_tensor: Log the norm of every recorded tensor too.
    """

    def __init__(self, *, every_tensor: bool = False) -> None:
        self.every_tensor = every_tensor
        self._latest: dict[str, float] = {}
        self._max: dict[str, float] = {}
        self._findings = 0
        self._steps = 0

    @property
    def steps(self) -> int:
        """How many recorded steps came since the last :meth:`take`."""
        return self._steps

    def add(self, records: Iterable[Record], findings: int = 0) -> None:
        """Take one recorded step: its rows and the number of findings it brought."""
        latest = step_metrics(records, every_tensor=self.every_tensor)
        top = self._max
        for key, value in latest.items():
            top[key] = _larger(top[key], value) if key in top else value
        self._latest.update(latest)
        self._findings += findings
        self._steps += 1

    def take(self) -> dict[str, float]:
        """The metrics to log now (empty when no step came since the last call); starts the
        next interval."""
        if not self._steps:
            return {}
        out: dict[str, float] = {}
        for key, value in self._latest.items():
            out[key] = value
            out[f"{key}/max"] = self._max[key]
        out[f"{PREFIX}/findings"] = float(self._findings)
        self._latest, self._max, self._findings, self._steps = {}, {}, 0, 0
        return out
