"""``graddebug_jax.monitor(inner)``: an optax transformation that records the gradients it is
handed, the weights they were taken at and the updates ``inner`` makes of them, and changes
nothing.

It wraps ``inner`` as optax's own wrappers do (``optax.apply_if_finite``,
``optax.MultiSteps``): its state is a :class:`MonitorState`, ``inner``'s state and the
statistics of the last update. Bind it to a Watcher with ``graddebug.watch(model,
optimizer=tx)``; unbound, it measures nothing. Its statistics are computed inside the
compiled step, and its update is the step's carrier (:mod:`.transport`). Where the
``nnx.Optimizer`` that holds its state is known (``watch(optimizer=<the nnx.Optimizer>)``
names it: :meth:`Monitor.adopt`), the parameter rows and
every parcel waiting beside them in the trace (the backward pass's layer-output rows, the
input check) leave the step as that state, which ``nnx.jit`` writes back without waiting: no
host callback, which would make the step run synchronously (measured in :mod:`.transport`); the
close fetches them (:meth:`Monitor.collect`). The state's room for them is fixed when the
optimizer is built, before the model is traced (:func:`extra_size`), so that the step never
retraces for it; a trace whose parcels do not fit, a chain of more layer outputs than the
room holds, sends them as it does elsewhere (a plain optax loop that keeps the state itself,
or ``watch(optimizer=tx)``, which does not say who keeps it): in one callback per update.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from graddebug_jax.model import path_name
from graddebug_jax.stats import ACT_COLUMNS, PARAM_COLUMNS, param_rows
from graddebug_jax.transport import Land, Parcel, Transport

__all__ = ["Monitor", "MonitorState", "extra_size", "monitor", "monitor_of"]

EXTRA = 64
"""Room in :attr:`MonitorState.extra`, beyond the layer-output rows', for the parcels that
travel with the parameter rows (the input check's codes, one per input of the model)."""

LAYER_ROOM = 32
"""Layer-output rows :attr:`MonitorState.extra` holds beyond two per parameter: a Flax layer
owns one or two parameters and a container none, so that a model whose layers own parameters
fits with room to spare; one of many parameter-free modules (dropout, activations) may not,
and sends its rows by callback."""


def extra_size(count: int) -> int:
    """The length of :attr:`MonitorState.extra` for ``count`` parameters: the layout key, room
    for ``2 * count + LAYER_ROOM`` layer-output rows, and :data:`EXTRA`."""
    return 1 + len(ACT_COLUMNS) * (2 * count + LAYER_ROOM) + EXTRA


class MonitorState(NamedTuple):
    """The state of a :func:`monitor` transformation.

    Attributes:
        inner: ``inner``'s state.
        rows: The last stored update's parameter rows, ``(parameters, 6)`` float32 (zeros
            before the first; an update that sent its rows by callback leaves them).
        extra: The other statistics of the last update's step, flattened into
            :func:`extra_size` float32 values: first the key of their layout (0: none stored,
            they went by callback), then each parcel's arrays.
    """

    inner: Any
    rows: Any
    extra: Any

ParamSink = Callable[[list[str], np.ndarray], None]
"""Where an update's rows go on the host: ``sink(paths, rows)``."""


class Monitor:
    """The state behind one :func:`monitor` transformation: the inner transformation and the
    Watcher it reports to, if bound.

    Args:
        inner: The optax transformation whose updates are measured.
    """

    def __init__(self, inner: optax.GradientTransformation) -> None:
        self.inner = optax.with_extra_args_support(inner)
        self.sink: ParamSink | None = None
        self.full = False
        self.transport: Transport | None = None
        self.keeper: weakref.ref[Any] | None = None
        """The ``nnx.Optimizer`` that keeps this transformation's state, named by the user
        (:meth:`adopt`): the close reads the state from it."""
        self.nnx_kept = False
        """Whether ``init`` was handed an ``nnx.State``, as an ``nnx.Optimizer`` hands it: the
        state is then some NNX object's, which ``nnx.jit`` writes back and traces again on
        entering and leaving a ``watch`` block (the model's graph changes)."""
        self.layout: list[_Stored] | None = None
        """Where the last trace stored its parcels in the state (None: it sent them)."""
        self._layouts: dict[int, list[_Stored]] = {}
        """The layouts of the traces that stored, by the key each writes first in ``extra``:
        several compiled versions of a step (other shapes) may run in turn."""
        self._seen: Any = None
        self.silent = False
        """Whether an update was traced with no Watcher bound and measures nothing."""

    def bind(self, sink: ParamSink | None, full: bool = False, transport: Transport | None = None
             ) -> None:
        """Report to ``sink`` from now on (None: to nobody), through ``transport``; ``full``
        also measures each gradient's mean and absolute maximum."""
        self.sink, self.full, self.transport = sink, full, transport
        stored = self._stored()
        self._seen = stored[0] if stored is not None else None  # older rows are not news

    def adopt(self, optimizer: Any) -> None:
        """Read the statistics from ``optimizer``'s state: the ``nnx.Optimizer`` built on this
        transformation, handed to ``watch(optimizer=...)``. Nothing else says which object
        keeps a transformation's state; without it the statistics go by callback
        (:attr:`.transport.Route.TIED`)."""
        self.keeper = weakref.ref(optimizer)
        self.nnx_kept = True

    def _keeper(self) -> Any:
        """The ``nnx.Optimizer`` that keeps this transformation's state, if known and alive."""
        return self.keeper() if self.keeper is not None else None

    def _land(self, paths: list[str], values: Any) -> None:
        sink = self.sink  # read when the step runs: one compiled step serves any binding
        if sink is not None:
            sink(paths, np.asarray(values))

    def init(self, params: Any) -> MonitorState:
        """``inner``'s state and room for the statistics."""
        self.nnx_kept = self.nnx_kept or isinstance(params, nnx.State)
        count = len(jax.tree_util.tree_leaves(params))
        return MonitorState(self.inner.init(params),
                            jnp.zeros((count, len(PARAM_COLUMNS)), jnp.float32),
                            jnp.zeros((extra_size(count),), jnp.float32))

    def update(self, updates: Any, state: MonitorState, params: Any = None, **extra: Any
               ) -> tuple[Any, MonitorState]:
        """``inner``'s update, bit for bit; the parameter rows and the parcels waiting in the
        trace stored in the state or sent in one callback."""
        new_updates, new_inner = self.inner.update(updates, state.inner, params, **extra)
        if self.transport is None:
            traced = any(isinstance(leaf, jax.core.Tracer)
                         for leaf in jax.tree_util.tree_leaves(updates))
            if not traced or self.nnx_kept:
                # No Watcher bound: measure nothing, eager (a later binding hears of the next
                # step) or for an nnx.Optimizer (entering watch(model) changes the model's
                # graph, so nnx.jit traces the step again). The callback below would make
                # every step after the with block synchronous: 1.8x the plain step.
                self.silent = self.silent or traced
                return new_updates, MonitorState(new_inner, state.rows,
                                                 jnp.zeros_like(state.extra))
        with_paths, _ = jax.tree_util.tree_flatten_with_path(updates)
        paths = [path_name(path) for path, _ in with_paths]
        grads = [leaf for _, leaf in with_paths]
        applied = jax.tree_util.tree_leaves(new_updates)
        weights = jax.tree_util.tree_leaves(params) if params is not None else None
        if weights is not None and len(weights) != len(grads):
            weights = None
        rows = param_rows(grads, applied if len(applied) == len(grads) else None, weights,
                          self.full)

        transport = self.transport
        if transport is None:  # a plain optax loop traced unbound: a later binding hears of it,
            self.layout = None  # by Route.EFFECT (no transport: the monitor lands the rows)
            jax.debug.callback(lambda values: self._land(paths, values), rows)
            return new_updates, MonitorState(new_inner, state.rows, jnp.zeros_like(state.extra))
        parcel = Parcel([rows], lambda values: self._land(paths, values[0]))
        stored = self._store(transport, parcel, rows.shape == state.rows.shape,
                             int(jnp.size(state.extra)))
        if stored is not None:
            return new_updates, MonitorState(new_inner, rows, stored)
        # Sent: key 0 tells the close that this step's state holds nothing new.
        return new_updates, MonitorState(transport.gather(parcel, new_inner), state.rows,
                                         jnp.zeros_like(state.extra))

    def _store(self, transport: Transport, own: Parcel, fits: bool, room: int) -> Any:
        """The ``extra`` of the state that carries ``own``'s trace's other parcels (``own`` is
        the state's ``rows``), their layout recorded under the key it starts with, where
        :attr:`.transport.Route.STATE` is the route; None where they go by callback (eager,
        no known optimizer keeps the state, or they do not fit)."""
        if self._keeper() is None or not fits or not own.traced:
            self.layout = None
            return None
        others = transport.take_trace()
        flat = [jnp.ravel(a).astype(jnp.float32) for p in others for a in p.arrays]
        size = 1 + sum(int(f.size) for f in flat)
        if size > room:
            for parcel in others:  # back to waiting: the callback takes them
                transport.post(parcel)
            self.layout = None
            return None
        transport.route([own, *others], fits_state=True)
        self.layout = [_Stored(p.land, [(tuple(a.shape), a.dtype) for a in p.arrays])
                       for p in [own, *others]]
        key = max(self._layouts, default=0) % _KEYS + 1
        self._layouts[key] = self.layout
        if len(self._layouts) > _LAYOUTS:
            del self._layouts[next(iter(self._layouts))]  # the oldest trace's
        return jnp.concatenate([jnp.full((1,), key, jnp.float32), *flat,
                                jnp.zeros((room - size,), jnp.float32)])

    def _stored(self) -> tuple[Any, Any] | None:
        """The ``rows`` and ``extra`` arrays in the keeper's state now (no transfer), or None
        where no ``nnx.Optimizer`` holds a :class:`MonitorState`."""
        state = getattr(self._keeper(), "opt_state", None)
        if not isinstance(state, MonitorState):
            return None
        rows, extra = state.rows, state.extra
        return (rows.get_raw_value() if isinstance(rows, nnx.Variable) else rows,
                extra.get_raw_value() if isinstance(extra, nnx.Variable) else extra)

    def collect(self) -> Parcel | None:
        """What the last compiled update stored in its ``nnx.Optimizer``'s state, as a parcel
        for the close's one fetch; None if no update stored anything since the last call."""
        stored = self._stored()
        if not self._layouts or stored is None:
            return None
        rows, extra = stored
        if rows is self._seen or isinstance(rows, jax.core.Tracer):
            return None
        self._seen = rows  # nnx.jit writes a new array each step: the identity tells
        layouts = self._layouts
        return Parcel([rows, extra], lambda values: _unstore(layouts, values))

    def fresh(self) -> bool:
        """Whether an update stored statistics that :meth:`collect` has not taken."""
        stored = self._stored()
        return bool(self._layouts) and stored is not None and stored[0] is not self._seen

    def skip(self) -> None:
        """Forget what the last update stored (a step ``every=`` does not record)."""
        self.collect()


class _Stored(NamedTuple):
    """A parcel stored in the state: how it lands, and its arrays' shapes and dtypes (not the
    tracers, which must not outlive their trace)."""

    land: Land
    arrays: list[tuple[tuple[int, ...], Any]]


_KEYS = 1 << 24
"""Layout keys run from 1 to this and wrap: a float32 holds every integer up to it exactly."""

_LAYOUTS = 64
"""The most layouts kept: a step compiled for more shapes than this in turn loses the rows of
the oldest."""


def _unstore(layouts: dict[int, list[_Stored]], values: Any) -> None:
    """Land the stored parcels of the layout whose key ``extra`` starts with (none for key 0,
    a step that sent them): the first is the monitor's own rows, the others lie one after the
    other in ``extra``."""
    extra = np.asarray(values[1])
    layout = layouts.get(int(extra[0])) if extra.size else None
    if layout is None:
        return
    own, *others = layout
    own.land([np.asarray(values[0])])
    at = 1
    for stored in others:
        arrays = []
        for shape, dtype in stored.arrays:
            n = math.prod(shape)
            arrays.append(extra[at:at + n].reshape(shape).astype(dtype))
            at += n
        stored.land(arrays)


def monitor(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that a Watcher records the gradients it gets and the updates it makes.

    Example::

        tx = graddebug_jax.monitor(optax.adam(1e-3))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        with graddebug.watch(model, optimizer=optimizer) as dbg:
            ...  # train_step(model, optimizer, batch) under nnx.jit; dbg.step() after each

    Handing ``watch`` the ``nnx.Optimizer`` (rather than ``tx``) says who keeps the state, so
    that the statistics leave the step in it (:attr:`.transport.Route.STATE`).

    Args:
        inner: Any optax transformation (``optax.adam(1e-3)``, an ``optax.chain``).

    Returns:
        A transformation with ``inner``'s state and updates, bit for bit.
    """
    state = Monitor(inner)
    return optax.GradientTransformationExtraArgs(state.init, state.update)


def monitor_of(optimizer: Any) -> Monitor | None:
    """The :class:`Monitor` behind a :func:`monitor` transformation, or behind an
    ``nnx.Optimizer`` built with one; None for anything else."""
    tx = getattr(optimizer, "tx", optimizer)
    owner = getattr(getattr(tx, "update", None), "__self__", None)
    return owner if isinstance(owner, Monitor) else None
