"""The host side of a step: the batches the callbacks delivered, turned into records and events
when the step closes.

Callbacks run on the runtime's thread while the user's Python goes on (JAX dispatches
asynchronously), so a close first waits for them (``jax.effects_barrier()``, the one
synchronisation of a step) and then reads what arrived. A batch is appended whole, so a close
never sees half of one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from graddebug.adapter import StepResult
from graddebug.records import Event, EventKind, Kind, Record, sums_record
from graddebug_jax.sites import Site
from graddebug_jax.stats import ACT_COLUMNS, FORWARD_NAN, PARAM_COLUMNS, param_rows

__all__ = ["INPUT_LAYER", "ParamNamer", "StepRows", "given_rows"]

_ACT = Kind.ACTIVATION.value
_PARAM = Kind.PARAMETER.value
_A = {name: i for i, name in enumerate(ACT_COLUMNS)}
_P = {name: i for i, name in enumerate(PARAM_COLUMNS)}

INPUT_LAYER = "input"
"""The ``layer`` of the events of the model's inputs, as in the other adapters."""

ParamNamer = Callable[[str], tuple[str, str, int]]
"""``namer(path) -> (layer, tensor, depth)`` of a parameter row."""


@dataclass
class _ParamBatch:
    paths: list[str]
    shapes: list[tuple[int, ...]]
    rows: np.ndarray


def _sqrt(value: float) -> float:
    return math.sqrt(value) if value >= 0 or math.isnan(value) else math.nan


_JITTED: dict[bool, Any] = {}


def given_rows(leaves: Sequence[Any], full: bool) -> np.ndarray:
    """The rows of gradients handed to ``dbg.step(grads)``: one compiled computation and one
    transfer."""
    fn = _JITTED.get(full)
    if fn is None:
        fn = _JITTED[full] = jax.jit(lambda xs: param_rows(xs, None, None, full))
    return np.asarray(fn(list(leaves)))


class StepRows:
    """What the open step's callbacks delivered, and the close that turns it into records.

    Args:
        namer: Names a parameter path.
    """

    def __init__(self, namer: ParamNamer) -> None:
        self._namer = namer
        self._layers: list[tuple[list[Site], np.ndarray]] = []
        self._params: list[_ParamBatch] = []
        self._inputs: list[tuple[str, str]] = []  # (tensor, "NaN" | "Inf") of bad inputs
        self.transfers = 0
        """Batches delivered to the host so far (each one a device-to-host transfer)."""

    # -- delivery (the runtime's thread) ----------------------------------------------------

    def add_layers(self, sites: list[Site], rows: np.ndarray) -> None:
        """A backward pass's chain of layer-output rows."""
        self._layers.append((sites, rows))
        self.transfers += 1

    def add_params(self, paths: list[str], shapes: list[tuple[int, ...]], rows: np.ndarray,
                   transfer: bool = True) -> None:
        """An update's (or ``dbg.step(grads)``'s) parameter rows."""
        self._params.append(_ParamBatch(paths, shapes, rows))
        self.transfers += int(transfer)

    def add_inputs(self, labels: Sequence[str], codes: np.ndarray) -> None:
        """The model's inputs of a forward pass in which one held NaN or Inf: each input's
        :func:`~.stats.forward_code`, aligned with ``labels`` (``args.0``, ``kwargs.x``)."""
        self.transfers += 1
        for label, code in zip(labels, np.asarray(codes).ravel(), strict=True):
            if code > 0:
                self._inputs.append((label, "NaN" if code == FORWARD_NAN else "Inf"))

    # -- the close (the user's thread) ------------------------------------------------------

    def pending(self) -> bool:
        """Whether anything arrived since the last close (after waiting for the callbacks)."""
        jax.effects_barrier()
        return bool(self._layers or self._params)

    def clear(self) -> None:
        """Drop what arrived (detach, or a step ``every=`` skips)."""
        self._layers, self._params, self._inputs = [], [], []

    def close(self, step: int) -> StepResult:
        """The records and events of everything that arrived; then clear."""
        jax.effects_barrier()
        layers, params, inputs = self._layers, self._params, self._inputs
        self.clear()
        result = StepResult()
        for tensor, what in dict.fromkeys(inputs):  # a forward traced twice reports once
            result.events.append(Event(step, INPUT_LAYER, tensor, -1,
                                       EventKind.INPUT_NONFINITE.value, what))
        for sites, rows in layers:
            for site, row in zip(sites, rows, strict=False):
                self._layer_row(step, site, row, result)
        for batch in params:
            for path, shape, row in zip(batch.paths, batch.shapes, batch.rows, strict=True):
                result.records.append(self._param_row(step, path, shape, row))
        return result

    @staticmethod
    def _layer_row(step: int, site: Site, row: np.ndarray, result: StepResult) -> None:
        layer, tensor = site.layer, site.tensor
        depth = layer.depth
        if row[_A["forward_bad"]] > 0:
            what = "NaN" if row[_A["forward_bad"]] == FORWARD_NAN else "Inf"
            result.events.append(Event(step, layer.name, tensor, depth,
                                       EventKind.FORWARD_NONFINITE.value, what))
        if not site.needs_grad and site.inputs_need_grad:
            result.events.append(Event(step, layer.name, tensor, depth,
                                       EventKind.DETACHED_OUTPUT.value,
                                       "its output needs no gradient although its input does"
                                       " (a jax.lax.stop_gradient inside it?)"))
        if row[_A["present"]] == 0:
            if site.needs_grad:
                result.events.append(Event(step, layer.name, tensor, depth,
                                           EventKind.UNREACHED.value))
            return
        sumsq, absmax = float(row[_A["sumsq"]]), float(row[_A["absmax"]])
        nan = math.isnan(sumsq) or math.isnan(absmax)
        pre = float(row[_A["pre_sumsq"]])
        result.records.append(sums_record(
            step, layer.name, tensor, _ACT, depth, str(site.shape), site.numel, _sqrt(sumsq),
            float(row[_A["total"]]), absmax, float(row[_A["zero_frac"]]), nan,
            math.isinf(absmax), _sqrt(pre) if not math.isnan(pre) else math.nan))

    def _param_row(self, step: int, path: str, shape: tuple[int, ...], row: np.ndarray
                   ) -> Record:
        layer, tensor, depth = self._namer(path)
        sumsq, absmax = float(row[_P["sumsq"]]), float(row[_P["absmax"]])
        nan = math.isnan(sumsq)  # a NaN entry makes the sum of squares NaN
        inf = math.isinf(absmax) if not math.isnan(absmax) else math.isinf(sumsq)
        numel = int(np.prod(shape)) if shape else 1
        return sums_record(
            step, layer, tensor, _PARAM, depth, str(tuple(shape)), numel, _sqrt(sumsq),
            float(row[_P["total"]]), absmax, math.nan, nan, inf, math.nan, 0,
            _sqrt(float(row[_P["weight_sumsq"]])), _sqrt(float(row[_P["update_sumsq"]])))
