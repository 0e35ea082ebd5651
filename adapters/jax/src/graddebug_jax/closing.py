"""The host side of a step: the batches the callbacks delivered, turned into records and events
when the step closes.

Callbacks run on the runtime's thread while the user's Python goes on (JAX dispatches
asynchronously), so a close first waits for them (``jax.effects_barrier()``), then fetches the
parcels held from eager code (:mod:`.transport`) in one transfer (:func:`_to_host`), and reads what
arrived. A batch is appended whole, under a lock, so a close never sees half of one.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from graddebug.adapter import StepResult
from graddebug.capture.layers import FailOpen
from graddebug.records import Event, EventKind, Kind, Record, sums_record
from graddebug_jax.outputs import Site
from graddebug_jax.stats import ACT_COLUMNS, FORWARD_NAN, PARAM_COLUMNS, param_rows
from graddebug_jax.transport import Parcel

__all__ = ["INPUT_LAYER", "ParamNamer", "StepRows", "given_rows"]

_ACT = Kind.ACTIVATION.value
_PARAM = Kind.PARAMETER.value
# The columns' order, which the unpacking of rows below relies on.
assert ACT_COLUMNS[:5] == ("sumsq", "total", "absmax", "zero_frac", "pre_sumsq")
assert PARAM_COLUMNS == ("sumsq", "total", "absmax", "weight_sumsq", "update_sumsq", "zero_frac")
_PRESENT, _FORWARD_BAD = ACT_COLUMNS.index("present"), ACT_COLUMNS.index("forward_bad")

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


@functools.cache
def _host_is_device() -> bool:
    """Whether JAX computes on the CPU, where an array's buffer is host memory already."""
    return jax.default_backend() == "cpu"


def _to_host(arrays: list[Any]) -> list[np.ndarray]:
    """The values of device arrays, in one transfer. An accelerator's arrays go through
    ``jax.device_get``, which starts every copy before it waits for one; on the CPU
    ``np.asarray`` reads each buffer where it is, since ``device_get`` there hands each array to
    the runtime's copy thread first, which costs several times the read (see the Performance
    page)."""
    if _host_is_device():
        return [np.asarray(a) for a in arrays]
    return [np.asarray(a) for a in jax.device_get(arrays)]


_JITTED: dict[bool, Any] = {}


def given_rows(leaves: Sequence[Any], full: bool) -> jax.Array:
    """The rows of gradients handed to ``dbg.step(grads)``, on the device: one compiled
    computation, fetched with the step's other parcels."""
    fn = _JITTED.get(full)
    if fn is None:
        fn = _JITTED[full] = jax.jit(lambda xs: param_rows(xs, None, None, full))
    return fn(list(leaves))  # type: ignore[no-any-return]


