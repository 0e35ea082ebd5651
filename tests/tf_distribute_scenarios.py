"""The tf.distribute scenarios of tests/test_tf_distribute.py, run in a process of their own.

TensorFlow splits a CPU into logical devices only before it initialises its devices, which
the other tests of a session have done long before; so this script configures two logical
CPUs first thing, runs every scenario, and writes what they recorded, with the independent
references (``tape.gradient`` of one replica on the same global batch), as JSON to the path
given as its only argument.

Each scenario trains the same two-layer MLP, from the same weights, on the same two global
batches of 32 examples: Keras splits each batch in halves, replica 0 taking the first.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import graddebug  # noqa: E402
from graddebug.frames import combine_ranks  # noqa: E402

BATCH = 32
STEPS = 2


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * STEPS, 8)).astype(np.float32)
    return x, rng.integers(0, 3, BATCH * STEPS)


def mlp() -> keras.Sequential:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, activation="tanh", name="d1"),
                             keras.layers.Dense(3, name="d2")], name="mlp")


def xent(reduction: str = "sum_over_batch_size") -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def rows(frame: Any) -> list[dict[str, Any]]:
    return json.loads(frame[["step", "layer", "tensor", "kind", "norm", "numel", "nan", "inf",
                             "rank"]].to_json(orient="records"))


def recorded(dbg: graddebug.Watcher) -> dict[str, Any]:
    """The frame, and its rows combined over the replicas."""
    frame = dbg.frame()
    return {"frame": rows(frame), "combined": rows(combine_ranks(frame))}


def reference(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """One replica's ``tape.gradient`` of the mean loss over the global batch: parameter
    norms, and the activation gradient's norm over the batch and over each half."""
    model = mlp()
    model.set_weights(weights)
    d1, d2 = model.layers
    with tf.GradientTape() as tape:
        h1 = d1(x)
        tape.watch(h1)
        h2 = d2(h1)
        tape.watch(h2)
        loss = xent()(y, h2)
    variables = model.trainable_variables
    grads = tape.gradient(loss, [h1, h2, *variables])
    out: dict[str, Any] = {"parameter": {}, "activation": {}}
    for var, grad in zip(variables, grads[2:], strict=True):
        out["parameter"]["/".join(var.path.split("/")[-2:])] = float(
            np.linalg.norm(grad.numpy().astype(np.float64)))
    half = len(x) // 2
    for name, grad in (("d1", grads[0]), ("d2", grads[1])):
        g = grad.numpy().astype(np.float64)
        out["activation"][name] = [float(np.linalg.norm(g)), float(np.linalg.norm(g[:half])),
                                   float(np.linalg.norm(g[half:]))]
    return out


