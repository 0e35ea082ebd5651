"""``graddebug_jax.monitor(inner)``: an optax transformation that records the gradients it is
handed, the weights they were taken at and the updates ``inner`` makes of them, and changes
nothing.

It wraps ``inner`` as optax's own wrappers do (``optax.apply_if_finite``,
``optax.MultiSteps``): its state is ``inner``'s state, unchanged, so checkpoints load with and
without it. Bind it to a Watcher with ``graddebug.watch(model, optimizer=tx)``; unbound, it
measures nothing. Its statistics are computed inside the compiled step; bound, its update
is the step's carrier (:mod:`.outlet`): the parameter rows and every parcel waiting in the
same trace (the backward pass's layer-output rows, the input check) reach the host in one
callback per update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from graddebug_jax.modules import path_name
from graddebug_jax.outlet import Outlet, Parcel
from graddebug_jax.stats import param_rows

__all__ = ["Monitor", "monitor", "monitor_of"]

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

    def bind(self, sink: ParamSink | None, full: bool = False, outlet: Outlet | None = None
             ) -> None:
        """Report to ``sink`` from now on (None: to nobody), through ``outlet``; ``full``
        also measures each gradient's mean and absolute maximum."""
        self.sink, self.full, self.outlet = sink, full, outlet

    def _land(self, paths: list[str], values: Any) -> None:
        sink = self.sink  # read when the step runs: one compiled step serves any binding
        if sink is not None:
            sink(paths, np.asarray(values))

    def init(self, params: Any) -> Any:
        """``inner``'s state."""
        return self.inner.init(params)

    def update(self, updates: Any, state: Any, params: Any = None, **extra: Any
               ) -> tuple[Any, Any]:
        """``inner``'s update, bit for bit, plus one callback carrying every parameter's row
        and the parcels waiting in the trace."""
        new_updates, new_state = self.inner.update(updates, state, params, **extra)
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
            jax.debug.callback(lambda values: self._land(paths, values), rows)
            return new_updates, new_state
        parcel = Parcel([rows], lambda values: self._land(paths, values[0]))
        return new_updates, outlet.gather(parcel, new_state)


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