class StepRows:
    """What the open step's parcels delivered, and the close that turns it into records.

    Args:
        namer: Names a parameter path.
        guard: The adapter's fail-open guard of the close: a bug in landing the parcels or
            building the records loses the step's rows, never the user's training.
    """

    def __init__(self, namer: ParamNamer, guard: FailOpen) -> None:
        self._namer = namer
        self._guard = guard
        self._layers: list[tuple[list[Site], np.ndarray]] = []
        self._params: list[_ParamBatch] = []
        self._inputs: list[tuple[str, str]] = []  # (tensor, "NaN" | "Inf") of bad inputs
        self._held: list[Parcel] = []
        # path -> (layer, tensor, depth, shape text, numel) of a parameter row
        self._named: dict[str, tuple[str, str, int, str, int]] = {}
        self._lock = threading.Lock()
        self.transfers = 0
        """Device-to-host transfers so far: one per callback, one per fetch of held parcels."""

    # -- delivery (the runtime's thread, or the close's fetch) -------------------------------

    def received(self) -> None:
        """Count one transfer (a callback that carried parcels)."""
        with self._lock:
            self.transfers += 1

    def hold(self, parcel: Parcel) -> None:
        """Keep an eager parcel (device arrays) for the close's one fetch."""
        with self._lock:
            self._held.append(parcel)

    def add_layers(self, sites: list[Site], rows: np.ndarray) -> None:
        """A backward pass's chain of layer-output rows."""
        with self._lock:
            self._layers.append((sites, rows))

    def add_params(self, paths: list[str], shapes: list[tuple[int, ...]], rows: np.ndarray
                   ) -> None:
        """An update's (or ``dbg.step(grads)``'s) parameter rows."""
        with self._lock:
            self._params.append(_ParamBatch(paths, shapes, rows))

    def add_inputs(self, labels: Sequence[str], codes: np.ndarray) -> None:
        """The :func:`~.stats.forward_code` of each of the model's inputs in one forward pass,
        aligned with ``labels`` (``args.0``, ``kwargs.x``): a non-zero one is an event."""
        for label, code in zip(labels, np.asarray(codes).ravel(), strict=True):
            if code > 0:
                with self._lock:
                    self._inputs.append((label, "NaN" if code == FORWARD_NAN else "Inf"))

    def _fetch(self) -> None:
        """Land every held parcel, fetched in one transfer."""
        with self._lock:
            held, self._held = self._held, []
        if not held:
            return
        values = _to_host([a for p in held for a in p.arrays])
        self.received()
        at = 0
        for parcel in held:
            n = len(parcel.arrays)
            parcel.land(values[at:at + n])
            at += n

    # -- the close (the user's thread) ------------------------------------------------------

    def pending(self) -> bool:
        """Whether gradient rows arrived, or wait on the device, since the last close (after
        waiting for the callbacks in flight)."""
        jax.effects_barrier()
        with self._lock:
            return bool(self._layers or self._params or any(p.rows for p in self._held))

    def clear(self) -> None:
        """Drop what arrived and what is held (detach, or a step ``every=`` skips)."""
        with self._lock:
            self._layers, self._params, self._inputs, self._held = [], [], [], []

    def close(self, step: int) -> StepResult:
        """The records and events of everything that arrived or was held; then clear. A bug
        in here is an ``internal_error`` and an empty step."""
        with self._guard:
            return self._close(step)
        self.clear()  # what a parcel landed before the bug must not reach the next step
        return StepResult()

    def _close(self, step: int) -> StepResult:
        jax.effects_barrier()
        self._fetch()
        with self._lock:
            layers, params, inputs = self._layers, self._params, self._inputs
            self._layers, self._params, self._inputs = [], [], []
        result = StepResult()
        for tensor, what in dict.fromkeys(inputs):  # a forward traced twice reports once
            result.events.append(Event(step, INPUT_LAYER, tensor, -1,
                                       EventKind.INPUT_NONFINITE.value, what))
        for sites, rows in layers:
            # Python floats first: indexing numpy scalars costs more than the arithmetic.
            for site, row in zip(sites, rows.tolist(), strict=False):
                self._layer_row(step, site, row, result)
        for batch in params:
            for path, shape, row in zip(batch.paths, batch.shapes, batch.rows.tolist(),
                                        strict=True):
                result.records.append(self._param_row(step, path, shape, row))
        return result

    @staticmethod
    def _layer_row(step: int, site: Site, row: list[float], result: StepResult) -> None:
        layer, tensor = site.layer, site.tensor
        depth = layer.depth
        bad = row[_FORWARD_BAD]
        if bad > 0:
            result.events.append(Event(step, layer.name, tensor, depth,
                                       EventKind.FORWARD_NONFINITE.value,
                                       "NaN" if bad == FORWARD_NAN else "Inf"))
        if not site.needs_grad and site.inputs_need_grad:
            result.events.append(Event(step, layer.name, tensor, depth,
                                       EventKind.DETACHED_OUTPUT.value,
                                       "its output needs no gradient although its input does"
                                       " (a jax.lax.stop_gradient inside it?)"))
        if row[_PRESENT] == 0:
            if site.needs_grad:
                result.events.append(Event(step, layer.name, tensor, depth,
                                           EventKind.UNREACHED.value))
            return
        sumsq, total, absmax, zero_frac, pre = row[:5]
        nan = math.isnan(sumsq) or math.isnan(absmax)
        result.records.append(sums_record(
            step, layer.name, tensor, _ACT, depth, site.shape_text, site.numel, _sqrt(sumsq),
            total, absmax, zero_frac, nan, math.isinf(absmax),
            _sqrt(pre) if not math.isnan(pre) else math.nan))

    def _param_row(self, step: int, path: str, shape: tuple[int, ...], row: list[float]
                   ) -> Record:
        named = self._named.get(path)
        if named is None:
            layer, tensor, depth = self._namer(path)
            named = self._named[path] = (layer, tensor, depth, str(tuple(shape)),
                                         math.prod(shape))
        layer, tensor, depth, shape_text, numel = named
        if depth < 0:  # known once a layer of its chain has run forward (never, outputs=False)
            depth = self._namer(path)[2]
            if depth >= 0:
                self._named[path] = (layer, tensor, depth, shape_text, numel)
        sumsq, total, absmax, weight_sumsq, update_sumsq, zero = row
        nan = math.isnan(sumsq)  # a NaN entry makes the sum of squares NaN
        inf = math.isinf(absmax) if not math.isnan(absmax) else math.isinf(sumsq)
        return sums_record(
            step, layer, tensor, _PARAM, depth, shape_text, numel, _sqrt(sumsq), total, absmax,
            zero, nan, inf, math.nan, 0, _sqrt(weight_sumsq), _sqrt(update_sumsq))
