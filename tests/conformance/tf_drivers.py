"""Drivers of Keras models (a GradientTape loop, eager or in a ``tf.function``; ``model.fit`` on
any Keras backend) and of TF1 graphs run by a session.

Keras is imported when a driver is built, on whatever backend ``KERAS_BACKEND`` names: the
``keras-fit-torch`` and ``keras-fit-jax`` modes build theirs in a child process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from drivers import Driver, patch_path
from references import (
    ACTS,
    LAYERS,
    LR,
    Grads,
    Weights,
    batch,
    initial_weights,
    jax_grads,
    tf1_grads,
    tf_grads,
    torch_grads,
)

import graddebug


class _KerasRun:
    """A Keras model, its optimizer, the batch, and the train step once built."""

    def __init__(self, model: Any, optimizer: Any, wide: bool) -> None:
        self.model, self.optimizer, self.wide = model, optimizer, wide
        self.x, self.y = batch(wide)
        self.step: Any = None


class KerasDriver(Driver):
    """What every Keras mode shares: the model, its weights, its rows and its probe."""

    def __init__(self) -> None:
        import keras

        self.keras = keras

        class CutDense(keras.layers.Dense):  # type: ignore[misc]
            """A Dense layer whose input is cut from the graph."""

            def call(self, inputs: Any, training: Any = None) -> Any:
                return super().call(keras.ops.stop_gradient(inputs))

        self.CutDense = CutDense

    def build(self, variant: str = "mlp", plain: bool = False) -> Any:
        keras, wide = self.keras, variant == "wide"
        weights = initial_weights(wide)
        layers: list[Any] = [keras.Input((weights["l1"][0].shape[0],))]
        for name, act in zip(LAYERS, ACTS, strict=True):
            kind = self.CutDense if variant == "cut" and name == "l2" else keras.layers.Dense
            layers.append(kind(weights[name][0].shape[1], activation=act, name=name))
        model = keras.Sequential(layers)
        for name in LAYERS:
            w, b = weights[name]
            if variant == "nan" and name == "l2":
                b = np.full_like(b, np.nan)
            model.get_layer(name).set_weights([w, b])
        return _KerasRun(model, keras.optimizers.SGD(LR), wide)

    def weights(self, run: Any) -> Weights:
        return {n: tuple(np.array(a) for a in run.model.get_layer(n).get_weights())
                for n in LAYERS}  # type: ignore[misc]

    def rows(self) -> dict[str, tuple[str, str]]:
        return {f"{n}.{k}": (n, t) for n in LAYERS for k, t in (("w", "kernel"), ("b", "bias"))}

    def probe(self, run: Any) -> Any:
        names = ("apply_gradients", "apply", "stateless_apply", "minimize", "update_step",
                 "call", "__call__", "train_step")
        hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")

        def patched(obj: Any) -> tuple[Any, ...]:
            own = sorted(k for k in vars(obj) if k in names or "graddebug" in k)
            return type(obj), own, [len(getattr(obj, h, ())) for h in hooks]

        return [patched(layer) for layer in run.model.layers], patched(run.optimizer), \
            patched(run.model)


class TapeDriver(KerasDriver):
    """TF eager: a GradientTape step, ``apply_gradients``, then ``dbg.step(loss=...)``, with
    ``watch(model, optimizer=...)``."""

    mode = "tf-eager"
    compiled = False

    def watch(self, run: Any, **options: Any) -> contextlib.AbstractContextManager[Any]:
        return graddebug.watch(run.model, optimizer=run.optimizer, **options)

    def native(self, array: np.ndarray) -> Any:
        import tensorflow as tf

        return tf.constant(array)

    def train(self, run: Any, dbg: Any, steps: int = 1) -> None:
        import tensorflow as tf

        if run.step is None:
            model, opt = run.model, run.optimizer

            def step(x: Any, y: Any) -> Any:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return loss

            run.step = tf.function(step) if self.compiled else step
        for _ in range(steps):
            loss = run.step(tf.constant(run.x), tf.constant(run.y))
            if dbg is not None:
                dbg.step(loss=loss)

    def reference(self) -> Grads:
        return tf_grads(initial_weights(), *batch())

    def break_adapter(self, patch: pytest.MonkeyPatch) -> None:
        _break_tf(patch)


class FunctionDriver(TapeDriver):
    """TF in a ``tf.function``: the same step as :class:`TapeDriver`, traced once per
    ``watch`` block, inside it, as the TF guide says (a function traced under an earlier block
    records nothing, and graddebug says so at the step)."""

    mode = "tf-function"
    compiled = True

    def watch(self, run: Any, **options: Any) -> contextlib.AbstractContextManager[Any]:
        run.step = None  # traced anew inside this block
        return super().watch(run, **options)


def _break_tf(patch: pytest.MonkeyPatch) -> None:
    """The layer-output statistics raise, in eager mode and in graphs."""
    patch_path(patch, "graddebug_tensorflow.watching", "write_activation")
    patch_path(patch, "graddebug_tensorflow.watching", "_write_activation")
    patch_path(patch, "graddebug_tensorflow.eagerrows", "EagerRows.backward")


class FitDriver(KerasDriver):
    """``model.fit`` with ``dbg.callback()``, one full batch per step, on the process's
    Keras backend."""

    keeps_cause = False  # fit's traceback filter re-raises an error ``from None``

    def __init__(self) -> None:
        super().__init__()
        self.backend = self.keras.backend.backend()
        self.mode = {"tensorflow": "keras-fit-tf"}.get(self.backend, f"keras-fit-{self.backend}")
        if self.backend == "torch":
            self.weights_read = "after"
        self.bug_empties_step = self.backend == "jax"  # as in graddebug_jax

    def build(self, variant: str = "mlp", plain: bool = False) -> Any:
        run = super().build(variant, plain)
        run.model.compile(optimizer=run.optimizer, loss="mse")
        return run

    def native(self, array: np.ndarray) -> Any:
        return self.keras.ops.convert_to_tensor(array)

    def train(self, run: Any, dbg: Any, steps: int = 1) -> None:
        callbacks = [] if dbg is None else [dbg.callback()]
        run.model.fit(run.x, run.y, batch_size=len(run.x), epochs=steps, shuffle=False,
                      verbose=0, callbacks=callbacks)

    def reference(self) -> Grads:
        grads = {"tensorflow": tf_grads, "torch": torch_grads, "jax": jax_grads}[self.backend]
        return grads(initial_weights(), *batch())

    def break_adapter(self, patch: pytest.MonkeyPatch) -> None:
        if self.backend == "tensorflow":
            _break_tf(patch)
        elif self.backend == "torch":
            patch_path(patch, "graddebug_torch.watching", "_unit_dim")
        else:
            patch_path(patch, "graddebug_jax.closing", "StepRows.add_layers")


# -- TF1 ------------------------------------------------------------------------------------

class _SessionRun:
    """A graph with the MLP's variables, built for one Watcher (or none) at the first step."""

    def __init__(self, variant: str) -> None:
        import tensorflow as tf

        self.variant, self.wide = variant, variant == "wide"
        self.graph = tf.Graph()
        self.weights = initial_weights(self.wide)
        if variant == "nan":
            w, b = self.weights["l2"]
            self.weights["l2"] = (w, np.full_like(b, np.nan))
        with self.graph.as_default():
            self.params = {f"{n}.{t}": tf.compat.v1.Variable(a, name=f"{n}_{t}")
                           for n in LAYERS for t, a in zip("wb", self.weights[n], strict=True)}
            self.optimizer = tf.compat.v1.train.GradientDescentOptimizer(LR)
        self.fetches: dict[str, Any] | None = None
        self.session: Any = None
        self.owner: Any = None  # the Watcher the graph's taps and fetches were built for


