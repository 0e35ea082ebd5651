"""The JAX adapter: Flax NNX models, named arrays (``params=``), taps in plain JAX functions,
and optax optimizers wrapped by :func:`graddebug_jax.monitor`.

On attach it labels the watched modules and wraps their classes' ``__call__``
(:mod:`.model`); each output then passes through a ``jax.custom_vjp`` identity whose backward
rule measures (and may alter) the cotangent (:mod:`.outputs`). The statistics are computed inside
the traced computation, eager or under ``jax.jit``/``nnx.jit``, and cross to the host once
per recorded step, by one of the routes of :mod:`.transport`: under jit in the optax monitor's
state, which the close fetches (the monitor's rows, the layer-output rows and the input check,
where the ``nnx.Optimizer`` handed to ``watch(optimizer=...)`` keeps that state and they fit
its room), else in one callback carried by the monitor's update, or by the backward pass where
no monitor is bound; eager in one fetch when the step closes. All of it goes through a
:class:`~graddebug_jax.recorder.Recorder`, the interface Keras on the JAX backend uses too.
:mod:`.closing` turns them into records when ``dbg.step()`` closes the step. Parameter
gradients come from the optax monitor (``watch(optimizer=optimizer)``: the gradients, the
weights and the applied updates) or from ``dbg.step(grads)`` (a pytree of gradients, one
compiled reduction fetched with the step's other parcels).

No optimizer step closes a graddebug step: the update runs inside a compiled function, where
calling back into the Watcher would run it on the runtime's thread in the middle of the user's
next dispatch. So the loop calls ``dbg.step()`` after each training step.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from graddebug.adapter import BaseAdapter, StepResult, WatchContext, WatchOptions
from graddebug.adapter.protocol import GradientSource, TrainStep
from graddebug.capture.layers import Intervention, LayerSpec
from graddebug.errors import ConfigError, GradientCountError
from graddebug_jax.closing import given_rows
from graddebug_jax.model import ModelIndex, patch_calls, path_name
from graddebug_jax.recorder import Recorder
from graddebug_jax.transport import Route
from graddebug_jax.updates import monitor_of

__all__ = ["JaxAdapter"]

_IDS = itertools.count(1)

# Modules that cannot make NaN or Inf from finite inputs: a NaN they pass on is named where
# it was made.
_KEEPS_FINITE: tuple[type, ...] = (nnx.Dropout,)


class JaxAdapter(BaseAdapter):
    """Watches a Flax NNX model, named JAX arrays (``params=``), and taps.

    What it records travels through its :class:`~graddebug_jax.recorder.Recorder`, the public
    interface that Keras on the JAX backend uses too."""

    name = "jax"
    capabilities = frozenset({GradientSource, TrainStep})
    # Not keep= (no dense copies), op-level capture or scaler=; every statistic is measured on
    # every recorded step, so full_stats_every= has nothing to choose.
    watch_options = frozenset({"params", "layers", "intervene", "outputs", "param_stats",
                               "optimizer"})

    def __init__(self, context: WatchContext, model: Any, params: Mapping[str, Any] | None,
                 options: WatchOptions) -> None:
        if model is not None and not isinstance(model, nnx.Module):
            raise ConfigError(
                f"the JAX adapter watches Flax NNX modules, not {type(model).__name__}; pass "
                "arrays as params={'name': w} or use dbg.tap(x, name) inside the function.")
        super().__init__(context, options)
        self._id = next(_IDS)
        self._index = ModelIndex(model) if model is not None else None
        self._targets: dict[str, nnx.Module] = {}
        if self._index is not None:
            self._targets = self._add_layers(
                self._index.named, self._index.select(options.layers),
                lambda module: False, lambda module: isinstance(module, _KEEPS_FINITE))
        self._params = dict(params or {})
        for key, value in self._params.items():
            if not isinstance(value, (jax.Array, np.ndarray)):
                raise ConfigError(
                    f"params[{key!r}] is a {type(value).__name__}; the JAX adapter records "
                    "jax arrays (the gradients then come from dbg.step(grads)).")
        self._add_param_keys(self._params)
        self._recorder = Recorder(self._name_param, self._fail_open("step"),
                                  context.internal_error, context.warn_once)
        self._patches: Any = None
        self._param_vars: list[Any] | None = None
        self._monitors: list[Any] = []
        self._names: dict[str, tuple[str, str, tuple[str, ...]]] = {}

    # -- Adapter protocol -------------------------------------------------------------------

    def attach(self) -> None:
        """Label the watched modules and wrap their classes' ``__call__``."""
        wanted = {n: m for n, m in self._targets.items() if self._layers[n].capture}
        if self._index is not None:  # the root's call checks the model's inputs too
            wanted.setdefault(self._index.root, self._index.model)
        if wanted:
            self._patches = patch_calls(self._id, wanted, self._on_call)

    def detach(self) -> None:
        """Unwrap the modules, unbind the optax monitors, forget what did not close."""
        if self._patches is not None:
            self._patches.remove()
            self._patches = None
        for mon in self._monitors:
            mon.bind(None)
        self._monitors.clear()
        self._recorder.reset()

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Wait for the callbacks, turn what arrived into records, add the rows of ``grads``
        (a pytree of gradients, or a list aligned with ``params=``)."""
        if self._recorder.settle() and self._patches is not None:
            self._patches.relabel()  # a new graph definition: nnx.jit traces again
        stored = any(mon.layout is not None for mon in self._monitors)
        if self._recorder.tied and not stored:  # the callback is done once the update is
            jax.block_until_ready(self._param_values())  # applied
        if not record:
            for mon in self._monitors:
                mon.skip()
            return self._recorder.skip()
        for mon in self._monitors:  # what updates stored in their state: the close's fetch
            parcel = mon.collect()
            if parcel is not None:
                self._recorder.hold(parcel)
        if grads is not None:
            paths, leaves = self._given(grads)
            rows = given_rows(leaves, self._options.param_stats == "full")
            shapes = [tuple(np.shape(g)) for g in leaves]
            self._recorder.hold_params(paths, shapes, rows)
        return self._recorder.close(step)

    def has_pending(self) -> bool:
        """Whether rows arrived or wait since the last close, counting the statistics an
        update stored in its optimizer's state (read without a transfer); waits for the
        callbacks in flight."""
        return any(mon.fresh() for mon in self._monitors) or self._recorder.pending()

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Pass ``tensor`` through the identity that records (and alters) its cotangent.

        Raises:
            ConfigError: ``tensor`` is not a floating-point JAX array.
        """
        Recorder.check_tap(tensor, name, "the JAX adapter")
        layer = self._tap_layer(name, intervention)
        if layer.depth < 0:
            layer.depth = self._take_depth()
        return self._recorder.watch(tensor, layer)

    @property
    def transfers(self) -> int:
        """Device-to-host transfers of statistics so far (callbacks and fetches)."""
        return self._recorder.transfers

    @property
    def routes(self) -> Counter[Route]:
        """How many batches of parcels took each route to the host so far
        (:class:`graddebug_jax.transport.Route`)."""
        return self._recorder.routes

    # -- capabilities -------------------------------------------------------------------------

    def take_gradients(self, optimizer: Any) -> None:
        """Record the gradients, weights and updates of an optax :func:`~graddebug_jax.monitor`
        transformation (or of an ``nnx.Optimizer`` built with one, which then keeps the
        statistics in its state) until ``detach`` (:class:`graddebug.adapter.GradientSource`).

        Raises:
            ConfigError: ``optimizer`` is not built on ``graddebug_jax.monitor``.
        """
        mon = monitor_of(optimizer)
        if mon is None:
            raise ConfigError(
                f"optimizer={type(optimizer).__name__} is not a graddebug_jax.monitor(...) "
                "transformation: wrap it, tx = graddebug_jax.monitor(optax.adam(1e-3)), build "
                "the nnx.Optimizer from tx and pass that nnx.Optimizer as optimizer=; or hand "
                "the gradients to dbg.step(grads).")
        if isinstance(optimizer, nnx.Optimizer):  # the state's keeper, named by the user
            mon.adopt(optimizer)  # (given tx alone, the statistics go by callback)
        if mon.silent and self._index is None:
            self._ctx.warn_once("jax-silent", (
                "graddebug: the optimizer's update was compiled before watch() began, with no "
                "Watcher to report to, and measures nothing; with no model given, nnx.jit has "
                "no reason to trace it again. Pass the model, watch(model, optimizer=...), or "
                "compile the step inside the with block."))
        mon.bind(self._on_update, self._options.param_stats == "full",
                 self._recorder.transport)
        # The close can wait for the update's output only where it sees the parameters.
        self._recorder.carry(tied=self._index is not None)
        if mon not in self._monitors:
            self._monitors.append(mon)

    def train_step(self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any,
                   optimizer: Any) -> Sequence[Any] | None:
        """One eager step for ``graddebug.check``: ``loss_fn(model(inputs), *loss_args)`` and
        its gradients (``nnx.value_and_grad``); ``optimizer.update(model, grads)`` when an
        ``nnx.Optimizer`` is given. Returns the gradients (an ``nnx.State``)."""
        model = self._index.model if self._index is not None else None
        if model is None:
            raise ConfigError("train_step needs a model; watch(model) was given none.")

        def loss_of(m: Any) -> Any:
            loss = loss_fn(m(inputs), *loss_args)
            if jnp.size(loss) != 1:
                raise ConfigError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}.")
            return jnp.reshape(loss, ())

        _, grads = nnx.value_and_grad(loss_of)(model)
        if optimizer is not None:
            optimizer.update(model, grads)
        mon = monitor_of(optimizer)
        if mon is not None and mon.sink is not None:
            return None  # the monitor recorded them
        return grads  # type: ignore[no-any-return]

    # -- hooks ------------------------------------------------------------------------------

    def _on_call(self, name: str, call: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        """A watched module's call: its inputs probed, its floating outputs watched; the
        root's inputs checked for NaN/Inf (the data), posted once its output exists."""
        check = None
        if self._index is not None and name == self._index.root:
            with self._fail_open(name):
                check = self._recorder.check_inputs(args, kwargs)
        layer = self._layers.get(name)
        if layer is None or not layer.capture:  # the root, patched for its inputs only
            out = call(*args, **kwargs)
        else:
            out = self._captured(name, layer, call, args, kwargs)
        if check is not None:
            with self._fail_open(name):
                return self._recorder.post_with(out, check)
        return out

    def _captured(self, name: str, layer: LayerSpec, call: Callable[..., Any],
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``call`` with its inputs probed and its floating outputs watched (fail-open)."""
        probed = None
        with self._fail_open(name):  # a bug here runs the module untouched
            probed = self._recorder.probe_args(args)
        if probed is None:
            return call(*args, **kwargs)
        args, flags = probed
        out = call(*args, **kwargs)
        with self._fail_open(name):
            if layer.depth < 0:
                layer.depth = self._take_depth()
            return self._recorder.watch_output(layer, out, any(f[0] for f in flags))
        return out

    def _on_update(self, paths: list[str], rows: np.ndarray) -> None:
        """An optax monitor's rows (the runtime's thread)."""
        self._recorder.add_params(paths, self._shapes(paths), rows)

    # -- parameters ---------------------------------------------------------------------

    def _param_values(self) -> list[Any]:
        """The model's parameter arrays now (NNX updates its variables in place)."""
        if self._param_vars is None:
            model = self._index.model if self._index is not None else None
            self._param_vars = [] if model is None else [
                v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
        # get_raw_value (flax 0.12) is 40x faster than get_value, which checks the trace
        return [v.get_raw_value() if hasattr(v, "get_raw_value") else v.value
                for v in self._param_vars]

    def _shapes(self, paths: list[str]) -> list[tuple[int, ...]]:
        known = self._param_shapes()
        return [known.get(p, ()) for p in paths]

    def _param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = getattr(self, "_shape_cache", None)
        if shapes is None:
            shapes = {k: tuple(np.shape(v)) for k, v in self._params.items()}
            if self._index is not None:
                state = nnx.state(self._index.model, nnx.Param)
                for path, var in nnx.to_flat_state(state):
                    shapes[path_name(path)] = tuple(np.shape(var.get_value()))
            self._shape_cache = shapes
        return shapes

    def _given(self, grads: Any) -> tuple[list[str], list[Any]]:
        """Paths and leaves of the gradients handed to ``dbg.step(grads)``.

        Raises:
            GradientCountError: A list whose length is not that of ``params=``.
        """
        if self._params and isinstance(grads, (list, tuple)):
            if len(grads) != len(self._params):
                raise GradientCountError(
                    f"dbg.step(grads) got {len(grads)} gradients for {len(self._params)} "
                    f"params= entries ({', '.join(self._params)}); pass them in that order.")
            return list(self._params), list(grads)
        with_paths = jax.tree_util.tree_flatten_with_path(grads)[0]
        return [path_name(p) for p, _ in with_paths], [leaf for _, leaf in with_paths]

    def _name_param(self, path: str) -> tuple[str, str, int]:
        """``(layer, tensor, depth)`` of a parameter row. The names are found once; the depth
        is looked up again, along the owner's chain, until a layer of it has run forward (with
        ``outputs=False`` none may: finding the names each step was most of the close)."""
        named = self._names.get(path)
        if named is None:
            named = self._names[path] = self._find_param(path)
        layer, tensor, chain = named
        if path in self._params:
            return layer, tensor, self._layers[path].depth
        return layer, tensor, self._depth_of(chain)

    def _find_param(self, path: str) -> tuple[str, str, tuple[str, ...]]:
        """A parameter row's layer and tensor names, and the chain of layers whose depth is
        its own (the owner, its ancestors, the root)."""
        if path in self._params:
            return path, path, ()
        if self._index is not None:
            layer, tensor = self._index.param_name(path)
            parts = layer.split(".")
            chain = tuple(".".join(parts[:i]) for i in range(len(parts), 0, -1))
            return layer, tensor, (*chain, self._index.root)
        layer, _, tensor = path.rpartition(".")
        return (layer or path), (tensor or path), ()

    def _model_layer_names(self) -> list[str]:
        """Every module name of the model, watched or not (for suggestions)."""
        return list(self._index.named) if self._index is not None else []