def single_fit(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    model = mlp()
    model.set_weights(weights)
    model.compile(optimizer="sgd", loss=xent())
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    return {"frame": rows(dbg.frame())}


def mirrored_model(strategy: Any, weights: list[np.ndarray]) -> keras.Sequential:
    with strategy.scope():
        model = mlp()
        model.set_weights(weights)
        model.compile(optimizer="sgd", loss=xent())
    return model


def mirrored_fit(strategy: Any, weights: list[np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> dict[str, Any]:
    model = mirrored_model(strategy, weights)
    with graddebug.watch(model) as dbg:  # outside the scope, as fit needs none
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    report = dbg.report()
    return {**recorded(dbg), "summary": json.loads(dbg.summary().to_json(orient="records")),
            "findings": len(dbg.findings()),
        "distribution": {k: report.metadata[k]
                         for k in ("rank", "world_size", "backend", "processes")},
        "weights": [w.tolist() for w in model.get_weights()]}


def mirrored_every(strategy: Any, weights: list[np.ndarray], x: np.ndarray,
                   y: np.ndarray) -> dict[str, Any]:
    """``every=2`` and ``keep=``, with the watch entered inside the strategy's scope."""
    model = mirrored_model(strategy, weights)
    with strategy.scope(), graddebug.watch(model, every=2, keep=["d1"]) as dbg:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    kept = dbg.tensors(0)
    return {**recorded(dbg), "kept": {k: list(v.shape) for k, v in kept.items()},
            "kept_norms": {k: float(np.linalg.norm(v.astype(np.float64)))
                           for k, v in kept.items()}}


class ForceOverflow(keras.callbacks.Callback):
    """Sets the loss scale so high for batch 1 that its float16 gradients overflow."""

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if batch == 1:
            self.model.optimizer.dynamic_scale.assign(2.0**40)


def mirrored_amp(strategy: Any, weights: list[np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> dict[str, Any]:
    """Mixed precision (a LossScaleOptimizer) under the strategy; batch 1 overflows."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mirrored_model(strategy, weights)
        with graddebug.watch(model) as dbg:
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                      callbacks=[ForceOverflow(), dbg.callback()])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return {**recorded(dbg), "optimizer": type(model.optimizer).__name__,
            "events": dbg.events()[["step", "event", "detail"]].values.tolist()}


def mirrored_loop(strategy: Any, weights: list[np.ndarray], x: np.ndarray, y: np.ndarray,
                  *, local_mean: bool, compiled: bool) -> dict[str, Any]:
    """A custom loop with ``strategy.run``: the loss is the mean over the global batch
    (``tf.nn.compute_average_loss``), or, with ``local_mean``, each replica's own mean."""
    with strategy.scope():
        model = mlp()
        model.set_weights(weights)
        optimizer = keras.optimizers.SGD()
    loss_fn = xent("none")

    def replica_step(inputs: Any) -> None:
        xb, yb = inputs
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = (tf.reduce_mean(per_example) if local_mean
                    else tf.nn.compute_average_loss(per_example, global_batch_size=BATCH))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    def train_step(inputs: Any) -> None:
        strategy.run(replica_step, args=(inputs,))

    step = tf.function(train_step) if compiled else train_step
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with graddebug.watch(model, optimizer=optimizer) as dbg:
        for inputs in strategy.experimental_distribute_dataset(dataset):
            step(inputs)
            dbg.step()
    return recorded(dbg)


def taps(strategy: Any, x: np.ndarray, *, in_scope: bool, params: bool) -> dict[str, Any]:
    """A tap inside ``strategy.run``, watched inside the strategy's scope or outside it. Outside
    it, ``watch()`` picks its adapter at the first tap, in the replica function, under the
    strategy; ``watch(params=)`` of a variable made outside the scope picks it on entering,
    where nothing says that a strategy will run."""
    w = tf.Variable(tf.ones([8, 1]))
    options = {"params": {"w": w}} if params else {}

    def replica_step(xb: Any) -> None:
        with tf.GradientTape() as tape:
            tape.watch(xb)
            h = dbg.tap(tf.matmul(xb, w), "h")
            loss = tf.reduce_sum(h * h)
        tape.gradient(loss, xb)

    scope = strategy.scope() if in_scope else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, scope, \
            graddebug.watch(**options) as dbg:
        warnings.simplefilter("always")
        dataset = tf.data.Dataset.from_tensor_slices(x[:BATCH]).batch(BATCH)
        step = tf.function(lambda xb: strategy.run(replica_step, args=(xb,)))
        for xb in strategy.experimental_distribute_dataset(dataset):
            step(xb)
            dbg.step()
    h = x[:BATCH].sum(axis=1, dtype=np.float64)  # the gradient at h is 2h
    return {**recorded(dbg), "warnings": [str(w.message) for w in caught],
            "reference": [float(np.linalg.norm(2 * h[:BATCH // 2])),
                          float(np.linalg.norm(2 * h[BATCH // 2:]))]}


def per_replica_grads(strategy: Any, weights: list[np.ndarray], x: np.ndarray,
                      y: np.ndarray) -> str:
    """The error of ``dbg.step(grads)`` given the gradients ``strategy.run`` returns."""
    with strategy.scope():
        model = mlp()
        model.set_weights(weights)

    def replica_step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = xent()(yb, model(xb))
        return tape.gradient(loss, model.trainable_variables)

    dataset = tf.data.Dataset.from_tensor_slices((x[:BATCH], y[:BATCH])).batch(BATCH)
    error = ""
    # The step left open warns, on leaving, that no parameter gradient came.
    with warnings.catch_warnings(), graddebug.watch(model) as dbg:
        warnings.simplefilter("ignore", graddebug.GradDebugWarning)
        for xb, yb in strategy.experimental_distribute_dataset(dataset):
            grads = strategy.run(replica_step, args=(xb, yb))
            try:
                dbg.step(grads)
            except graddebug.GradDebugError as exc:
                error = f"{type(exc).__name__}: {exc}"
    return error


def log_dir_run(strategy: Any, weights: list[np.ndarray], x: np.ndarray,
                y: np.ndarray) -> dict[str, Any]:
    """A fit streamed to ``log_dir``, read back with ``graddebug.load``."""
    model = mirrored_model(strategy, weights)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run")
        with graddebug.watch(model, log_dir=path) as dbg:
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                      callbacks=[dbg.callback()])
            live = dbg.frame()
        loaded = graddebug.load(path)
        same = loaded.frame().equals(live)
        return {"status": loaded.metadata["run"]["status"], "rows": len(loaded.frame()),
                "same_as_live": same}


def main(out: str) -> None:
    warnings.simplefilter("error", graddebug.GradDebugWarning)
    x, y = data()
    weights = mlp().get_weights()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    unwatched = mirrored_model(strategy, weights)
    unwatched.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    results: dict[str, Any] = {
        "reference": reference(weights, x[:BATCH], y[:BATCH]),
        "single_fit": single_fit(weights, x, y),
        "mirrored_fit": mirrored_fit(strategy, weights, x, y),
        "mirrored_every": mirrored_every(strategy, weights, x, y),
        "mirrored_amp": mirrored_amp(strategy, weights, x, y),
        "unwatched_weights": [w.tolist() for w in unwatched.get_weights()],
        "loop": mirrored_loop(strategy, weights, x, y, local_mean=False, compiled=True),
        "loop_local_mean": mirrored_loop(strategy, weights, x, y, local_mean=True,
                                         compiled=True),
        "loop_eager": mirrored_loop(strategy, weights, x, y, local_mean=False, compiled=False),
    }
    results["taps_in_scope"] = taps(strategy, x, in_scope=True, params=False)
    results["taps_lazy"] = taps(strategy, x, in_scope=False, params=False)
    results["taps_unseen"] = taps(strategy, x, in_scope=False, params=True)
    results["per_replica_grads"] = per_replica_grads(strategy, weights, x, y)
    try:
        results["log_dir"] = log_dir_run(strategy, weights, x, y)
    except Exception as exc:  # reported to the test, which says what it expects
        results["log_dir"] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(out, "w", encoding="utf-8") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main(sys.argv[1])
