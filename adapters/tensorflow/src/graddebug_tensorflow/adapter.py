"""The TensorFlow/Keras adapter: the Adapter protocol and its capabilities, over collaborators
that each hold one part of a step.

The adapter wraps each watched layer's ``call`` and the optimizer's ``apply`` on attach and
gives them back on detach. The rest it hands on: :mod:`.watching` hooks layer outputs and taps
(a custom-gradient identity around every floating output), :mod:`.captures` holds the TF state
their statistics are written into, :mod:`.params` the watched variables and their rows, and
:mod:`.closing` reads that state once per step and turns it into records. Parameter gradients
are those handed to ``Watcher.step(grads)``, or those the optimizer applies.

Under a ``tf.distribute`` strategy of several replicas (:mod:`.distributed`), each replica
records its layer outputs into its own copy of the buffers, and its rows carry its index in
``rank``; parameter rows are those of the all-reduced gradients, recorded once. Under loss
scaling (:mod:`.scaling`) the scale is divided out of every statistic, and the steps a
``LossScaleOptimizer`` skips are marked. Around the optimizer's ``apply``, :mod:`.updates`
samples the watched variables, for the norms of the weights and of the update on their rows.
Under ``fit``, the loss that ``compute_loss`` returns is written into the buffers too, for
the callback's loss rows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from graddebug.adapter import BaseAdapter, Distribution, StepResult, WatchContext, WatchOptions
from graddebug.adapter.protocol import (
    CompiledTiers,
    Distributed,
    GradientSource,
    ReadAhead,
    TrainingCallback,
    TrainStep,
)
from graddebug.capture.layers import Intervention
from graddebug.errors import ConfigError
from graddebug_keras.callbacks import build_callback
from graddebug_keras.model import reset_compiled
from graddebug_keras.optimizers import Wrapped
from graddebug_tensorflow.captures import StateBuffers, StepGates
from graddebug_tensorflow.closing import StepCloser
from graddebug_tensorflow.distributed import all_reduced, replica_index, strategy_of
from graddebug_tensorflow.model import LayerIndex
from graddebug_tensorflow.ops.capture import OpCapture
from graddebug_tensorflow.outputs import keeps_finite, weighted
from graddebug_tensorflow.params import Param, ParamSet
from graddebug_tensorflow.scaling import LossScale, note_step
from graddebug_tensorflow.updates import UpdateView
from graddebug_tensorflow.watching import OutputWatch

__all__ = ["TensorFlowAdapter"]

class TensorFlowAdapter(BaseAdapter):
    """Watches a Keras model or layer, named variables (``params=``), and taps."""

    name = "tensorflow"
    capabilities = frozenset({GradientSource, Distributed, CompiledTiers, ReadAhead, TrainStep,
                              TrainingCallback})
    watch_options = frozenset({"params", "layers", "keep", "intervene", "outputs", "param_stats",
                               "optimizer", "scaler", "ops", "escalate", "full_stats_every"})

    def __init__(
        self,
        context: WatchContext,
        model: Any,
        params: Mapping[str, Any] | None,
        options: WatchOptions,
    ) -> None:
        if model is not None:
            _check_model(model)
        super().__init__(context, options)
        self._model = model
        self._strategy = strategy_of(model, (params or {}).values())
        self._buffers = StateBuffers(self._strategy)
        self._gates = StepGates()
        self._index = LayerIndex(model) if model is not None else None
        self._targets: dict[str, Any] = {}  # layer name -> keras layer
        self._patches: list[Wrapped] = []
        if self._index is not None:
            self._targets = self._add_layers(
                self._index.named, self._index.select(options.layers),
                lambda layer: getattr(layer, "data_format", None) == "channels_first",
                keeps_finite, weighted)
        unwrapped = self._graph_unwrapped()
        self._outputs = OutputWatch(context, self._buffers, self._gates, self._fail_open,
                                    self._take_depth, unwrapped)
        if options.scaler is not None:
            _check_scaler(options.scaler)
        self._add_param_keys(params or {})
        self._params = ParamSet(
            self._buffers, self._index, params or {},
            None if options.layers is None else list(self._targets),
            options.keep, options.param_stats == "full", graph_unread=unwrapped,
        )
        self._updates = UpdateView(self._buffers)
        self._closer = StepCloser(context, self._buffers, self._params, self._outputs,
                                  self._gates, options.every, self._fail_open,
                                  self._param_depth, self._updates)

    def _graph_unwrapped(self) -> set[str]:
        """The layers whose outputs a graph leaves unwatched.

        In a graph, TF's optimizer fuses a BatchNormalization with the op that follows it (and
        their gradients likewise); an identity between them stops that, and the fused and
        unfused kernels round differently: the weights of a watched ResNet50 under fit would
        differ in their last bits. So in a graph, batch norms are recorded by their parameters
        only, unless the user asked for their outputs (layers=, keep=, intervene=).
        """
        return {
            name for name, target in self._targets.items()
            if isinstance(target, keras.layers.BatchNormalization)
            and self._options.layers is None
            and not self._layers[name].keep and self._layers[name].intervention is None}

    # -- Adapter protocol ---------------------------------------------------------------

    def attach(self) -> None:
        """Wrap every watched layer's ``call`` and the optimizer; drop Keras' compiled
        functions so that ``fit``/``evaluate``/``predict`` trace the wrapped calls."""
        # The next step's: a Watcher entered again goes on from where it left off.
        self._gates.create(self._options.every, self._options.full_stats_every,
                           self._ctx.recording, self._ctx.full_stats)
        # State created now, eagerly, spares the user's tf.function a second trace.
        self._buffers.reserve(sum(layer.capture for layer in self._layers.values()))
        if self._model is not None and (self._options.ops or self._options.escalate):
            self._outputs.ops = self._op_capture()
        self._params.resolve()
        for name, target in self._targets.items():
            self._patch(target, "call", self._outputs.wrap_call(self._layers[name], target.call))
        if self._model is not None and self._options.outputs and all(
                target is not self._model for target in self._targets.values()):
            self._patch(self._model, "call", self._outputs.wrap_model_call(self._model.call))
        if self._options.scaler is not None:
            self.take_gradients(self._options.scaler)
        if self._model is not None:
            reset_compiled(self._model)

    def detach(self) -> None:
        """Restore every ``call`` and optimizer method, and drop the functions Keras compiled
        while they were wrapped."""
        for patch in reversed(self._patches):
            patch.restore()
        self._patches.clear()
        if self._outputs.ops is not None:
            self._outputs.ops.remove()
        if self._model is not None:
            reset_compiled(self._model)
        self._outputs.end_step()

    def _patch(self, obj: Any, attr: str, value: Any) -> None:
        """Set ``obj.attr`` to ``value`` on the instance, to be undone on detach."""
        self._patches.append(Wrapped(obj, attr, lambda _original: value))

    def _op_capture(self) -> OpCapture | None:
        """Op-level capture, or None where it cannot run (several replicas: one warning)."""
        option = "ops" if self._options.ops else "escalate"
        if self._buffers.replicas > 1:
            self._ctx.warn_once("ops-replicas", (
                f"graddebug: {option}=True is not supported under a tf.distribute strategy of "
                "several replicas; layer-level capture goes on without op-level events."))
            return None
        return OpCapture(self._ctx.internal_error, gated=not self._options.ops)

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
        scale = self._outputs.scale = LossScale.of(optimizer)
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
            sampled = self._before_update(variables)
            result = original(grads, trainable_variables)
            if sampled is not None:
                self._after_update(sampled)
            if before is not None:
                self._on_scaled_step(before)
            return result

        self._patch(optimizer, "apply", apply)

    def take_loss(self, model: Any) -> None:
        """Record the loss that ``model.compute_loss`` returns in training (what ``fit``'s
        ``train_step`` differentiates, before any loss scaling), in the compiled step itself:
        :meth:`step_loss` gives it after the close. Keras' ``logs["loss"]`` is the running
        mean over the epoch, weighted by batch size, so it cannot give a batch's loss exactly.

        Only calls that say ``training=True`` count (``evaluate`` and ``fit``'s validation
        call it with False). A ``train_step`` of one's own that does not call
        ``compute_loss`` records no loss; nor does an override of it without the
        ``training`` argument.
        """
        if any(p.obj is model and p.attr == "compute_loss" for p in self._patches):
            return
        original = getattr(model, "compute_loss", None)
        if not callable(original):
            return
        buffers = self._buffers
        loss_var = buffers.ensure_loss()

        @functools.wraps(original)
        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            training = kwargs.get("training", args[4] if len(args) > 4 else False)
            if training is True and loss is not None and (
                    not tf.executing_eagerly() or self._ctx.recording):
                with self._fail_open("loss"):
                    value = tf.cast(tf.stop_gradient(tf.reshape(loss, [])), tf.float64)

                    def write() -> tf.Tensor:
                        buffers.local(loss_var).assign_add(
                            tf.stack([value, tf.constant(1.0, tf.float64)]))
                        return tf.constant(True)

                    self._gates.when_recording(write)
            return loss

        self._patch(model, "compute_loss", compute_loss)

    def step_loss(self) -> float | None:
        """The mean loss that ``compute_loss`` returned in the step closed last (see
        :meth:`take_loss`); None where it returned none."""
        return self._closer.loss

    def has_pending(self) -> bool:
        """Whether a gradient was recorded since the last step closed (one read of the
        buffers)."""
        return self._closer.pending(closing=False)

    def pending_for_close(self) -> bool:
        """As :meth:`has_pending`; a True answer keeps the rows it read for the close that
        follows (:class:`graddebug.adapter.ReadAhead`)."""
        return self._closer.pending(closing=True)

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Read and clear the buffers (one transfer) and turn them into records (see
        :class:`~.closing.StepCloser`)."""
        return self._closer.close(step, grads, record)

    def next_step_full(self, full: bool) -> None:
        """Set the tier that the next step's compiled graphs read."""
        self._gates.set_full(full)

    def _model_layer_names(self) -> list[str]:
        """Every layer name of the model, watched or not (for suggestions)."""
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
        """A Keras callback for ``model.fit`` that closes a step after each batch
        (:class:`graddebug_keras.callbacks.GradDebugCallback`, that of every Keras backend);
        when training begins it takes the parameter gradients from the model's optimizer
        and the loss from its ``compute_loss``.

        Raises:
            ConfigError: An option that is not the callback's.
        """
        def prepare(model: Any) -> None:
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None:
                self.take_gradients(optimizer)
            self.take_loss(model)

        return build_callback(self._ctx, prepare, options, loss=self.step_loss)

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Pass ``tensor`` through the identity that records (and alters) its gradient."""
        if not isinstance(tensor, (tf.Tensor, tf.Variable, keras.Variable)):
            raise ConfigError(
                f"tap({type(tensor).__name__}, {name!r}): the TensorFlow adapter taps "
                "tf.Tensor and variables only."
            )
        if isinstance(tensor, (tf.Variable, keras.Variable)):
            tensor = tf.convert_to_tensor(tensor)
        return self._outputs.on_output(self._tap_layer(name, intervention), tensor)

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
            loss_scale = self._outputs.scale
            scale = None if loss_scale is None else loss_scale.current()
            pairs = all_reduced(self._params.applied(grads, variables))
            self._gates.when_recording(lambda: self._params.write_applied(pairs, scale))
            return scale if loss_scale is not None and loss_scale.dynamic else None
        return None

    def _before_update(self, variables: list[Any]) -> list[tuple[int, Any]] | None:
        """Before an ``apply``: keep the samples of the watched variables it updates (see
        :mod:`.updates`); returns them as ``(row, variable)``, or None where nothing is
        sampled."""
        if tf.executing_eagerly() and not self._ctx.recording:
            return None
        with self._fail_open("optimizer"):
            view = self._updates
            view.resolve([p.var for p in self._params.resolve()])
            pairs = self._params.rows_of(variables)
            if not view.active or not pairs:
                return None
            self._gates.when_recording(lambda: view.before(pairs))
            return pairs
        return None

    def _after_update(self, pairs: list[tuple[int, Any]]) -> None:
        """After an ``apply``: write the rows of the weights and the update it applied."""
        with self._fail_open("optimizer"):
            view = self._updates
            self._gates.when_recording(lambda: view.after(pairs))

    def _on_scaled_step(self, before: Any) -> None:
        """After a ``LossScaleOptimizer``'s apply: note whether it skipped the step."""
        scale, row = self._outputs.scale, self._buffers.scaler
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

            self._gates.when_recording(write)

    def _param_depth(self, param: Param) -> int:
        """The depth of ``param``'s layer, or of the first layer around it that ran forward."""
        return self._depth_of(param.chain)


def _check_model(model: Any) -> None:
    """Refuse what this adapter cannot watch.

    Raises:
        ConfigError: ``model`` is not a Keras layer, or Keras runs on another backend.
    """
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


def _check_scaler(scaler: Any) -> None:
    """Refuse a ``scaler=`` that is not a Keras loss scaler.

    Raises:
        ConfigError: ``scaler`` is not a ``LossScaleOptimizer``.
    """
    if not getattr(LossScale.of(scaler), "dynamic", False):
        raise ConfigError(
            f"scaler={scaler!r} is not a loss scaler of Keras: there the scaler is the "
            "keras.optimizers.LossScaleOptimizer itself; pass it as scaler= or optimizer=."
        )
