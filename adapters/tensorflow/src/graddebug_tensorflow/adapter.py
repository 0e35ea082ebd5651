"""The TensorFlow/Keras adapter: layer calls wrapped in a custom-gradient identity.

Each watched layer's ``call`` is replaced, on the instance, by a wrapper that passes every
floating output through a ``tf.custom_gradient`` identity. Its gradient function applies the
interventions and writes the gradient's statistics into TF state (:mod:`.buffers`), so the same
code records in eager mode, inside a ``tf.function`` and inside ``model.fit``. Parameter
gradients are those handed to ``Watcher.step(grads)``, or those the optimizer applies. Closing a
step reads every buffer with one transfer and clears it.

Under a ``tf.distribute`` strategy of several replicas (:mod:`.replicas`), each replica records
its layer outputs into its own copy of the buffers, and its rows carry its index in ``rank``;
parameter rows are those of the all-reduced gradients, recorded once. Under loss scaling
(:mod:`.scaling`) the scale is divided out of every statistic, and the steps a
``LossScaleOptimizer`` skips are marked.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from graddebug.adapter import BaseAdapter, Distribution, StepResult, WatchContext, WatchOptions
from graddebug.capture.layers import Intervention, LayerSpec
from graddebug.errors import ConfigError
from graddebug.records import EventKind
from graddebug_tensorflow.buffers import Rows, ScalerCol, StateBuffers
from graddebug_tensorflow.eagerrows import EagerRows
from graddebug_tensorflow.model import LayerIndex
from graddebug_tensorflow.ops import OpCapture
from graddebug_tensorflow.outputs import (
    Slot,
    carry_keras_attributes,
    differentiable,
    intervene,
    is_mask_tensor,
    keeps_finite,
    leaf_names,
    unit_axis,
)
from graddebug_tensorflow.params import Param, ParamSet
from graddebug_tensorflow.records import handed_over, param_records, skipped_step, step_records
from graddebug_tensorflow.replicas import all_reduced, replica_index, strategy_of
from graddebug_tensorflow.scaling import LossScale, note_step
from graddebug_tensorflow.stats import (
    EAGER_TENSOR,
    Col,
    FlatWriter,
    compiled,
    flat_entry,
    write_activation,
    write_forward,
)

__all__ = ["TensorFlowAdapter"]

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


_COMPILED = ("train_function", "test_function", "predict_function")

_NO_PARAM_GRADS = (
    "graddebug: dbg.step() closed a step with no parameter gradients: TensorFlow keeps none on "
    "the variables, so parameter rows need dbg.step(tape.gradient(loss, "
    "model.trainable_variables)) or watch(model, optimizer=opt). Only layer outputs and taps "
    "are recorded until then."
)

_UNSEEN_STRATEGY = (
    "graddebug: the model runs under a {name} of {count} replicas that graddebug did not see "
    "on entering watch(): only replica 0 is recorded. Build the model under "
    "strategy.scope(), or enter watch() inside it."
)


@dataclass
class _Patch:
    obj: Any
    attr: str
    had: bool
    old: Any

    def undo(self) -> None:
        if self.had:
            object.__setattr__(self.obj, self.attr, self.old)
        elif self.attr in vars(self.obj):
            object.__delattr__(self.obj, self.attr)


class TensorFlowAdapter(BaseAdapter):
    """Watches a Keras model or layer, named variables (``params=``), and taps."""

    name = "tensorflow"

    def __init__(
        self,
        context: WatchContext,
        model: Any,
        params: Mapping[str, Any] | None,
        options: WatchOptions,
    ) -> None:
        if model is not None:
            if not isinstance(model, keras.layers.Layer):
                raise ConfigError(
                    f"the TensorFlow adapter watches Keras models and layers, not "
                    f"{type(model).__name__}; pass variables as params={{'name': v}} or use tap()."
                )
            if keras.backend.backend() != "tensorflow":
                raise ConfigError(
                    f"Keras runs on the {keras.backend.backend()!r} backend; graddebug's "
                    "TensorFlow adapter needs KERAS_BACKEND=tensorflow."
                )
        super().__init__(context, options)
        self._model = model
        self._strategy = strategy_of(model, (params or {}).values())
        self._buffers = StateBuffers(self._strategy)
        self._index = LayerIndex(model) if model is not None else None
        self._targets: dict[str, Any] = {}  # layer name -> keras layer
        self._slots: dict[tuple[str, str, int], Slot] = {}
        self._graph_calls: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, int], int]] = (
            weakref.WeakKeyDictionary()
        )
        self._patches: list[_Patch] = []
        self._eager_calls: dict[tuple[str, str, int], int] = {}
        # The sentinel rows of the open eager step, written when it is read (see _watch)
        self._eager_rows = EagerRows()
        self._peeked: Rows | None = None  # see pending_for_close()
        self._fused_close: Any = None  # see _close_given
        # the fused close's concrete function and flat entry point, by which gradients are None
        self._fused_calls: dict[tuple[tuple[bool, ...], bool], tuple[Any, Any]] = {}
        self._recording_var: tf.Variable | None = None
        self._full_var: tf.Variable | None = None  # the tier of the next step, for graphs
        # What the two hold: an eager assign is an op dispatch, skipped when nothing changes.
        self._recording_now = self._full_now = True
        self._scale: LossScale | None = None  # the loss scaling of the bound optimizer
        self._ops: OpCapture | None = None  # op-level capture (ops=True, escalate=True)
        if self._index is not None:
            self._targets = self._add_layers(
                self._index.named, self._index.select(options.layers),
                lambda layer: getattr(layer, "data_format", None) == "channels_first",
                keeps_finite)
        # In a graph, TF's optimizer fuses a BatchNormalization with the op that follows it (and
        # their gradients likewise); an identity between them stops that, and the fused and
        # unfused kernels round differently: the weights of a watched ResNet50 under fit would
        # differ in their last bits. So in a graph, batch norms are recorded by their
        # parameters only, unless the user asked for their outputs (layers=, keep=, intervene=).
        self._graph_unwrapped = {
            name for name, target in self._targets.items()
            if isinstance(target, keras.layers.BatchNormalization) and options.layers is None
            and not self._layers[name].keep and self._layers[name].intervention is None}
        scaler = options.scaler
        if scaler is not None and not getattr(LossScale.of(scaler), "dynamic", False):
            raise ConfigError(
                f"scaler={scaler!r} is not a loss scaler of Keras: there the scaler is the "
                "keras.optimizers.LossScaleOptimizer itself; pass it as scaler= or optimizer=."
            )
        self._add_param_keys(params or {})
        self._params = ParamSet(
            self._buffers, self._index, params or {},
            None if options.layers is None else list(self._targets),
            options.keep, options.param_stats == "full", graph_unread=self._graph_unwrapped,
        )

    # -- Adapter protocol ---------------------------------------------------------------

    def attach(self) -> None:
        """Wrap every watched layer's ``call`` and the optimizer; drop Keras' compiled
        functions so that ``fit``/``evaluate``/``predict`` trace the wrapped calls."""
        # The next step's: a Watcher entered again goes on from where it left off.
        self._recording_now, self._full_now = self._ctx.recording, self._ctx.full_stats
        if self._options.every > 1:
            self._recording_var = tf.Variable(self._recording_now, trainable=False,
                                              name="graddebug_recording")
        elif self._options.full_stats_every > 1:
            self._full_var = tf.Variable(self._full_now, trainable=False,
                                         name="graddebug_full_stats")
        # State created now, eagerly, spares the user's tf.function a second trace.
        self._buffers.reserve(sum(layer.capture for layer in self._layers.values()))
        if self._model is not None and (self._options.ops or self._options.escalate):
            self._ops = self._op_capture()
        self._params.resolve()
        for name, target in self._targets.items():
            self._patch(target, "call", self._wrap_call(self._layers[name], target.call))
        if self._options.scaler is not None:
            self.take_gradients(self._options.scaler)
        if self._model is not None:
            self._reset_compiled()

    def detach(self) -> None:
        """Restore every ``call`` and optimizer method, and drop the functions Keras compiled
        while they were wrapped."""
        for patch in reversed(self._patches):
            patch.undo()
        self._patches.clear()
        if self._ops is not None:
            self._ops.remove()
        if self._model is not None:
            self._reset_compiled()
        self._eager_calls.clear()
        self._eager_rows.clear()

    def _patch(self, obj: Any, attr: str, value: Any) -> None:
        had = attr in vars(obj)
        self._patches.append(_Patch(obj, attr, had, vars(obj).get(attr)))
        object.__setattr__(obj, attr, value)

    def _reset_compiled(self) -> None:
        for attr in _COMPILED:
            if getattr(self._model, attr, None) is not None:
                setattr(self._model, attr, None)

    def take_gradients(self, optimizer: Any) -> None:
        """Take parameter gradients from ``optimizer.apply``.

        Under loss scaling (a ``LossScaleOptimizer``, or ``loss_scale_factor``) the gradients
        handed to ``apply`` carry the scale: it is divided out of their statistics and of the
        layer outputs', and a ``LossScaleOptimizer``'s skipped steps are marked. Under a
        strategy of several replicas, the gradients are all-reduced as the optimizer does
        before they are measured.

        The optimizer's steps close no graddebug step (this adapter keeps no step clock): an
        optimizer step inside a compiled ``tf.function`` cannot call back into Python each
        step, so ``dbg.step()`` (or ``dbg.callback()``) closes the step.

        Raises:
            ConfigError: ``optimizer`` has no ``apply`` method.
        """
        if any(p.obj is optimizer and p.attr == "apply" for p in self._patches):
            return
        if not callable(getattr(optimizer, "apply", None)):
            raise ConfigError(
                f"optimizer={optimizer!r} is not a Keras optimizer (it has no apply method)."
            )
        scale = self._scale = LossScale.of(optimizer)
        if scale is not None and scale.dynamic:
            self._buffers.ensure_scaler()
        original = optimizer.apply

        @functools.wraps(original)
        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            grads = list(grads)
            variables = (
                list(trainable_variables)
                if trainable_variables is not None
                else list(getattr(optimizer, "_trainable_variables", []))
            )
            before = self._on_apply(grads, variables)
            result = original(grads, trainable_variables)
            if before is not None:
                self._on_scaled_step(before)
            return result

        self._patch(optimizer, "apply", apply)

    def has_pending(self) -> bool:
        """Whether a gradient was recorded since the last step closed (one read of the
        buffers)."""
        return self._peek(closing=False)

    def pending_for_close(self) -> bool:
        """As :meth:`has_pending`; a True answer keeps the rows it read for the close that
        follows (:class:`graddebug.adapter.ReadAhead`)."""
        return self._peek(closing=True)

    def _peek(self, closing: bool) -> bool:
        self._flush_eager_rows()
        rows = self._buffers.peek()
        pending = bool((rows.acts[..., Col.BWD] > 0).any() or (rows.params[:, 0] > 0).any())
        self._peeked = rows if closing and pending else None
        return pending

    def _model_layer_names(self) -> list[str]:
        return list(self._index.named) if self._index is not None else []

    def train_step(
        self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any, optimizer: Any
    ) -> Sequence[Any] | None:
        """One eager ``GradientTape`` step: ``loss_fn(model(inputs, training=True),
        *loss_args)``, its gradients, and ``optimizer.apply_gradients`` when given."""
        model = self._model
        if model is None:
            raise ConfigError("train_step needs a model; watch(model) was given none.")
        with tf.GradientTape() as tape:
            loss = loss_fn(model(inputs, training=True), *loss_args)
        if tf.size(loss) != 1:
            raise ConfigError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}.")
        self._params.resolve()
        variables = self._params.aligned
        grads = tape.gradient(loss, variables)
        if optimizer is not None:
            optimizer.apply_gradients(
                [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
            )
        return list(grads)

    def distribution(self) -> Distribution:
        """One process; under a ``tf.distribute`` strategy, its replicas in sync and the
        strategy's class name (each row carries its replica's index itself), written by this
        one process."""
        strategy = self._strategy
        if strategy is None:
            return Distribution()
        return Distribution(rank=0, world_size=int(strategy.num_replicas_in_sync),
                            backend=type(strategy).__name__, processes=1)

    def callback(self, **options: Any) -> Any:
        """A Keras callback for ``model.fit`` that closes a step after each batch."""
        from graddebug_tensorflow.callback import GradDebugCallback

        return GradDebugCallback(self._ctx.watcher, self.take_gradients, **options)

    # -- layer outputs and taps -----------------------------------------------------------

    def _wrap_call(self, layer: LayerSpec, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            ops = self._ops
            if ops is None:
                return self._on_output(layer, original(*args, **kwargs))
            with ops.layer(layer):
                output = original(*args, **kwargs)
            return self._on_output(layer, output)

        return call

    def _op_capture(self) -> OpCapture | None:
        """Op-level capture, or None where it cannot run (several replicas: one warning)."""
        option = "ops" if self._options.ops else "escalate"
        if self._buffers.replicas > 1:
            self._ctx.warn_once("ops-replicas", (
                f"graddebug: {option}=True is not supported under a tf.distribute strategy of "
                "several replicas; layer-level capture goes on without op-level events."))
            return None
        return OpCapture(self._ctx.internal_error, gated=not self._options.ops)

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Pass ``tensor`` through the identity that records (and alters) its gradient."""
        if not isinstance(tensor, (tf.Tensor, tf.Variable, keras.Variable)):
            raise ConfigError(
                f"tap({type(tensor).__name__}, {name!r}): the TensorFlow adapter taps "
                "tf.Tensor and variables only."
            )
        if isinstance(tensor, (tf.Variable, keras.Variable)):
            tensor = tf.convert_to_tensor(tensor)
        return self._on_output(self._tap_layer(name, intervention), tensor)

    def _on_output(self, layer: LayerSpec, output: Any) -> Any:
        if self._ops is not None:
            with self._ops.own():
                return self._watch_output(layer, output)
        return self._watch_output(layer, output)

    def _watch_output(self, layer: LayerSpec, output: Any) -> Any:
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

    def _on_dataclass(self, layer: LayerSpec, output: Any) -> Any:
        """A dataclass output, which ``tf.nest`` takes for one leaf: its fields are watched as
        a dict's keys (``output.<field>``) and put back into a copy of it."""
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        watched = self._on_output(layer, fields)
        if watched is fields:
            return output
        new = copy.copy(output)
        for name, value in watched.items():
            object.__setattr__(new, name, value)  # frozen dataclasses too
        return new

    def _watch(self, layer: LayerSpec, tname: str, tensor: tf.Tensor, eager: bool) -> tf.Tensor:
        spec = layer.intervention
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            layer.check_mask(spec.mask, tuple(tensor.shape), is_mask_tensor(spec.mask))
        record = layer.capture and (not eager or self._ctx.recording)
        if not record and (spec is None or not spec.active):
            return tensor
        slot = self._slot(layer, tname, eager) if record else None
        if slot is not None and eager:
            # One replica: a sum op, or no op at all, instead of a writer call (~0.2 ms)
            if self._buffers.replicas > 1 or not self._eager_rows.forward(
                    slot.var, slot.row, tensor, layer.check_forward):
                _write_forward(self._buffers.local(slot.var), slot.row_tensor, tensor,
                               layer.check_forward)
        elif slot is not None:
            write_forward(self._buffers.local(slot.var), slot.row, tensor, layer.check_forward)
        axis = unit_axis(tensor.shape.rank, layer.channels_first)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return self._on_grad(layer, slot, spec, axis, dy)

        def identity(x: tf.Tensor) -> tf.Tensor:
            if eager and _record_operation is not None and type(x) is EAGER_TENSOR:
                return _eager_identity(x, grad)
            return _custom_identity(x, grad)

        watched = identity(tensor)
        if self._ops is not None:
            self._ops.alias(watched, tensor)
        logits = carry_keras_attributes(tensor, watched)
        if logits is not None:
            # Keras losses read a softmax or sigmoid output's logits (``_keras_logits``) and
            # differentiate those, not the probabilities: the gradient that reaches this layer
            # flows through the logits, so they pass through the same recording identity.
            watched._keras_logits = identity(logits)
        return watched

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

    def _on_grad(
        self,
        layer: LayerSpec,
        slot: Slot | None,
        spec: Intervention | None,
        unit_axis: int | None,
        dy: tf.Tensor,
    ) -> tf.Tensor:
        if self._ops is not None:
            with self._ops.own():
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
        new = dy
        if spec is not None and spec.active:
            new = intervene(spec, layer.name, dy, self._ctx.internal_error)
        if slot is None:
            return new
        with self._fail_open(layer.name):
            pre = dy if new is not dy else None

            def write() -> tf.Tensor:
                scale = None if self._scale is None else self._scale.current()
                var = self._buffers.local(slot.var)
                full: Any = layer.keep or self._full_var is None
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
                                     full or self._full_var)
                if slot.keep_var is not None and (
                        self._buffers.replicas == 1 or replica_index() == 0):
                    slot.keep_var.assign(new)
                return tf.constant(True)

            self._when_recording(write)
        return new

    def _when_recording(self, write: Callable[[], tf.Tensor]) -> None:
        """Run ``write`` now (eager), or on recorded steps only (a graph, with ``every=``)."""
        if self._recording_var is None or tf.executing_eagerly():
            write()
        else:
            tf.cond(self._recording_var, write, lambda: tf.constant(False))

    # -- parameter gradients ------------------------------------------------------------

    def _on_apply(self, grads: list[Any], variables: list[Any]) -> Any:
        """Record the gradients an optimizer applies (divided by the loss scale they carry).

        Returns:
            The loss scale of their backward pass, read before the optimizer changes it,
            where a ``LossScaleOptimizer`` may skip the step; else None.
        """
        if tf.executing_eagerly() and not self._ctx.recording:
            return None
        with self._fail_open("optimizer"):
            scale = None if self._scale is None else self._scale.current()
            pairs = all_reduced(self._params.applied(grads, variables))
            self._when_recording(lambda: self._params.write_applied(pairs, scale))
            return scale if self._scale is not None and self._scale.dynamic else None
        return None

    def _on_scaled_step(self, before: Any) -> None:
        """After a ``LossScaleOptimizer``'s apply: note whether it skipped the step."""
        scale, row = self._scale, self._buffers.scaler
        if scale is None or row is None:
            return
        with self._fail_open("optimizer"):
            if self._buffers.replicas > 1:
                if replica_index() != 0:
                    return
                row = self._buffers.copy(row, 0)
            after = scale.current()
            target = row

            def write() -> tf.Tensor:
                note_step(target, before, after)
                return tf.constant(True)

            self._when_recording(write)

    def _given_scale(self) -> Any:
        """The loss scale that gradients handed to ``step(grads)`` carry: that of the last
        ``apply`` in the step, else the one in use now; None without loss scaling."""
        scale, row = self._scale, self._buffers.scaler
        if scale is None:
            return None
        now = tf.cast(scale.current(), tf.float64)
        if row is None:
            return now
        row = self._buffers.copy(row, 0)
        return tf.where(row[ScalerCol.APPLIED] > 0, row[ScalerCol.SCALE], now)

    # -- closing a step -----------------------------------------------------------------

    def _flush_eager_rows(self) -> None:
        """Write the eager step's sentinel rows into the buffers before they are read. The
        work of the step's hooks, done when it is read: fail-open as the hooks are."""
        with self._fail_open("step"):
            self._eager_rows.flush()

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Read and clear the buffers (one transfer) and turn them into records."""
        peeked, self._peeked = self._peeked, None
        try:
            if record:
                self._flush_eager_rows()
            rows = None
            if grads is not None:  # checks the count on every step
                grads = list(grads)
                self._params.check_given(grads)
                # A skipped step stops at the check: its buffers are cleared below, unread.
                if record and self._buffers.replicas == 1:
                    rows = self._close_given(grads, self._given_scale())
                elif record:
                    self._params.store_given(grads, self._given_scale())
                peeked = None
            if not record:
                self._buffers.clear()
                return StepResult()
            if rows is None and peeked is not None:  # read by pending_for_close()
                rows = peeked
                self._buffers.clear()
            elif rows is None:
                rows = self._buffers.read_and_clear()
            result = StepResult()
            slots = list(self._slots.values())
            for replica, acts in enumerate(rows.acts):
                step_records(step, slots, acts, result, replica)
            params = self._params.resolve()
            # A backward reached the layers, yet no parameter gradient was handed over.
            if (result.records and grads is None and params
                    and not handed_over(rows.params, len(params))):
                self._ctx.warn_once("no-param-grads", _NO_PARAM_GRADS)
            param_records(step, params, rows.params, result, grads is not None,
                          self._param_depth)
            skipped = skipped_step(step, rows.scaler)
            if skipped is not None:
                result.events.append(skipped)
            if self._ops is not None:
                self._op_events(step, result)
            return result
        finally:
            self._eager_calls.clear()
            self._eager_rows.clear()
            recording = (step + 1) % self._options.every == 0
            if self._recording_var is not None and recording != self._recording_now:
                self._recording_var.assign(recording)
                self._recording_now = recording

    def _op_events(self, step: int, result: StepResult) -> None:
        """Add the op-level events of the step, where the Watcher asked for them; under
        ``escalate=True``, arm the checks of the next steps after a suspect step."""
        ops = self._ops
        assert ops is not None
        with self._fail_open("ops"):
            codes = ops.read()
            if self._ctx.capture_ops:
                if codes is not None:
                    result.events += ops.nonfinite_events(step, codes, result.events)
                if any(e.event in _CUT_EVIDENCE for e in result.events):
                    result.events += ops.cut_events(step)
            # The Watcher decides after this step whether the next recorded one captures
            # operations; the checks of a graph cannot wait for its answer, so they run on
            # every step after one that may arm it, and their codes are used only if it did.
            ops.arm(any(e.event in _SUSPECT for e in result.events)
                    or any(r.nan or r.inf for r in result.records))

    def _close_given(self, grads: list[Any], scale: Any) -> Rows:
        """Write the rows of gradients handed to ``step(grads)``, read every buffer and
        zero it, in one call of one ``tf.function`` (traced once per model): in eager mode
        that is one dispatch and one transfer instead of a few dozen ops."""
        if self._fused_close is None:
            buffers, params = self._buffers, self._params

            def close(grads: list[Any], scale: Any) -> Any:
                params.store_given(grads, scale)
                flat = buffers.flat()  # read after the write, zeroed after the read
                buffers.clear()
                return flat

            self._fused_close = compiled(close)
        if all(g is None or isinstance(g, tf.Tensor) for g in grads):
            # Dense gradients keep their shapes and dtypes (step() checked them): the traced
            # function is called with its flat inputs, without matching the arguments to a
            # trace again (about 2 ms a step for a few dozen gradients).
            key = (tuple(g is None for g in grads), scale is None)
            found = self._fused_calls.get(key)
            if found is None:
                traced = self._fused_close.get_concrete_function(grads, scale)
                found = self._fused_calls[key] = (traced, flat_entry(traced))
            traced, entry = found
            inputs = [g for g in grads if g is not None]
            if scale is not None:
                inputs.append(scale)
            flat = entry(inputs) if entry is not None else traced(grads, scale)
        else:
            flat = self._fused_close(grads, scale)
        return self._buffers.unpack(None if flat is None else flat.numpy())

    def next_step_full(self, full: bool) -> None:
        """Set the tier that the next step's compiled graphs read."""
        if self._full_var is not None and full != self._full_now:
            self._full_var.assign(full)
            self._full_now = full

    def _param_depth(self, param: Param) -> int:
        return self._depth_of(param.chain)


_CUT_EVIDENCE = frozenset({EventKind.NO_GRAD.value, EventKind.DETACHED_OUTPUT.value,
                           EventKind.UNREACHED.value})
_SUSPECT = _CUT_EVIDENCE | {EventKind.FORWARD_NONFINITE.value}

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
    bookkeeping for variables and composite tensors (about 35 us a call against 180 us)."""
    with _stop_recording():
        out = tf.identity(x)
    _record_operation("graddebug_identity", [out], [x], lambda dy: [grad(dy)])
    return out


_write_forward = FlatWriter(compiled(write_forward))
_write_activation = FlatWriter(compiled(write_activation))

