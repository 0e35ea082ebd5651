"""The configurations of ``overhead_torch.py``: each way of watching the watched twin, and the
stand-ins that take a Watcher's place in the configs without graddebug (the peer (d), the
floors (f) and (g), the null (n)).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

import graddebug
from graddebug_torch.outputs import KEEPS_FINITE, flatten, watched_by_default
from graddebug_torch.stats import DotSums

__all__ = ["CONFIGS", "Config", "make_watcher"]

# The options that stand for a config without graddebug, each taken by a stand-in.
_STAND_IN_OPTIONS = frozenset({"anomaly", "floor", "outputs_floor", "null"})


@dataclass(frozen=True)
class Config:
    """One way of watching a model.

    Attributes:
        key: Short name used on the command line and in the JSON.
        label: What it records, for the table.
        options: Keyword options of ``graddebug.watch``.
        target: The largest acceptable median ratio of step times, watched over plain.
    """

    key: str
    label: str
    options: dict[str, Any]
    target: float

    @property
    def every(self) -> int:
        """One step in this many is recorded."""
        every: int = self.options.get("every", 1)
        return every

    def watch_options(self) -> dict[str, Any] | None:
        """The options of ``graddebug.watch``, or None for a config without graddebug.

        Returns:
            ``options``, or None for (d), (f), (g) and (n).
        """
        return None if _STAND_IN_OPTIONS & self.options.keys() else self.options


CONFIGS: tuple[Config, ...] = (
    Config("a", "(a) params", {"outputs": False}, 1.05),
    Config("b", "(b) params+outputs", {}, 1.15),
    Config("c", "(c) = (b), every 10th", {"every": 10}, 1.03),
    # Op-level capture must stay below detect_anomaly (d), the peer that names the op behind a
    # NaN: (d) measured 1.34x-1.73x here, 1.34x on the CNN. (d) itself is not judged.
    Config("o", "(o) = (b) + ops=True", {"ops": True}, 1.34),
    Config("d", "(d) torch.autograd.detect_anomaly(), no graddebug", {"anomaly": True},
           math.inf),
    # The floor of parameter capture: what any tool must do at least, one fused norm pass over
    # the parameter gradients and one host sync. (a) is judged by its distance to it.
    Config("f", "(f) floor: one _foreach_norm pass, no graddebug", {"floor": True}, math.inf),
    # The floor of output capture: (f), and the sentinel of every output (b) records, taken by
    # hand-written hooks with graddebug's own reductions. (b)'s distance to it is graddebug's
    # bookkeeping; the floor's own distance to (f) is what hooks and reductions cost.
    Config("g", "(g) floor of (b): (f) + hand-written output hooks, no graddebug",
           {"outputs_floor": True}, math.inf),
    # The method's own reading of a monitor that costs nothing: both twins plain.
    Config("n", "(n) null: both twins plain, no graddebug", {"null": True}, math.inf),
)


class _StandIn:
    """Stands for a Watcher in the configs without graddebug: entered once around a round on
    the watched twin, ``step()`` after each backward pass, and no rows or findings."""

    every = 1

    def __enter__(self) -> _StandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def per_step(self) -> contextlib.AbstractContextManager[object]:
        """A context around each watched step; none here."""
        return contextlib.nullcontext()

    def step(self) -> None:
        """Nothing to close."""

    def frame(self) -> list[object]:
        return []

    def findings(self) -> list[object]:
        return []


class _Null(_StandIn):
    """Config (n): the watched twin runs plain too. Its ratio is the method's own bias and
    noise, what a perfect monitor that costs nothing would read."""


class _Anomaly(_StandIn):
    """Config (d): ``torch.autograd.detect_anomaly()``, the peer that names the op behind a
    NaN, for comparison. Anomaly mode is global, so it is set around each watched step only,
    never around the plain twin's steps in between."""

    def per_step(self) -> contextlib.AbstractContextManager[object]:
        """Anomaly mode around one watched step."""
        return torch.autograd.detect_anomaly(check_nan=True)


class _Floor(_StandIn):
    """Config (f): after each backward pass, the norms of every parameter gradient in one
    ``torch._foreach_norm`` pass, read to the host in one sync."""

    def __init__(self, model: nn.Module) -> None:
        self._params = [p for p in model.parameters() if p.requires_grad]

    def step(self) -> list[float]:
        """Measure the parameter gradients, as the cheapest parameter capture would.

        Returns:
            The norms, in parameter order.
        """
        return self._read([])

    def _read(self, scalars: list[Tensor]) -> list[float]:
        """The parameter gradients' norms, then ``scalars``, in one sync."""
        grads = [p.grad for p in self._params if p.grad is not None]
        values: list[float] = torch.cat([torch.stack(torch._foreach_norm(grads)),
                                         *([torch.stack(scalars)] if scalars else [])]).tolist()
        return values


class _OutputsFloor(_Floor):
    """Config (g): (f), and what (b) measures of layer outputs on a step that is not full, by
    hand: a forward hook on each module (b) watches (leaf modules and those with parameters of
    their own) hooks the gradient of each floating output that needs one, for its sum of
    squares and its sum, and sums the output itself where the module could make a NaN or Inf
    (graddebug's forward check). The reductions are graddebug's (``DotSums``); no rows, no
    records, one sync with (f)'s norms."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._modules = [m for m in model.modules() if watched_by_default(m)]
        self._sums = DotSums()
        self._handles: list[RemovableHandle] = []
        self._scalars: list[Tensor] = []

    def __enter__(self) -> _OutputsFloor:
        self._handles = [m.register_forward_hook(self._forward) for m in self._modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._scalars.clear()

    def _forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for _, tensor in flatten(output):  # the outputs (b) watches
            if not (tensor.is_floating_point() and tensor.requires_grad):
                continue
            if type(module) not in KEEPS_FINITE:
                self._scalars.append(self._sums.total(tensor.detach()))
            tensor.register_hook(self._backward)

    def _backward(self, grad: Tensor) -> None:
        self._scalars += self._sums.sentinel(grad)

    def step(self) -> list[float]:
        """Read the parameter gradients' norms and the outputs' sums in one sync.

        Returns:
            The norms in parameter order, then each forward sum and each gradient's sum of
            squares and sum, in the order they were taken.
        """
        values = self._read(self._scalars)
        self._scalars = []
        return values


def make_watcher(model: nn.Module, config: Config) -> Any:
    """The watcher of ``config`` for ``model``, not entered.

    Args:
        model: The watched twin's model.
        config: The configuration.

    Returns:
        ``graddebug.watch(model, **config.options)``, or for a config without graddebug its
        stand-in, which enters, steps and reports (no rows, no findings) as a Watcher does.
    """
    if config.options.get("null"):
        return _Null()
    if config.options.get("anomaly"):
        return _Anomaly()
    if config.options.get("floor"):
        return _Floor(model)
    if config.options.get("outputs_floor"):
        return _OutputsFloor(model)
    return graddebug.watch(model, **config.options)
