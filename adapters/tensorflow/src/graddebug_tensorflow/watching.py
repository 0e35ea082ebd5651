"""Layer outputs and taps hooked: the wrapped ``layer.call``, the custom-gradient identity around
every floating output, the slot (buffer row) of each call, and the gradient hook that applies
the interventions and writes the gradient's statistics.

Each watched layer's ``call`` is replaced, on the instance, by a wrapper that passes every
floating output through a ``tf.custom_gradient`` identity (a cheaper eager equivalent for plain
eager tensors). Its gradient function applies the interventions and writes the gradient's
statistics into the buffers of :mod:`.captures`, so the same code records in eager mode, inside
a ``tf.function`` and inside ``model.fit``. Under a ``tf.distribute`` strategy of several
replicas (:mod:`.distributed`), each replica writes its own copy of the rows; under loss
scaling (:mod:`.scaling`) the scale is divided out of every statistic.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from graddebug.capture.layers import Intervention, LayerSpec
from graddebug_tensorflow.distributed import replica_index
from graddebug_tensorflow.eagerrows import EagerRows
from graddebug_tensorflow.outputs import (
    Slot,
    carry_keras_attributes,
    differentiable,
    intervene,
    is_mask_tensor,
    leaf_names,
    unit_axis,
)
from graddebug_tensorflow.stats import (
    EAGER_TENSOR,
    FlatWriter,
    compiled,
    write_activation,
    write_forward,
)

if TYPE_CHECKING:
    from graddebug.adapter import WatchContext
    from graddebug.capture.layers import FailOpen
    from graddebug_tensorflow.captures import StateBuffers, StepGates
    from graddebug_tensorflow.ops.capture import OpCapture
    from graddebug_tensorflow.scaling import LossScale

__all__ = ["MODEL_INPUT", "OutputWatch"]

MODEL_INPUT = "input"
"""The ``layer`` of the model's inputs' rows and events, as in torch."""

try:  # an eager recording identity's op, as tf.custom_gradient records it
    from tensorflow.python.eager.record import record_operation as _record_operation
    from tensorflow.python.eager.record import stop_recording as _stop_recording
except ImportError:  # pragma: no cover - a TF that moved them: tf.custom_gradient throughout
    _record_operation = _stop_recording = None

try:  # whether a tape records an op: skips work for forward passes nobody differentiates
    from tensorflow.python.eager.record import could_possibly_record as _tape_active
    from tensorflow.python.eager.record import should_record_backprop as _taped
except ImportError:  # pragma: no cover - older TF: treat every output as taped

    def _taped(tensors: Sequence[Any]) -> bool:
        return True

    def _tape_active() -> bool:
        return True


_UNSEEN_STRATEGY = (
    "graddebug: the model runs under a {name} of {count} replicas that graddebug did not see "
    "on entering watch(): only replica 0 is recorded. Build the model under "
    "strategy.scope(), or enter watch() inside it."
)

_CallKey = tuple[str, str, int]  # (layer, output, call index or replica)


class OutputWatch:
    """The hooks on layer outputs and taps, and the slots their rows are written into.

    Args:
        context: The Watcher's hook side.
        buffers: Where the rows are written.
        gates: The flags by which a compiled step knows whether it records, and what.
        fail_open: The adapter's fail-open guard of a hook, by where it runs.
        take_depth: Hands out the next forward-order depth.
        graph_unwrapped: Layers whose outputs a graph leaves unwatched (batch norms: see
            :class:`~.adapter.TensorFlowAdapter`).

    Attributes:
        ops: Op-level capture, or None; set by the adapter on attach.
        scale: The loss scaling the gradients carry, or None; set when the adapter takes the
            gradients of an optimizer that scales the loss.
    """

    def __init__(self, context: WatchContext, buffers: StateBuffers, gates: StepGates,
                 fail_open: Callable[[str], FailOpen], take_depth: Callable[[], int],
                 graph_unwrapped: set[str]) -> None:
        self._ctx = context
        self._buffers = buffers
        self._gates = gates
        self._fail_open = fail_open
        self._take_depth = take_depth
        self._graph_unwrapped = graph_unwrapped
        self._slots: dict[_CallKey, Slot] = {}
        self._graph_calls: weakref.WeakKeyDictionary[Any, dict[_CallKey, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._eager_calls: dict[_CallKey, int] = {}
        # The sentinel rows of the open eager step, written when it is read (see _watch)
        self._eager_rows = EagerRows()
        self.ops: OpCapture | None = None
        self.scale: LossScale | None = None
        self.inputs = LayerSpec(name=MODEL_INPUT, capture=False)
        """The rows of the model's inputs (:meth:`wrap_model_call`): the only slots of a
        layer that captures nothing."""

    # -- what closing a step needs ------------------------------------------------------

    def slots(self) -> list[Slot]:
        """Every slot handed out so far, in creation order."""
        return list(self._slots.values())

    def flush(self) -> None:
        """Write the eager step's sentinel rows into the buffers before they are read. The
        work of the step's hooks, done when it is read: fail-open as the hooks are."""
        with self._fail_open("step"):
            self._eager_rows.flush()

    def end_step(self) -> None:
        """Forget the open eager step's call counts and unwritten rows."""
        self._eager_calls.clear()
        self._eager_rows.clear()

    # -- layer outputs and taps -----------------------------------------------------------

    def wrap_call(self, layer: LayerSpec, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` (a layer's ``call``), with every floating output watched."""

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            ops = self.ops
            if ops is None:
                return self.on_output(layer, original(*args, **kwargs), args)
            with ops.layer(layer):
                output = original(*args, **kwargs)
            return self.on_output(layer, output, args)

        return call

    def on_output(self, layer: LayerSpec, output: Any, args: Any = ()) -> Any:
        """``output`` of ``layer`` (a tensor, or a nest of them; ``args`` its inputs), with
        every floating tensor passed through the identity that records (and alters) its
        gradient."""
        if self.ops is not None:
            with self.ops.own():
                return self._watch_output(layer, output, args)
        return self._watch_output(layer, output, args)

    def _watch_output(self, layer: LayerSpec, output: Any, args: Any = ()) -> Any:
        """Watch every differentiable leaf of ``output``, or leave it as it is where nothing records
        it (eager steps ``every=`` skips, graphs' batch norms, outputs no tape watches)."""
        if layer.intervention is None and not self._ctx.recording and tf.executing_eagerly():
            return output  # an eager step every= skips: nothing to record or alter
        if dataclasses.is_dataclass(output) and not isinstance(output, type):
            return self._on_dataclass(layer, output)
        with self._fail_open(layer.name):
            leaves = tf.nest.flatten(output)
            if not any(differentiable(t) for t in leaves):
                return output  # symbolic (KerasTensor) or integer outputs
            eager = tf.executing_eagerly()
            if not eager and layer.name in self._graph_unwrapped:
                return output
            # An output no tape watches gets no gradient: nothing will differentiate it (an
            # eager forward nobody differentiates), or it does not depend on any trainable
            # variable (a parameter-free first layer such as ZeroPadding2D, traced by ``fit``).
            # Recording its forward would report it as cut off. In a graph that no tape traces
            # (``tf.gradients``), nothing says which outputs will be differentiated: watch all.
            if (eager or _tape_active()) and not _taped(
                [t for t in leaves if differentiable(t)]
            ):
                # Where its input is watched, though, the layer itself cut the graph (a
                # tf.stop_gradient inside its call): its output is marked as severed.
                inputs = [t for t in tf.nest.flatten(args) if differentiable(t)]
                if layer.capture and inputs and _taped(inputs):
                    self._sever(layer, output, leaves, eager)
                return output
            if layer.depth < 0:
                layer.depth = self._take_depth()
            names = leaf_names(output, len(leaves))
            new = [
                self._watch(layer, tname, t, eager) if differentiable(t) else t
                for tname, t in zip(names, leaves, strict=True)
            ]
            return tf.nest.pack_sequence_as(output, new)
        return output  # fail-open: a graddebug bug leaves the output as it was

    def _sever(self, layer: LayerSpec, output: Any, leaves: list[Any], eager: bool) -> None:
        """Record that ``layer`` ran and cut the graph: each floating output's row says it ran
        (and whether it was finite) and is marked severed, so that the close reports a
        ``detached_output`` at this layer rather than a cut somewhere after it."""
        if eager and not self._ctx.recording:
            return
        if layer.depth < 0:
            layer.depth = self._take_depth()
        for tname, t in zip(leaf_names(output, len(leaves)), leaves, strict=True):
            if differentiable(t):
                slot = self._slot(layer, tname, eager)
                if slot is not None:
                    slot.severed = True
                    self._write_forward(slot, t, layer.check_forward, eager)

    def _on_dataclass(self, layer: LayerSpec, output: Any) -> Any:
        """A dataclass output, which ``tf.nest`` takes for one leaf: its fields are watched as
        a dict's keys (``output.<field>``) and put back into a copy of it."""
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        watched = self.on_output(layer, fields)
        if watched is fields:
            return output
        new = copy.copy(output)
        for name, value in watched.items():
            object.__setattr__(new, name, value)  # frozen dataclasses too
        return new

    def _watch(self, layer: LayerSpec, tname: str, tensor: tf.Tensor, eager: bool) -> tf.Tensor:
        """Write the forward row of one call's output ``tensor`` and pass it through the identity
        whose gradient function is :meth:`_on_grad`."""
        spec = layer.intervention
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            layer.check_mask(spec.mask, tuple(tensor.shape), is_mask_tensor(spec.mask))
        record = layer.capture and (not eager or self._ctx.recording)
        if not record and (spec is None or not spec.active):
            return tensor
        slot = self._slot(layer, tname, eager) if record else None
        if slot is not None:
            self._write_forward(slot, tensor, layer.check_forward, eager)
        axis = unit_axis(tensor.shape.rank, layer.channels_first)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return self._on_grad(layer, slot, spec, axis, dy)

        def identity(x: tf.Tensor) -> tf.Tensor:
            if eager and _record_operation is not None and type(x) is EAGER_TENSOR:
                return _eager_identity(x, grad)
            return _custom_identity(x, grad)

        watched = identity(tensor)
        if self.ops is not None:
            self.ops.alias(watched, tensor)
        logits = carry_keras_attributes(tensor, watched)
        if logits is not None:
            # Keras losses read a softmax or sigmoid output's logits (``_keras_logits``) and
            # differentiate those, not the probabilities: the gradient that reaches this layer
            # flows through the logits, so they pass through the same recording identity.
            watched._keras_logits = identity(logits)
        return watched

    def _write_forward(self, slot: Slot, tensor: tf.Tensor, check: bool, eager: bool) -> None:
        """Write the forward row of ``slot``: the call ran, and ``tensor``'s finiteness sum."""
        if eager:
            # One replica: a sum op, or no op at all, instead of a writer call (~0.2 ms)
            if self._buffers.replicas > 1 or not self._eager_rows.forward(
                    slot.var, slot.row, tensor, check):
                _write_forward(self._buffers.local(slot.var), slot.row_tensor, tensor, check)
        else:
            write_forward(self._buffers.local(slot.var), slot.row, tensor, check)

    # -- the model's inputs -------------------------------------------------------------

    def wrap_model_call(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` (the watched model's ``call``), checking its floating inputs for
        NaN/Inf first on recorded steps: one sum each, in the buffers the close reads, so that
        a NaN the data brought is told from one the model made."""

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            self._check_inputs(args, kwargs)
            return original(*args, **kwargs)

        return call

    def _check_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        eager = tf.executing_eagerly()
        if eager and not self._ctx.recording:
            return
        with self._fail_open("model input"):
            named = [(f"args.{i}", value) for i, value in enumerate(args)]
            named += [(f"kwargs.{key}", value) for key, value in kwargs.items()]
            for name, value in named:
                leaves = tf.nest.flatten(value)
                for j, leaf in enumerate(leaves):
                    if not differentiable(leaf):
                        continue
                    slot = self._slot(self.inputs, name if len(leaves) == 1 else f"{name}.{j}",
                                      eager)
                    if slot is not None:
                        self._write_forward(slot, leaf, True, eager)

    def _slot(self, layer: LayerSpec, tname: str, eager: bool) -> Slot | None:
        """The row of this call of ``layer``'s output ``tname``: calls are counted per graph
        (or eagerly per step) and per replica, and the replicas share rows, each writing its
        own copy. None for a replica that records nothing (see :meth:`_replica`)."""
        replica = self._replica(eager)
        if replica is None:
            return None
        if eager:
            calls = self._eager_calls
        else:
            calls = self._graph_calls.setdefault(tf.compat.v1.get_default_graph(), {})
        ordinal = calls.get((layer.name, tname, replica), 0)
        calls[(layer.name, tname, replica)] = ordinal + 1
        key = (layer.name, tname, ordinal)
        slot = self._slots.get(key)
        if slot is None:
            var, row, index = self._buffers.new_row()
            with tf.init_scope():
                slot = Slot(layer, tname, ordinal, var, row, index, tf.constant(row))
                if layer.keep:  # replica 0 keeps gradients: a plain variable of its own
                    slot.keep_var = self._buffers.copy(self._buffers.variable(
                        tf.zeros([0]), f"graddebug_keep_{len(self._slots)}", any_shape=True), 0)
            self._slots[key] = slot
        return slot

    def _replica(self, eager: bool) -> int | None:
        """The index of the running replica; None for a replica of a strategy the buffers
        were not made for, which would overwrite replica 0's rows: it records nothing.

        Without a strategy this costs nothing in eager mode, and one check per trace in a
        graph.
        """
        if self._buffers.replicas > 1:
            return replica_index()
        if eager or not tf.distribute.has_strategy():
            return 0
        strategy = tf.distribute.get_strategy()
        count = int(strategy.num_replicas_in_sync)
        if count == 1:
            return 0
        self._ctx.warn_once("unseen-strategy", _UNSEEN_STRATEGY.format(
            name=type(strategy).__name__, count=count))
        return 0 if replica_index() == 0 else None

    # -- the gradient hook ----------------------------------------------------------------

    def _on_grad(
        self,
        layer: LayerSpec,
        slot: Slot | None,
        spec: Intervention | None,
        unit_axis: int | None,
        dy: tf.Tensor,
    ) -> tf.Tensor:
        """The gradient hook of a watched output: graddebug's own ops are left out of op-level
        capture."""
        if self.ops is not None:
            with self.ops.own():
                return self._record_grad(layer, slot, spec, unit_axis, dy)
        return self._record_grad(layer, slot, spec, unit_axis, dy)

    def _record_grad(
        self,
        layer: LayerSpec,
        slot: Slot | None,
        spec: Intervention | None,
        unit_axis: int | None,
        dy: tf.Tensor,
    ) -> tf.Tensor:
        """Apply the intervention to ``dy`` and write its row (on recorded steps); return the
        gradient that flows on."""
        new = dy
        if spec is not None and spec.active:
            new = intervene(spec, layer.name, dy, self._ctx.internal_error)
        if slot is None:
            return new
        with self._fail_open(layer.name):
            pre = dy if new is not dy else None
            gates = self._gates

            def write() -> tf.Tensor:
                scale = None if self.scale is None else self.scale.current()
                var = self._buffers.local(slot.var)
                full: Any = layer.keep or gates.full_var is None
                if tf.executing_eagerly():
                    full = full or self._ctx.full_stats
                    # The sentinel of one replica, unscaled: two ops instead of a writer call
                    if (full or scale is not None or pre is not None
                            or self._buffers.replicas > 1
                            or not self._eager_rows.backward(var, slot.row, new)):
                        _write_activation(var, slot.row_tensor, new, pre, unit_axis, scale,
                                          full)
                else:
                    write_activation(var, slot.row, new, pre, unit_axis, scale,
                                     full or gates.full_var)
                if slot.keep_var is not None and (
                        self._buffers.replicas == 1 or replica_index() == 0):
                    slot.keep_var.assign(new)
                return tf.constant(True)

            gates.when_recording(write)
        return new


def _custom_identity(x: tf.Tensor, grad: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """``tf.identity(x)`` whose gradient is ``grad(dy)``, through ``tf.custom_gradient``: in a
    graph, and for tensors other than plain eager ones."""

    @tf.custom_gradient
    def identity(t: tf.Tensor) -> Any:
        return tf.identity(t), grad

    out: tf.Tensor = identity(x)
    return out


def _eager_identity(x: tf.Tensor, grad: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """``tf.identity(x)``, recorded on the running tapes as one op whose gradient is
    ``grad(dy)``: what ``tf.custom_gradient`` records for a plain eager tensor, without its
    bookkeeping for variables and composite tensors, which costs several times the op itself
    (see the Performance page)."""
    with _stop_recording():
        out = tf.identity(x)
    _record_operation("graddebug_identity", [out], [x], lambda dy: [grad(dy)])
    return out


_write_forward = FlatWriter(compiled(write_forward))
_write_activation = FlatWriter(compiled(write_activation))