class SessionDriver(Driver):
    """TF1: a graph built under ``watch(params=..., optimizer=...)`` with a tap on each layer
    output, run by a session; ``dbg.step(fetched, loss=...)`` after each run. A graph keeps
    what was built in it: a later Watcher builds its own taps and fetches beside the first."""

    mode = "tf1-session"

    def build(self, variant: str = "mlp", plain: bool = False) -> Any:
        return _SessionRun(variant)

    @contextlib.contextmanager
    def watch(self, run: Any, **options: Any) -> Iterator[Any]:
        with run.graph.as_default(), graddebug.watch(
                params=run.params, optimizer=run.optimizer, **options) as dbg:
            yield dbg

    def native(self, array: np.ndarray) -> Any:
        return array

    def _graph(self, run: Any, dbg: Any) -> None:
        import tensorflow as tf

        v1 = tf.compat.v1
        with run.graph.as_default():
            x, y = batch(run.wide)
            h = tf.constant(x)
            for name, act in zip(LAYERS, ACTS, strict=True):
                if run.variant == "cut" and name == "l2":
                    h = tf.stop_gradient(h)
                h = tf.matmul(h, run.params[f"{name}.w"]) + run.params[f"{name}.b"]
                h = tf.tanh(h) if act else h
                if dbg is not None:
                    h = dbg.tap(h, name)
            loss = tf.reduce_mean(tf.square(h - y))
            params = list(run.params.values())
            grads = v1.gradients(loss, params)
            train = run.optimizer.apply_gradients(zip(grads, params, strict=True))
            run.fetches = {"train": train, "loss": loss}
            if dbg is not None:
                run.fetches["dbg"] = dbg.fetches(grads=grads)
            if run.session is None:
                run.session = v1.Session(graph=run.graph)
                run.session.run(v1.global_variables_initializer())
        run.owner = dbg

    def train(self, run: Any, dbg: Any, steps: int = 1) -> None:
        if run.fetches is None or run.owner is not dbg:
            self._graph(run, dbg)
        for _ in range(steps):
            fetches = run.fetches if dbg is not None else {
                k: v for k, v in run.fetches.items() if k != "dbg"}
            out = run.session.run(fetches)
            if dbg is not None:
                dbg.step(out["dbg"], loss=out["loss"])

    def reference(self) -> Grads:
        return tf1_grads(initial_weights(), *batch())

    def weights(self, run: Any) -> Weights:
        if run.session is None:
            return {n: run.weights[n] for n in LAYERS}
        values = run.session.run(run.params)
        return {n: (values[f"{n}.w"], values[f"{n}.b"]) for n in LAYERS}

    def rows(self) -> dict[str, tuple[str, str]]:
        return {f"{n}.{t}": (f"{n}.{t}", f"{n}.{t}") for n in LAYERS for t in "wb"}

    def probe(self, run: Any) -> Any:
        return sorted(vars(run.optimizer)), type(run.optimizer).apply_gradients

    def break_adapter(self, patch: pytest.MonkeyPatch) -> None:
        patch_path(patch, "graddebug_tensorflow.v1graph", "activation_row")
