"""TF1 graphs: taps and ``params=`` in a ``tf.compat.v1.Graph``, read in the user's own
``session.run``.

A v1 graph runs only when a session runs it, and a variable of graddebug's would need the
user's initialiser. So nothing here writes state: a tap's custom-gradient identity builds its
statistics (:mod:`.stats`, the same ops as in TF2) as plain tensors of the graph, at the time
``tf.compat.v1.gradients`` builds the backward pass, and :meth:`V1GraphAdapter.fetches` stacks
them, with the rows of the ``params=`` gradients, into one :class:`~.v1session.GraphStats`.
The user fetches it in the ``session.run`` that trains, so the statistics come back with the
step's own values and no second pass; ``dbg.step(fetched)`` (or
:class:`~.v1session.SessionHook` in a ``MonitoredTrainingSession``) turns them into the same
records as in TF2 (:mod:`.closing`).

Extremes are measured on every step (a graph cannot ask the Watcher for the tier of the
step), ``keep=`` gradients are fetched with the rest, and loss scaling and ``tf.distribute``
are not followed here.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from graddebug.adapter import BaseAdapter, StepResult, WatchContext, WatchOptions
from graddebug.adapter.protocol import GradientSource, SessionGraphs
from graddebug.capture.layers import Intervention, LayerSpec, keep_label
from graddebug.errors import ConfigError, GradientCountError
from graddebug_tensorflow.closing import param_records, step_records
from graddebug_tensorflow.outputs import Slot, intervene, is_mask_tensor, unit_axis
from graddebug_tensorflow.params import Param
from graddebug_tensorflow.stats import (
    ACT_WIDTH,
    PARAM_WIDTH,
    Col,
    activation_row,
    forward_row,
    param_row,
)
from graddebug_tensorflow.v1session import GraphStats, SessionHook, in_v1_graph

__all__ = ["V1GraphAdapter"]


@dataclass
class _Entry:
    """One call of a tap in a graph, and the tensors its row is made of."""

    slot: Slot
    graph: Any
    forward: tf.Tensor
    backwards: list[_Backward] = field(default_factory=list)


@dataclass
class _Backward:
    """One backward pass built through a tap: the gradient that flows on, and its row."""

    grad: tf.Tensor
    row: tf.Tensor


@dataclass
class _Layout:
    """What one :class:`GraphStats` holds, in order."""

    entries: list[_Entry]
    given: bool
    kept: list[str] = field(default_factory=list)


_NOT_FETCHED = (
    "dbg.step() in a tf.compat.v1 graph takes what session.run returned for dbg.fetches(): "
    "fetches = dbg.fetches(grads=grads); out = sess.run({{'train': train_op, 'dbg': "
    "fetches}}); dbg.step(out['dbg']). It got {what}."
)


class V1GraphAdapter(BaseAdapter):
    """Watches taps and ``params=`` variables of a ``tf.compat.v1`` graph, whose statistics
    come back through the user's ``session.run`` (see the module docstring)."""

    name = "tensorflow"
    capabilities = frozenset({GradientSource, SessionGraphs})
    # A v1 graph has taps and params= variables, no layers: layers=, outputs= and op-level
    # capture have nothing to act on.
    watch_options = frozenset({"params", "keep", "intervene", "param_stats", "optimizer"})

    def __init__(
        self,
        context: WatchContext,
        model: Any,
        params: Mapping[str, Any] | None,
        options: WatchOptions,
    ) -> None:
        if model is not None:
            raise ConfigError(
                f"watch({type(model).__name__}) in a tf.compat.v1 graph: graddebug watches "
                "the taps and params= variables of a v1 graph, not a Keras model; use "
                "watch(params={'W': W}) and dbg.tap(t, 'name'), or run the model eagerly."
            )
        given = dict(params or {})
        for key, value in given.items():
            if not isinstance(value, tf.Variable) or not in_v1_graph(value):
                raise ConfigError(
                    f"params[{key!r}] is a {type(value).__name__}, not a variable of a "
                    "tf.compat.v1 graph; create every params= variable in the same graph, "
                    f"or tap(t, {key!r}) an intermediate tensor."
                )
        super().__init__(context, options)
        self._add_param_keys(given)
        self._params = [Param(key, key, var, i, (key,), keep=key in options.keep)
                        for i, (key, var) in enumerate(given.items())]
        self._entries: list[_Entry] = []
        self._calls: dict[tuple[Any, str], int] = {}
        self._grads: list[Any] | None = None  # aligned with self._params, from fetches(grads=)
        self._applied: list[Any] | None = None  # the same, from the bound optimizer
        self._layouts: dict[int, _Layout] = {}
        self._token = random.getrandbits(40) << 16  # tells this Watcher's layouts apart
        self._unpatch: list[tuple[Any, bool, Any]] = []

    # -- Adapter protocol ---------------------------------------------------------------

    def attach(self) -> None:
        """Nothing to install: taps and the optimizer are wrapped as they are given."""

    def detach(self) -> None:
        """Give the optimizer's ``apply_gradients`` back."""
        for optimizer, had, old in reversed(self._unpatch):
            if had:
                vars(optimizer)["apply_gradients"] = old
            else:
                vars(optimizer).pop("apply_gradients", None)
        self._unpatch.clear()

    def has_pending(self) -> bool:
        """Never: the statistics of a step are in the session's hands until ``step()``."""
        return False

    def take_gradients(self, optimizer: Any) -> None:
        """Take the ``params=`` gradients from ``optimizer.apply_gradients`` (a
        ``tf.compat.v1.train.Optimizer``; ``minimize`` calls it) as the graph is built. The
        session's ``run`` is the step, closed by ``step()``.

        Raises:
            ConfigError: ``optimizer`` has no ``apply_gradients`` method.
        """
        original = getattr(optimizer, "apply_gradients", None)
        if not callable(original):
            raise ConfigError(
                f"optimizer={optimizer!r} is not a tf.compat.v1.train.Optimizer (it has no "
                "apply_gradients method)."
            )
        own = vars(optimizer)
        self._unpatch.append((optimizer, "apply_gradients" in own, own.get("apply_gradients")))

        def apply_gradients(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
            pairs = list(grads_and_vars)
            with self._fail_open("optimizer"):
                self._applied = self._aligned(pairs, strict=False)
            return original(pairs, *args, **kwargs)

        own["apply_gradients"] = apply_gradients

    # -- taps -------------------------------------------------------------------------

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Pass ``tensor`` through the identity whose gradient builds its statistics."""
        if isinstance(tensor, tf.Variable):
            tensor = tf.convert_to_tensor(tensor)
        if not isinstance(tensor, tf.Tensor) or not in_v1_graph(tensor):
            raise ConfigError(
                f"tap({type(tensor).__name__}, {name!r}): this Watcher watches a "
                "tf.compat.v1 graph and taps that graph's tensors only; watch eager code or "
                "a tf.function with a Watcher of its own."
            )
        if not tensor.dtype.is_floating:
            raise ConfigError(f"tap(..., {name!r}) got a {tensor.dtype.name} tensor, which "
                              "has no gradient; tap a floating tensor.")
        if intervention is not None and isinstance(intervention.mask, tf.Tensor) \
                and not in_v1_graph(intervention.mask):
            # An eager mask cannot enter the graph as a tensor; its values can, as a constant.
            intervention = dataclasses.replace(intervention, mask=intervention.mask.numpy())
        layer = self._tap_layer(name, intervention)
        spec = layer.intervention
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            layer.check_mask(spec.mask, tuple(tensor.shape), is_mask_tensor(spec.mask))
        with self._fail_open(name):
            return self._watch(layer, spec, tensor)
        return tensor  # fail-open: a graddebug bug leaves the tensor as it was

    def _watch(self, layer: LayerSpec, spec: Intervention | None, tensor: tf.Tensor) -> Any:
        """Pass ``tensor`` through a custom-gradient identity whose gradient builds its row."""
        if layer.depth < 0:
            layer.depth = self._take_depth()
        if not layer.capture and (spec is None or not spec.active):
            return tensor
        entry = self._entry(layer, tensor) if layer.capture else None
        axis = unit_axis(tensor.shape.rank, layer.channels_first)

        @tf.custom_gradient
        def identity(x: tf.Tensor) -> Any:
            def grad(dy: tf.Tensor) -> tf.Tensor:
                return self._on_grad(layer, entry, spec, axis, dy)

            return tf.identity(x), grad

        return identity(tensor)

    def _entry(self, layer: LayerSpec, tensor: tf.Tensor) -> _Entry:
        """A new row for this call of the tap: calls are counted per graph."""
        key = (tensor.graph, layer.name)
        ordinal = self._calls.get(key, 0)
        self._calls[key] = ordinal + 1
        index = len(self._entries)
        slot = Slot(layer, "output", ordinal, None, index, index, None)
        entry = _Entry(slot, tensor.graph, forward_row(tensor, layer.check_forward))
        self._entries.append(entry)
        return entry

    def _on_grad(self, layer: LayerSpec, entry: _Entry | None, spec: Intervention | None,
                 axis: int | None, dy: tf.Tensor) -> tf.Tensor:
        """Apply the intervention to ``dy`` and build its row; return the gradient that flows on."""
        new = dy
        if spec is not None and spec.active:
            new = intervene(spec, layer.name, dy, self._ctx.internal_error)
        if entry is None:
            return new
        with self._fail_open(layer.name):
            row = activation_row(new, axis, dy if new is not dy else None)
            entry.backwards.append(_Backward(new, row))
        return new

    def _backward(self, entry: _Entry, feeds: set[Any] | None) -> _Backward | None:
        """The backward pass of ``entry`` to record: the only one; else the one that feeds
        the parameter gradients (``feeds``: the ops they depend on); else the first built."""
        built = entry.backwards
        if len(built) <= 1:
            return built[0] if built else None
        chosen = [b for b in built if feeds is not None and b.grad.op in feeds]
        if len(chosen) != 1:
            name = entry.slot.layer.name
            self._ctx.warn_once(f"v1-backward-{name}", (
                f"graddebug: tap {name!r} was differentiated by {len(built)} "
                "tf.compat.v1.gradients calls, and the gradients given to dbg.fetches() do "
                "not tell which one trains; its rows record the first one built. Pass "
                "dbg.fetches(grads=...) the gradients that train."))
            return built[0]
        return chosen[0]

    # -- fetching and closing a step ----------------------------------------------------

    def fetches(self, grads: Any) -> GraphStats:
        """The tensors to fetch in the ``session.run`` of each step: every tap of the default
        graph and the ``params=`` gradients, as one :class:`GraphStats`.

        Args:
            grads: The ``params=`` gradients (graph tensors or None), aligned with
                ``params=``, or ``(gradient, variable)`` pairs; None for the last ones given,
                or those the bound optimizer applies.

        Raises:
            ConfigError: Called outside a v1 graph, or the gradients belong to another graph.
            GradientCountError: ``grads`` does not line up with ``params=``.
        """
        if not in_v1_graph(None):
            raise ConfigError(
                "fetches() builds its tensors in a tf.compat.v1 graph: call it inside "
                "`with graph.as_default():`, once the taps and gradients are built."
            )
        graph = tf.compat.v1.get_default_graph()
        if grads is not None:
            self._grads = self._aligned(grads, strict=True)
        aligned = self._grads if self._grads is not None else self._applied
        if self._params and aligned is None:
            self._ctx.warn_once("v1-no-param-grads", (
                "graddebug: dbg.fetches() has no gradients for the params= variables, so they "
                "get no rows; pass dbg.fetches(grads=tf.compat.v1.gradients(loss, "
                "[W, ...])) or watch(params=..., optimizer=opt)."))
        for g in aligned or ():
            grad_graph = getattr(g.values if isinstance(g, tf.IndexedSlices) else g, "graph",
                                 graph)
            if g is not None and grad_graph is not graph:
                raise ConfigError("fetches(grads=...) got gradients of another graph than "
                                  "the default one; call it inside that graph's as_default().")
        entries = [e for e in self._entries if e.graph is graph]
        feeds = (_ancestors([g for g in aligned if g is not None])
                 if aligned and any(len(e.backwards) > 1 for e in entries) else None)
        backwards = [self._backward(e, feeds) for e in entries]
        full = self._options.param_stats == "full"
        kept: dict[str, tf.Tensor] = {}
        with tf.name_scope("graddebug"):
            zeros = tf.zeros([ACT_WIDTH - Col.BWD], tf.float64)
            rows = [tf.concat([e.forward, zeros if b is None else b.row], 0)
                    for e, b in zip(entries, backwards, strict=True)]
            acts = tf.stack(rows) if rows else tf.zeros([0, ACT_WIDTH], tf.float64)
            params = [param_row(g, full) if g is not None else tf.zeros([PARAM_WIDTH], tf.float64)
                      for g in (aligned or [None] * len(self._params))]
            source = tf.constant([1.0 if aligned is not None else 0.0] + [0.0] * (PARAM_WIDTH - 1),
                                 tf.float64)
            param_rows = tf.stack([*params, source])
            for e, b in zip(entries, backwards, strict=True):
                if b is not None and e.slot.layer.keep:
                    kept[keep_label(e.slot.layer.name, e.slot.tensor, e.slot.ordinal)] = b.grad
            for p, g in zip(self._params, aligned or (), strict=False):
                if p.keep and g is not None:
                    kept[keep_label(p.layer, p.tensor)] = tf.convert_to_tensor(g)
            token = self._token + len(self._layouts)
            self._layouts[token] = _Layout(entries, aligned is not None, list(kept))
            return GraphStats(tf.constant(token, tf.int64), acts, param_rows, kept)

    def session_hook(self, grads: Any) -> SessionHook:
        """A session hook that fetches :meth:`fetches` in every ``run`` and closes a step."""
        return SessionHook(self._ctx, self, grads)

    def _aligned(self, grads: Any, strict: bool) -> list[Any]:
        """The gradients of ``params=``, in its order, from a list aligned with it or from
        ``(gradient, variable)`` pairs (which may hold other variables too).

        Raises:
            GradientCountError: ``strict`` and a list of another length, an entry that is not
                a tensor, or a pair list that misses a ``params=`` variable.
        """
        items = [grads] if isinstance(grads, (tf.Tensor, tf.IndexedSlices)) else list(grads)
        if items and all(isinstance(i, tuple) and len(i) == 2 for i in items):
            by_var = {id(v): g for g, v in items}
            missing = [p.layer for p in self._params if id(p.var) not in by_var]
            if missing and strict:
                raise GradientCountError(
                    f"fetches(grads=...) got (gradient, variable) pairs without the params= "
                    f"variable(s) {missing!r}; pass the pairs of compute_gradients over them."
                )
            return [by_var.get(id(p.var)) for p in self._params]
        if len(items) != len(self._params):
            raise GradientCountError(
                f"fetches(grads=...) got {len(items)} gradients for {len(self._params)} params= "
                "entries; pass tf.compat.v1.gradients(loss, [params in their order])."
            )
        for position, (g, p) in enumerate(zip(items, self._params, strict=True)):
            if g is not None and not isinstance(g, (tf.Tensor, tf.IndexedSlices)):
                raise GradientCountError(
                    f"fetches(grads=...) gradient #{position} (for {p.layer!r}) is a "
                    f"{type(g).__name__}, not a graph tensor: pass the tensors that "
                    "tf.compat.v1.gradients returns, not their values."
                )
        return items

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Turn the values ``session.run`` fetched for :meth:`fetches` into records.

        Raises:
            ConfigError: ``grads`` is not what a session returned for :meth:`fetches` of this
                Watcher.
        """
        fetched, layout = self._checked(grads)
        if not record:
            return StepResult()
        result = StepResult()
        acts = np.zeros((len(self._entries), ACT_WIDTH))
        acts[[e.slot.index for e in layout.entries]] = fetched.activations
        step_records(step, [e.slot for e in layout.entries], acts, result)
        param_records(step, self._params, fetched.params, result, layout.given,
                      lambda p: self._depth_of(p.chain))
        for label in layout.kept:
            result.kept[label] = np.array(fetched.kept[label], copy=True)
        return result

    def _checked(self, fetched: Any) -> tuple[GraphStats, _Layout]:
        """``fetched`` as values of this Watcher's fetches, and the layout that built them.

        Raises:
            ConfigError: They are not.
        """
        if fetched is None:
            raise ConfigError(_NOT_FETCHED.format(what="nothing"))
        if not isinstance(fetched, GraphStats):
            raise ConfigError(_NOT_FETCHED.format(what=f"a {type(fetched).__name__}"))
        if not isinstance(fetched.activations, np.ndarray):
            raise ConfigError(_NOT_FETCHED.format(
                what="the fetches themselves (tensors), not the values a session returned"))
        layout = self._layouts.get(int(fetched.layout))
        if layout is None:
            raise ConfigError(_NOT_FETCHED.format(
                what="values fetched for another Watcher's fetches()"))
        shapes = (np.shape(fetched.activations), np.shape(fetched.params))
        if shapes != ((len(layout.entries), ACT_WIDTH), (len(self._params) + 1, PARAM_WIDTH)):
            raise ConfigError(_NOT_FETCHED.format(
                what=f"rows of shapes {shapes}, which no fetches() built"))
        return fetched, layout


def _ancestors(tensors: Sequence[Any]) -> set[Any]:
    """Every op that ``tensors`` (or the values of ``tf.IndexedSlices``) depend on."""
    stack = [(t.values if isinstance(t, tf.IndexedSlices) else t).op for t in tensors]
    seen: set[Any] = set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(i.op for i in op.inputs)
        stack.extend(op.control_inputs)
    return seen
