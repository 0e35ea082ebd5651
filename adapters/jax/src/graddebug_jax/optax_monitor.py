"""``graddebug_jax.monitor(inner)``: an optax transformation that records the gradients it is
handed, the weights they were taken at and the updates ``inner`` makes of them, and changes
nothing.

It wraps ``inner`` as optax's own wrappers do (``optax.apply_if_finite``,
``optax.MultiSteps``): its state is a :class:`MonitorState`, ``inner``'s state and the
statistics of the last update. Bind it to a Watcher with ``graddebug.watch(model,
optimizer=tx)``; unbound, it measures nothing. Its statistics are computed inside the
compiled step, and its update is the step's carrier (:mod:`.outlet`). Where an
``nnx.Optimizer`` holds its state (the optimizer that called ``init``) and no backward pass's
chain waits in the trace, the parameter rows and the parcels waiting beside them (the input
check) leave the step as that state, which ``nnx.jit`` writes back without waiting: no host
callback, which would make the step run synchronously (measured in :mod:`.outlet`); the close
fetches them (:meth:`Monitor.collect`). Elsewhere (chains, a plain optax loop that keeps the
state itself) they reach the host in one callback per update.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from graddebug_jax.modules import path_name
from graddebug_jax.outlet import Land, Outlet, Parcel
from graddebug_jax.stats import PARAM_COLUMNS, param_rows

__all__ = ["Monitor", "MonitorState", "monitor", "monitor_of"]

EXTRA = 64
"""Room in :attr:`MonitorState.extra` for the parcels that travel with the parameter rows
(the input check's codes, one per input of the model)."""


class MonitorState(NamedTuple):
    """The state of a :func:`monitor` transformation.

    Attributes:
        inner: ``inner``'s state.
        rows: The last update's parameter rows, ``(parameters, 5)`` float32 (zeros before the
            first update, and where the rows went by callback).
        extra: The other statistics of the last update's step, flattened into ``EXTRA``
            float32 values.
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
        self.outlet: Outlet | None = None
        self.owner: weakref.ref[Any] | None = None
        """The ``nnx.Optimizer`` that called ``init``: the close reads the state from it."""
        self.layout: list[_Stored] | None = None
        """Where the last trace stored its parcels in the state (None: it sent them)."""
        self._seen: Any = None

    def bind(self, sink: ParamSink | None, full: bool = False, outlet: Outlet | None = None
             ) -> None:
        """Report to ``sink`` from now on (None: to nobody), through ``outlet``; ``full``
        also measures each gradient's mean and absolute maximum."""
        self.sink, self.full, self.outlet = sink, full, outlet
        stored = self._stored()
        self._seen = stored[0] if stored is not None else None  # older rows are not news

    def _land(self, paths: list[str], values: Any) -> None:
        sink = self.sink  # read when the step runs: one compiled step serves any binding
        if sink is not None:
            sink(paths, np.asarray(values))

    def init(self, params: Any) -> MonitorState:
        """``inner``'s state and room for the statistics."""
        # The caller's frame is the only place the nnx.Optimizer that keeps this state shows
        # itself (it calls init from its constructor): neither the model nor the traced
        # update leads back to it.
        caller = sys._getframe(1).f_locals.get("self")
        if isinstance(caller, nnx.Optimizer):
            self.owner = weakref.ref(caller)
        count = len(jax.tree_util.tree_leaves(params))
        return MonitorState(self.inner.init(params),
                            jnp.zeros((count, len(PARAM_COLUMNS)), jnp.float32),
                            jnp.zeros((EXTRA,), jnp.float32))

    def update(self, updates: Any, state: MonitorState, params: Any = None, **extra: Any
               ) -> tuple[Any, MonitorState]:
        """``inner``'s update, bit for bit; the parameter rows and the parcels waiting in the
        trace stored in the state or sent in one callback."""
        new_updates, new_inner = self.inner.update(updates, state.inner, params, **extra)
        with_paths, _ = jax.tree_util.tree_flatten_with_path(updates)
        paths = [path_name(path) for path, _ in with_paths]
        grads = [leaf for _, leaf in with_paths]
        applied = jax.tree_util.tree_leaves(new_updates)
        weights = jax.tree_util.tree_leaves(params) if params is not None else None
        if weights is not None and len(weights) != len(grads):
            weights = None
        rows = param_rows(grads, applied if len(applied) == len(grads) else None, weights,
                          self.full)

        outlet = self.outlet
        if outlet is None:  # traced unbound: a later binding still hears of it
            self.layout = None
            jax.debug.callback(lambda values: self._land(paths, values), rows)
            return new_updates, state._replace(inner=new_inner)
        parcel = Parcel([rows], lambda values: self._land(paths, values[0]))
        stored = self._store(outlet, parcel, rows.shape == state.rows.shape)
        if stored is not None:
            return new_updates, MonitorState(new_inner, rows, stored)
        return new_updates, state._replace(inner=outlet.gather(parcel, new_inner))

    def _store(self, outlet: Outlet, own: Parcel, fits: bool) -> Any:
        """The ``extra`` of the state that carries ``own`` and the parcels of its trace, and
        their layout recorded; None where they go by callback (eager, no optimizer keeps the
        state, a chain waits, or they do not fit)."""
        owner = self.owner() if self.owner is not None else None
        if owner is None or not fits or not isinstance(own.arrays[0], jax.core.Tracer):
            self.layout = None
            return None
        others = outlet.take_unchained(own)
        if others is None:
            self.layout = None
            return None
        others = others[:-1]
        flat = [jnp.ravel(a).astype(jnp.float32) for p in others for a in p.arrays]
        size = sum(int(f.size) for f in flat)
        if size > EXTRA:
            for parcel in others:  # back to waiting: the callback takes them
                outlet.post(parcel)
            self.layout = None
            return None
        self.layout = [_Stored(p.land, [(tuple(a.shape), a.dtype) for a in p.arrays])
                       for p in [own, *others]]
        return jnp.concatenate([*flat, jnp.zeros((EXTRA - size,), jnp.float32)])

    def _stored(self) -> tuple[Any, Any] | None:
        """The ``rows`` and ``extra`` arrays in the owner's state now (no transfer), or None
        where no ``nnx.Optimizer`` holds a :class:`MonitorState`."""
        owner = self.owner() if self.owner is not None else None
        state = getattr(owner, "opt_state", None)
        if not isinstance(state, MonitorState):
            return None
        rows, extra = state.rows, state.extra
        return (rows.get_raw_value() if isinstance(rows, nnx.Variable) else rows,
                extra.get_raw_value() if isinstance(extra, nnx.Variable) else extra)

    def collect(self) -> Parcel | None:
        """What the last compiled update stored in its ``nnx.Optimizer``'s state, as a parcel
        for the close's one fetch; None if no update stored anything since the last call."""
        layout, stored = self.layout, self._stored()
        if layout is None or stored is None:
            return None
        rows, extra = stored
        if rows is self._seen or isinstance(rows, jax.core.Tracer):
            return None
        self._seen = rows  # nnx.jit writes a new array each step: the identity tells
        return Parcel([rows, extra], lambda values: _unstore(layout, values))

    def fresh(self) -> bool:
        """Whether an update stored statistics that :meth:`collect` has not taken."""
        stored = self._stored()
        return self.layout is not None and stored is not None and stored[0] is not self._seen

    def skip(self) -> None:
        """Forget what the last update stored (a step ``every=`` does not record)."""
        self.collect()


class _Stored(NamedTuple):
    """A parcel stored in the state: how it lands, and its arrays' shapes and dtypes (not the
    tracers, which must not outlive their trace)."""

    land: Land
    arrays: list[tuple[tuple[int, ...], Any]]


def _unstore(layout: list[_Stored], values: Any) -> None:
    """Land the stored parcels: the first is the monitor's own rows, the others lie one after
    the other in ``extra``."""
    own, *others = layout
    own.land([np.asarray(values[0])])
    at, extra = 0, np.asarray(values[1])
    for stored in others:
        arrays = []
        for shape, dtype in stored.arrays:
            n = int(np.prod(shape))
            arrays.append(extra[at:at + n].reshape(shape).astype(dtype))
            at += n
        stored.land(arrays)


def monitor(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that a Watcher records the gradients it gets and the updates it makes.

    Example::

        tx = graddebug_jax.monitor(optax.adam(1e-3))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        with graddebug.watch(model, optimizer=tx) as dbg:
            ...  # train_step(model, optimizer, batch) under nnx.jit; dbg.step() after each

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
