"""Keras 3 on the JAX backend: :mod:`graddebug_jax`'s identities and rows, inside Keras's own
compiled train step.

``model.fit`` runs a jitted, stateless train step: ``jax.value_and_grad`` of the loss over the
trainable variables' values, then ``optimizer.stateless_apply``. Nothing of it can call back
into Python as it runs, and no gradient is left on a variable. So graddebug puts its work into
the traced computation itself, where it is compiled with the step, through a
:class:`graddebug_jax.recorder.Recorder` (graddebug_jax's public interface for this):

- each watched layer's ``call`` is wrapped on the instance: its floating outputs pass through
  the Recorder's ``jax.custom_vjp`` identities, whose backward rule measures the gradient at
  the output and leaves the backward pass's rows in the trace;
- the model's own ``call`` checks its floating inputs for NaN/Inf
  (:meth:`~graddebug_jax.recorder.Recorder.check_inputs`), and its ``compute_loss`` passes the
  batch's loss through an identity whose forward rule keeps the value (the loss row);
- the optimizer's ``stateless_apply`` (and its eager ``apply``) is wrapped on the instance:
  it measures the gradients it is handed, the weights they were taken at and the update it
  makes (:func:`graddebug_jax.stats.param_rows`), and carries them with everything the trace
  left (:mod:`graddebug_jax.transport`) to the host in one callback: one transfer per step.

Keras's compiled functions are dropped on entering and on leaving, so that the next ``fit``
traces the wrapped (then the plain) step. The step closes at the callback's
``on_train_batch_end`` (or ``dbg.step()``), which waits for the callback in flight; the
callback then records the batch's loss.

Not recorded on this backend: ``keep=`` (dense gradients), op-level capture (``ops=``,
``escalate=``), and parameters that get no gradient (Keras differentiates every trainable
variable, and an unreached one gets zeros, not None). The adapter's ``watch_options`` leave
them out, so ``watch()`` refuses those options.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graddebug.adapter import BaseAdapter, StepResult, WatchContext, WatchOptions
from graddebug.adapter.protocol import GradientSource, TrainingCallback, TrainStep
from graddebug.capture.layers import Intervention, LayerSpec
from graddebug.errors import ConfigError, GradientCountError
from graddebug_jax.closing import given_rows
from graddebug_jax.model import floating_leaves
from graddebug_jax.recorder import Recorder
from graddebug_jax.stats import param_rows
from graddebug_jax.transport import Parcel
from graddebug_keras.callbacks import build_callback
from graddebug_keras.model import LayerIndex as KerasLayers
from graddebug_keras.model import channels_first, reset_compiled
from graddebug_keras.optimizers import Wrapped, check_keras_optimizer

__all__ = ["KerasJaxAdapter"]


class KerasJaxAdapter(BaseAdapter):
    """Watches a Keras model or layer on the JAX backend, and taps.

    What it records travels through a :class:`graddebug_jax.recorder.Recorder`, the public
    interface of graddebug_jax's identities, rows and transport."""

    name = "keras-jax"
    capabilities = frozenset({GradientSource, TrainStep, TrainingCallback})
    # Keras's train step is one compiled JAX function: graddebug measures gradients in it but
    # keeps no dense copies (keep=) and sees no single operation (ops=, escalate=); the model's
    # variables are its parameters (params=), and every statistic is measured on every step.
    watch_options = frozenset({"layers", "intervene", "outputs", "param_stats", "optimizer"})

    def __init__(self, context: WatchContext, model: Any, params: Mapping[str, Any] | None,
                 options: WatchOptions) -> None:
        super().__init__(context, options)
        self._index = KerasLayers(model)
        self._targets = self._add_layers(self._index.named,
                                         self._index.select(options.layers), channels_first)
        self._recorder = Recorder(self._name_param, self._fail_open("step"),
                                  context.internal_error, context.warn_once)
        self._loss: float | None = None  # the loss of the batch trained last, once landed
        self._wrapped: list[Wrapped] = []
        self._optimizers: list[Any] = []
        self._attached = False
        self._applying = False
        self._names: dict[str, tuple[str, str, tuple[str, ...]]] = {}
        for layer, short, var in self._index.variables():
            self._names[str(var.path)] = (layer, short, self._index.chain(layer))

    # -- Adapter protocol -------------------------------------------------------------------

    def attach(self) -> None:
        """Wrap the watched layers' ``call`` and the model's optimizer; drop the compiled
        functions, so that the next ``fit`` traces the wrapped step."""
        self._attached = True
        for name, layer in self._targets.items():
            if self._layers[name].capture:
                self._wrapped.append(Wrapped(layer, "call", self._wrap_call(name)))
        self._wrapped.append(Wrapped(self._index.model, "call", self._wrap_inputs))
        if callable(getattr(self._index.model, "compute_loss", None)):
            self._wrapped.append(Wrapped(self._index.model, "compute_loss", self._wrap_loss))
        optimizer = getattr(self._index.model, "optimizer", None)
        if optimizer is not None:
            self.take_gradients(optimizer)
        reset_compiled(self._index.model)

    def detach(self) -> None:
        """Unwrap the layers and optimizers; drop the compiled functions that hold the
        wrapped step; forget what did not close."""
        self._attached = False
        while self._wrapped:
            self._wrapped.pop().restore()
        self._optimizers.clear()
        reset_compiled(self._index.model)
        self._recorder.reset()
        self._loss = None

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Wait for the callbacks, turn what arrived into records, add the rows of ``grads``
        (a list aligned with ``model.trainable_variables``).

        Raises:
            GradientCountError: ``grads`` does not match the trainable variables.
        """
        if self._recorder.settle():
            # the next fit traces again, its sinks sending themselves
            reset_compiled(self._index.model)
        if not record:
            return self._recorder.skip()
        if grads is not None:
            variables = self._index.model.trainable_variables
            leaves = list(grads)
            if len(leaves) != len(variables):
                raise GradientCountError(
                    f"dbg.step(grads) got {len(leaves)} gradients for {len(variables)} "
                    "trainable variables; pass them in the order of model.trainable_variables.")
            rows = given_rows(leaves, self._options.param_stats == "full")
            paths = [str(v.path) for v in variables]
            shapes = [tuple(v.shape) for v in variables]
            self._recorder.hold_params(paths, shapes, rows)
        return self._recorder.close(step)

    def has_pending(self) -> bool:
        """Whether a backward pass or an update delivered rows since the last close (waits
        for the callbacks in flight)."""
        return self._recorder.pending()

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Pass ``tensor`` through the identity that records (and alters) its cotangent.

        Raises:
            ConfigError: ``tensor`` is not a floating-point JAX array.
        """
        Recorder.check_tap(tensor, name, "Keras on the JAX backend")
        layer = self._tap_layer(name, intervention)
        if layer.depth < 0:
            layer.depth = self._take_depth()
        return self._recorder.watch(tensor, layer)

    @property
    def transfers(self) -> int:
        """Device-to-host transfers of statistics so far (callbacks and fetches)."""
        return self._recorder.transfers

    # -- capabilities -------------------------------------------------------------------------

    def take_gradients(self, optimizer: Any) -> None:
        """Record the gradients, weights and updates of a Keras optimizer until ``detach``
        (:class:`graddebug.adapter.GradientSource`); binding it twice changes nothing.

        Raises:
            ConfigError: ``optimizer`` is not a Keras optimizer.
        """
        check_keras_optimizer(optimizer)
        if any(opt is optimizer for opt in self._optimizers):
            return
        self._optimizers.append(optimizer)
        # Carried, not tied: fit keeps the new values in its own state until the epoch ends,
        # so the close has no output to wait on, only the effects barrier (debug.callback).
        self._recorder.carry(tied=False)
        self._wrapped.append(Wrapped(optimizer, "stateless_apply", self._wrap_stateless))
        self._wrapped.append(Wrapped(optimizer, "apply", self._wrap_apply))

    def train_step(self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any,
                   optimizer: Any) -> Sequence[Any] | None:
        """One eager step for ``graddebug.check``: the gradients of
        ``loss_fn(model(inputs), *loss_args)`` over the trainable variables
        (``model.stateless_call`` under ``jax.grad``), applied by a Keras ``optimizer`` when
        one is given (which records them); else returned for the close."""
        model = self._index.model
        trainable = [v.value for v in model.trainable_variables]
        frozen = [v.value for v in model.non_trainable_variables]

        def loss_of(values: list[Any]) -> Any:
            out, _ = model.stateless_call(values, frozen, inputs, training=True)
            loss = loss_fn(out, *loss_args)
            if jnp.size(loss) != 1:
                raise ConfigError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}.")
            return jnp.reshape(loss, ())

        grads = jax.grad(loss_of)(trainable)
        if optimizer is None:
            return list(grads)
        self.take_gradients(optimizer)
        optimizer.apply(grads, model.trainable_variables)
        return None

    def callback(self, **options: Any) -> Any:
        """Return a Keras callback bound to this Watcher (``model.fit(callbacks=[...])``); it
        binds the model's optimizer when training begins.

        Args:
            **options: ``stop_on=``, ``log=`` and ``every_tensor=`` of
                :class:`graddebug_keras.callbacks.GradDebugCallback`.

        Raises:
            ConfigError: An option that is not the callback's.
        """
        return build_callback(self._ctx, self._prepare, options, loss=self._batch_loss)

    # -- hooks (run while Keras traces its step) ------------------------------------------

    def _prepare(self, model: Any) -> None:
        """Training begins: bind the optimizer ``compile`` gave the model."""
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not any(o is optimizer for o in self._optimizers):
            self.take_gradients(optimizer)
            reset_compiled(self._index.model)

    def _wrap_call(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        layer = self._layers[name]

        def wrap(call: Callable[..., Any]) -> Callable[..., Any]:
            def watched(*args: Any, **kwargs: Any) -> Any:
                probed = None
                with self._fail_open(name):  # a bug here runs the layer untouched
                    probed = self._recorder.probe_args(args)
                if probed is None:
                    return call(*args, **kwargs)
                args, flags = probed
                out = call(*args, **kwargs)
                with self._fail_open(name):
                    return self._watch_output(layer, out, any(f[0] for f in flags))
                return out

            return watched

        return wrap

    def _wrap_loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The model's ``compute_loss``, its scalar result passed through :func:`_kept`."""
        @functools.wraps(original)  # Keras reads its signature (a training= argument?)
        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            with self._fail_open("loss"):
                if isinstance(loss, jax.Array) and loss.size == 1 and jnp.issubdtype(
                        loss.dtype, jnp.floating):
                    return _kept(loss, self._post_loss)
            return loss

        return compute_loss

    def _post_loss(self, value: Any) -> None:
        """A loss's value in the forward pass of a differentiated step: a parcel."""
        def land(values: Sequence[np.ndarray]) -> None:
            if self._attached:
                self._loss = float(np.asarray(values[0]).reshape(()))

        self._recorder.post(Parcel([value], land, rows=False))

    def _batch_loss(self) -> float | None:
        """The loss of the batch trained last (it arrived with the step's transfer), or None;
        read once."""
        loss, self._loss = self._loss, None
        return loss

    def _wrap_inputs(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """The model's own ``call``, its floating inputs checked for NaN/Inf, the check posted
        once its output exists."""
        def checked(*args: Any, **kwargs: Any) -> Any:
            check = None
            with self._fail_open("input"):
                check = self._recorder.check_inputs(args, kwargs)
            out = call(*args, **kwargs)
            if check is not None:
                with self._fail_open("input"):
                    return self._recorder.post_with(out, check)
            return out

        return checked

    def _watch_output(self, layer: LayerSpec, out: Any, inputs_need_grad: bool) -> Any:
        if not any(True for _ in floating_leaves(out)):  # a symbolic call (Keras tensors) or
            return out  # an integer output
        if layer.depth < 0:
            layer.depth = self._take_depth()
        return self._recorder.watch_output(layer, out, inputs_need_grad)

    def _wrap_stateless(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def stateless_apply(optimizer_variables: Any, grads: Any, trainable_variables: Any
                            ) -> Any:
            self._applying = True
            try:
                out = original(optimizer_variables, grads, trainable_variables)
            finally:
                self._applying = False
            with self._fail_open("optimizer"):
                self._measure(list(grads), list(trainable_variables), list(out[0]))
            return out

        return stateless_apply

    def _wrap_apply(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            if self._applying:
                return original(grads, trainable_variables)
            variables = list(trainable_variables if trainable_variables is not None
                             else self._index.model.trainable_variables)
            before = [v.value for v in variables]
            grads = list(grads)
            self._applying = True
            try:
                out = original(grads, trainable_variables)
            finally:
                self._applying = False
            with self._fail_open("optimizer"):
                self._measure(grads, before, [v.value for v in variables],
                              [str(v.path) for v in variables])
            return out

        return apply

    def _measure(self, grads: list[Any], before: list[Any], after: list[Any],
                 paths: list[str] | None = None) -> None:
        """The parameter rows of one update (traced or eager), carried to the host with the
        parcels the trace left (the layer-output rows, the input check, the loss)."""
        if paths is None:
            variables = self._index.model.trainable_variables
            if len(variables) != len(grads):
                self._ctx.warn_once("keras-jax-variables", (
                    f"graddebug: the optimizer applied {len(grads)} gradients to a model of "
                    f"{len(variables)} trainable variables; its parameter rows are left out."))
                return
            paths = [str(v.path) for v in variables]
        shapes = [tuple(np.shape(g)) for g in grads]
        updates = [a - b for a, b in zip(after, before, strict=True)]
        rows = param_rows(grads, updates, before, self._options.param_stats == "full")

        def land(values: Sequence[np.ndarray]) -> None:
            if self._attached:  # read when the step runs, not when it was traced
                self._recorder.add_params(paths, shapes, values[0])

        self._recorder.gather(Parcel([rows], land))

    # -- names ----------------------------------------------------------------------------

    def _name_param(self, path: str) -> tuple[str, str, int]:
        """``(layer, tensor, depth)`` of a parameter row."""
        named = self._names.get(path)
        if named is None:
            layer, _, short = path.rpartition("/")
            return layer or self._index.root, short or path, -1
        layer, short, chain = named
        return layer, short, self._depth_of(chain)

    def _model_layer_names(self) -> list[str]:
        """Every layer name of the model, watched or not (for suggestions)."""
        return [*self._index.named, self._index.root]



def _kept(loss: jax.Array, post: Callable[[Any], None]) -> jax.Array:
    """``loss`` through a ``jax.custom_vjp`` identity whose forward rule, which runs only where
    the loss is differentiated (a train step, not an evaluation), posts the loss's value; the
    cotangent passes unchanged."""
    @jax.custom_vjp
    def ident(x: Any) -> Any:
        return x

    def fwd(x: Any) -> tuple[Any, None]:
        post(x)
        return x, None

    def bwd(_: None, ct: Any) -> tuple[Any]:
        return (ct,)

    ident.defvjp(fwd, bwd)
    return ident(loss)  # type: ignore[no-any-return]
