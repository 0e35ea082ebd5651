"""Keras 3 on every backend: a Keras model is claimed by a Keras code path whatever its backend,
``dbg.callback()`` is a Keras callback, and ``fit`` records the same gradients on the
TensorFlow, torch and JAX backends, equal to each backend's own autodiff and to a numpy
back-propagation written out by hand.

Keras picks its backend once per process (``KERAS_BACKEND``), so each backend runs in one child
process, which does everything this module asks of that backend and prints its answers as
JSON; the tests compare them.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")

BACKENDS = ("tensorflow", "torch", "jax")
SIZES = (4, 5, 3, 2)  # Dense(5, tanh) -> Dense(3, sigmoid) -> Dense(2)
LAYERS = ("d1", "d2", "d3")
BATCH = 6


def weights_and_batch() -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """The MLP's weights and one batch, from a fixed seed (the children build the same)."""
    rng = np.random.RandomState(7)
    weights = [(rng.randn(a, b).astype("float32") * 0.8, rng.randn(b).astype("float32") * 0.3)
               for a, b in itertools.pairwise(SIZES)]
    x = rng.randn(BATCH, SIZES[0]).astype("float32")
    y = rng.randn(BATCH, SIZES[-1]).astype("float32")
    return weights, x, y


CHILD = r'''
import json, os, sys, warnings
import numpy as np
sys.path.insert(0, os.environ["GD_TESTS"])
from test_keras3_backends import LAYERS, SIZES, weights_and_batch
import keras
import graddebug
from graddebug.errors import GradDebugWarning
from graddebug.plugins import find_adapter, get_plugin_manager

backend = keras.backend.backend()
weights, x, y = weights_and_batch()
out = {"backend": backend}
warnings.simplefilter("always", GradDebugWarning)
caught = []
warnings.showwarning = lambda m, c, *a, **k: caught.append(str(m)) if issubclass(
    c, GradDebugWarning) else None


def mlp():
    acts = ("tanh", "sigmoid", None)
    model = keras.Sequential([keras.Input((SIZES[0],))] + [
        keras.layers.Dense(b, activation=act, name=name)
        for b, act, name in zip(SIZES[1:], acts, LAYERS)])
    for layer, (w, b) in zip(model.layers, weights):
        layer.set_weights([w, b])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def norms(frame, step=0):
    rows = frame[frame["step"] == step]
    return {f"{r.layer}.{r.tensor}" if r.kind == "parameter" else f"{r.layer}.{r.kind}":
            float(r.norm) for r in rows.itertuples() if r.kind in ("parameter", "activation")}


def reference():
    """Gradients by the backend's own autodiff: parameters and layer outputs."""
    named = {}
    if backend == "torch":
        import torch
        t = lambda a: torch.tensor(a, requires_grad=True)
        params = [(t(w), t(b)) for w, b in weights]
        h1 = torch.tanh(torch.tensor(x) @ params[0][0] + params[0][1])
        h2 = torch.sigmoid(h1 @ params[1][0] + params[1][1])
        o = h2 @ params[2][0] + params[2][1]
        for h in (h1, h2, o):
            h.retain_grad()
        torch.mean((o - torch.tensor(y)) ** 2).backward()
        for name, (w, b) in zip(LAYERS, params):
            named[f"{name}.kernel"], named[f"{name}.bias"] = w.grad, b.grad
        for name, h in zip(LAYERS, (h1, h2, o)):
            named[f"{name}.activation"] = h.grad
        return {k: float(torch.linalg.vector_norm(v)) for k, v in named.items()}
    if backend == "jax":
        import jax, jax.numpy as jnp
        def loss(params, eps):
            h1 = jnp.tanh(x @ params[0][0] + params[0][1]) + eps[0]
            h2 = jax.nn.sigmoid(h1 @ params[1][0] + params[1][1]) + eps[1]
            o = h2 @ params[2][0] + params[2][1] + eps[2]
            return jnp.mean((o - y) ** 2)
        eps = [jnp.zeros((len(x), n)) for n in SIZES[1:]]
        gp, ge = jax.grad(loss, argnums=(0, 1))([tuple(map(jnp.asarray, p)) for p in weights],
                                              eps)
        for name, (w, b), e in zip(LAYERS, gp, ge):
            named[f"{name}.kernel"], named[f"{name}.bias"] = w, b
            named[f"{name}.activation"] = e
        return {k: float(jnp.linalg.norm(jnp.ravel(v))) for k, v in named.items()}
    import tensorflow as tf
    params = [(tf.Variable(w), tf.Variable(b)) for w, b in weights]
    with tf.GradientTape(persistent=True) as tape:
        h1 = tf.tanh(x @ params[0][0] + params[0][1])
        h2 = tf.sigmoid(h1 @ params[1][0] + params[1][1])
        o = h2 @ params[2][0] + params[2][1]
        loss = tf.reduce_mean((o - y) ** 2)
    for name, (w, b), h in zip(LAYERS, params, (h1, h2, o)):
        gw, gb, gh = tape.gradient(loss, [w, b, h])
        named[f"{name}.kernel"], named[f"{name}.bias"] = gw, gb
        named[f"{name}.activation"] = gh
    return {k: float(tf.norm(tf.reshape(v, [-1]))) for k, v in named.items()}


out["reference"] = reference()
model = mlp()
out["adapter"] = find_adapter(get_plugin_manager(), model).__name__
with graddebug.watch(model) as dbg:
    callback = dbg.callback()
    out["callback_is_keras"] = isinstance(callback, keras.callbacks.Callback)
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False, callbacks=[callback])
out["fit"] = norms(dbg.frame())
out["fit_steps"] = sorted(set(dbg.frame()["step"].tolist()))
out["fit_findings"] = dbg.findings()["issue"].tolist()

# The stand-alone callback: no with block, the same rows; each fit watched anew.
import graddebug_keras
model = mlp()
alone = graddebug_keras.GradDebugCallback()
model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False, callbacks=[alone])
out["alone"] = norms(alone.frame())
out["alone_steps"] = sorted(set(alone.frame()["step"].tolist()))
out["alone_active_after_fit"] = alone.watcher.active
first = alone.watcher
model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False, callbacks=[alone])
out["alone_refit_new_watcher"] = alone.watcher is not first and not alone.watcher.active

model = mlp()
# TensorFlow keeps no gradient on a variable: its Keras path takes them from optimizer=.
with graddebug.watch(model, **({"optimizer": model.optimizer} if backend == "tensorflow"
                               else {})) as dbg:
    model.train_on_batch(x, y)
    dbg.step()
out["train_on_batch"] = norms(dbg.frame())
if backend == "torch":  # torch's step clock: each optimizer.apply closes the step
    model = mlp()
    with graddebug.watch(model, optimizer=model.optimizer) as dbg:
        model.train_on_batch(x, y)
        model.train_on_batch(x, y)
    out["apply_closes"] = norms(dbg.frame())
    out["apply_steps"] = sorted(set(dbg.frame()["step"].tolist()))

if backend == "torch":  # the optimizer's view and the loss row, from Keras's apply and loss
    keras.utils.set_random_seed(3)
    # large enough that every kernel is sampled (graddebug.sampling.plan), not taken whole
    wide = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="tanh",
                                                                    name="w1"),
                             keras.layers.Dense(512, activation="tanh", name="w2"),
                             keras.layers.Dense(8, name="w3")])
    wide.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    r = np.random.RandomState(5)
    xw, yw = r.randn(32, 64).astype("float32"), r.randn(32, 8).astype("float32")
    names = [f"{v.path.split('/')[-2]}.{v.path.split('/')[-1]}" for v in wide.trainable_variables]
    before = [v.numpy().astype(float) for v in wide.trainable_variables]
    (w1, b1), (w2, b2), (w3, b3) = before[:2], before[2:4], before[4:]
    out["wide_loss0"] = float(np.mean(
        (np.tanh(np.tanh(xw @ w1 + b1) @ w2 + b2) @ w3 + b3 - yw) ** 2))
    with graddebug.watch(wide) as dbg:
        wide.fit(xw, yw, batch_size=32, epochs=1, verbose=0, shuffle=False,
                 callbacks=[dbg.callback()])
    after = [v.numpy().astype(float) for v in wide.trainable_variables]
    out["wide_true"] = {n: [float(np.linalg.norm(a)), float(np.linalg.norm(a - b))]
                        for n, a, b in zip(names, after, before)}
    rows = dbg.frame()
    out["wide_rows"] = {f"{r.layer}.{r.tensor}": [float(r.weight_norm), float(r.update_norm)]
                        for r in rows[rows["kind"] == "parameter"].itertuples()}
    out["wide_loss_row"] = rows.loc[rows["kind"] == "loss", "mean"].tolist()

if backend == "jax":  # the loss row of each batch, carried with the step's one transfer
    (w1, b1), (w2, b2), (w3, b3) = [(w.astype(float), b.astype(float)) for w, b in weights]
    h = 1 / (1 + np.exp(-(np.tanh(x[:3] @ w1 + b1) @ w2 + b2)))
    out["jax_loss0"] = float(np.mean((h @ w3 + b3 - y[:3]) ** 2))  # batch 0, by hand
    twin = mlp()
    out["jax_keras_losses"] = [float(twin.train_on_batch(x[i:i + 3], y[i:i + 3]))
                               for i in (0, 3)]
    model = mlp()
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=3, epochs=1, verbose=0, shuffle=False,
                  callbacks=[dbg.callback()])
        out["jax_transfers"] = dbg.adapter.transfers
    rows = dbg.frame()
    out["jax_loss_rows"] = rows.loc[rows["kind"] == "loss", ["step", "mean"]].values.tolist()
    out["jax_steps"] = sorted(set(rows["step"].tolist()))

rng = np.random.RandomState(0)
xs, ys = rng.randn(64, 4).astype("float32"), rng.randn(64, 1).astype("float32")
keras.utils.set_random_seed(0)
deep = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(32, activation="sigmoid")
                                               for _ in range(12)] + [keras.layers.Dense(1)])
deep.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
with graddebug.watch(deep) as dbg:
    deep.fit(xs, ys, batch_size=64, epochs=3, verbose=0, callbacks=[dbg.callback()])
out["sigmoid_issues"] = sorted(set(dbg.findings()["issue"]))
out["sigmoid_kinds"] = sorted(set(dbg.frame()["kind"]))

keras.utils.set_random_seed(2)
healthy = keras.Sequential([keras.Input((4,))] + [
    keras.layers.Dense(64, activation="relu", kernel_initializer="he_normal")
    for _ in range(3)] + [keras.layers.Dense(3)])
healthy.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
with graddebug.watch(healthy) as dbg:
    healthy.fit(xs, rng.randn(64, 3).astype("float32"), batch_size=64, epochs=5, verbose=0,
                callbacks=[dbg.callback()])
out["healthy_findings"] = dbg.findings()[["layer", "issue"]].values.tolist()
out["healthy_steps"] = int(dbg.frame()["step"].max()) + 1
out["warnings"] = list(caught)

# a batch that holds an Inf: the data's fault, at its step, on every backend
bad_x = rng.randn(64, 4).astype("float32")
bad_x[40, 2] = np.inf  # batch 2 of 16
keras.utils.set_random_seed(4)
small = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
small.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
with graddebug.watch(small) as dbg:
    small.fit(bad_x, rng.randn(64, 1).astype("float32"), batch_size=16, epochs=1, verbose=0,
              shuffle=False, callbacks=[dbg.callback()])
bad = dbg.findings()
out["bad_batch"] = bad.loc[bad["issue"] == "nonfinite", ["step", "cause"]].values.tolist()
inputs = dbg.events()
out["bad_batch_inputs"] = inputs.loc[inputs["event"] == "input_nonfinite",
                                     ["step", "detail"]].values.tolist()
# the optimizer's clip, on every backend: clipped_norm is the gradient the update applied,
# read back from the weights (plain SGD: the update is -lr times the clipped gradient)
out["clip"] = {}
for clip, limit in (("clipnorm", 0.05), ("global_clipnorm", 0.1)):
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.5, **{clip: limit}), loss="mse")
    names = [f"{v.path.split('/')[-2]}.{v.path.split('/')[-1]}" for v in model.trainable_variables]
    before = [v.numpy().astype(float) for v in model.trainable_variables]
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False,
                  callbacks=[dbg.callback()])
    after = [v.numpy().astype(float) for v in model.trainable_variables]
    rows = dbg.frame()
    rows = rows[rows["kind"] == "parameter"]
    out["clip"][clip] = {
        "rows": {f"{r.layer}.{r.tensor}": [float(r.norm), float(r.clipped_norm)]
                 for r in rows.itertuples()},
        "applied": {n: float(np.linalg.norm(a - b)) / 0.5
                    for n, a, b in zip(names, after, before)}}
if backend == "jax":  # keep= has no dense copies on this backend: watch() refuses it
    try:
        graddebug.watch(mlp(), keep={"d1"})
    except graddebug.errors.UnsupportedOptionError as exc:
        out["keep_refused"] = str(exc)
print("GD-RESULT " + json.dumps(out))
'''


@cache
def child(backend: str) -> dict[str, Any]:
    """Run the child for ``backend`` once per session; its JSON answers."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_ENABLE_ONEDNN_OPTS": "0", "GD_TESTS": os.path.dirname(__file__),
           "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("GD-RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("GD-RESULT "):])


def numpy_reference() -> dict[str, float]:
    """The gradients of the MLP's MSE loss, back-propagated by hand in float64."""
    weights, x, y = weights_and_batch()
    (w1, b1), (w2, b2), (w3, b3) = [(w.astype(float), b.astype(float)) for w, b in weights]
    x, y = x.astype(float), y.astype(float)
    h1 = np.tanh(x @ w1 + b1)
    h2 = 1 / (1 + np.exp(-(h1 @ w2 + b2)))
    o = h2 @ w3 + b3
    g_o = 2 * (o - y) / o.size
    g_h2 = g_o @ w3.T
    g_z2 = g_h2 * h2 * (1 - h2)
    g_h1 = g_z2 @ w2.T
    g_z1 = g_h1 * (1 - h1 ** 2)
    grads = {"d3.kernel": h2.T @ g_o, "d3.bias": g_o.sum(0), "d2.kernel": h1.T @ g_z2,
             "d2.bias": g_z2.sum(0), "d1.kernel": x.T @ g_z1, "d1.bias": g_z1.sum(0),
             "d1.activation": g_h1, "d2.activation": g_h2, "d3.activation": g_o}
    return {k: float(np.linalg.norm(v)) for k, v in grads.items()}


PARAMS = tuple(f"{layer}.{t}" for layer in LAYERS for t in ("kernel", "bias"))
OUTPUTS = tuple(f"{layer}.activation" for layer in LAYERS)


# -- the claim, without a backend (fake Keras modules) --------------------------------------

def fake_keras(monkeypatch: pytest.MonkeyPatch, backend: str, base: type = object) -> type:
    """Put a stand-in ``keras`` in ``sys.modules`` whose layers derive from ``base``."""
    layer = type("Layer", (base,), {})
    module = types.SimpleNamespace(layers=types.SimpleNamespace(Layer=layer),
                                   backend=types.SimpleNamespace(backend=lambda: backend))
    monkeypatch.setitem(sys.modules, "keras", module)
    return layer


def test_the_torch_plugin_hands_a_keras_layer_on_torch_over_and_keeps_plain_modules(
        monkeypatch):
    torch = pytest.importorskip("torch")
    from graddebug_keras import plugin as keras_plugin
    from graddebug_torch import plugin as torch_plugin

    layer = fake_keras(monkeypatch, "torch", torch.nn.Module)()
    assert torch_plugin.graddebug_adapter(layer) is None
    assert keras_plugin.keras_backend(layer) == "torch"
    assert torch_plugin.graddebug_adapter(torch.nn.Linear(2, 2)).__name__ == "TorchAdapter"
    assert keras_plugin.graddebug_adapter(torch.nn.Linear(2, 2)) is None


def test_the_keras_plugin_leaves_the_tensorflow_backend_and_non_keras_objects_alone(
        monkeypatch):
    from graddebug_keras import plugin as keras_plugin

    layer = fake_keras(monkeypatch, "tensorflow")()
    assert keras_plugin.keras_backend(layer) == "tensorflow"
    assert keras_plugin.graddebug_adapter(layer) is None
    assert keras_plugin.graddebug_adapter(object()) is None
    monkeypatch.delitem(sys.modules, "keras")
    assert keras_plugin.graddebug_adapter(layer) is None


def test_the_keras_plugin_runs_before_the_torch_and_tensorflow_plugins():
    from graddebug.plugins import get_plugin_manager

    impls = get_plugin_manager().hook.graddebug_adapter.get_hookimpls()
    keras_impl = next(i for i in impls if i.plugin_name == "keras")
    assert keras_impl.tryfirst
    # pluggy calls the hook implementations from the end of this list.
    assert impls[-1].plugin_name == "keras"


# -- every backend, in its own child ----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_is_claimed_by_a_keras_path_and_its_callback_is_a_keras_callback(backend):
    got = child(backend)
    assert got["backend"] == backend
    expected = {"tensorflow": "TensorFlowAdapter", "torch": "KerasTorchAdapter",
                "jax": "KerasJaxAdapter"}[backend]
    assert got["adapter"] == expected
    assert got["callback_is_keras"]
    assert got["fit_steps"] == [0]
    assert got["warnings"] == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_records_the_gradients_the_backends_own_autodiff_gives(backend):
    got = child(backend)
    reference = got["reference"]
    for name in (*PARAMS, *OUTPUTS):
        assert got["fit"][name] == pytest.approx(reference[name], rel=1e-5), name
        assert got["train_on_batch"][name] == pytest.approx(reference[name], rel=1e-5), name


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_stand_alone_callback_records_what_the_with_block_records(backend):
    out = child(backend)
    assert out["alone_steps"] == out["fit_steps"]
    assert set(out["alone"]) == set(out["fit"])
    for key, value in out["fit"].items():  # fit's rows are checked against autodiff above
        assert out["alone"][key] == pytest.approx(value, rel=1e-6), key
    assert not out["alone_active_after_fit"]  # fit's end left the Watcher: no hook remains
    assert out["alone_refit_new_watcher"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_agrees_with_a_numpy_backpropagation(backend):
    got, expected = child(backend), numpy_reference()
    for name in (*PARAMS, *OUTPUTS):
        assert got["fit"][name] == pytest.approx(expected[name], rel=1e-4), name


@pytest.mark.slow
def test_on_torch_each_keras_optimizer_apply_closes_a_step_under_optimizer():
    got = child("torch")
    assert got["apply_steps"] == [0, 1]
    for name in (*PARAMS, *OUTPUTS):
        assert got["apply_closes"][name] == pytest.approx(got["reference"][name], rel=1e-5)


@pytest.mark.slow
def test_on_torch_fit_records_the_weights_the_update_and_the_loss_of_each_batch():
    got = child("torch")
    # the loss of the one batch, at the weights before its update (numpy, by hand)
    assert got["wide_loss_row"] == [pytest.approx(got["wide_loss0"], rel=1e-5)]
    assert set(got["wide_rows"]) == set(got["wide_true"]) == {
        f"w{i}.{t}" for i in (1, 2, 3) for t in ("kernel", "bias")}
    for name, (weight, update) in got["wide_rows"].items():
        true_weight, true_update = got["wide_true"][name]
        assert true_update > 0
        # estimated from a strided sample of the entries (small tensors whole): within its
        # relative error, about 1 / sqrt(2 k) for the k >= 128 entries it reads
        assert weight == pytest.approx(true_weight, rel=0.15), name
        assert update == pytest.approx(true_update, rel=0.15), name


@pytest.mark.slow
def test_on_jax_fit_records_the_loss_of_each_batch_in_the_one_transfer_of_its_step():
    got = child("jax")
    assert got["jax_steps"] == [0, 1]
    assert got["jax_transfers"] == 2  # one per step: the update carries the loss and the rows
    # each batch's loss at the weights before its update: Keras's own train_on_batch on a
    # twin model, and for the first batch a numpy forward pass
    losses = [loss for _, loss in got["jax_loss_rows"]]
    assert [step for step, _ in got["jax_loss_rows"]] == [0, 1]
    assert losses == pytest.approx(got["jax_keras_losses"], rel=1e-6)
    assert losses[0] == pytest.approx(got["jax_loss0"], rel=1e-5)
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)  # two batches, two values


@pytest.mark.slow
def test_the_three_backends_record_the_same_norms():
    tf_run, torch_run, jax_run = (child(b)["fit"] for b in BACKENDS)
    assert set(tf_run) == set(torch_run) == set(jax_run)
    for name, value in tf_run.items():
        assert torch_run[name] == pytest.approx(value, rel=1e-5), name
        assert jax_run[name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.slow
@pytest.mark.parametrize("backend", ("torch", "jax"))
def test_a_deep_sigmoid_stack_vanishes_and_a_healthy_relu_net_has_no_finding(backend):
    got = child(backend)
    assert "vanishing" in got["sigmoid_issues"]
    # the callback records each batch's loss too
    assert got["sigmoid_kinds"] == ["activation", "loss", "parameter"]
    assert got["healthy_steps"] == 5
    assert got["healthy_findings"] == []
    assert got["fit_findings"] == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_holding_an_inf_is_blamed_on_the_data_at_its_step(backend):
    got = child(backend)
    assert got["bad_batch_inputs"] == [[2, "Inf"]]
    assert got["bad_batch"][0] == [2, "data"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
def test_the_callback_passes_the_optimizers_clip_on_every_backend(backend, clip):
    got = child(backend)
    run, reference = got["clip"][clip], got["reference"]
    assert set(run["rows"]) == set(PARAMS)
    total = np.sqrt(sum(reference[name] ** 2 for name in PARAMS))
    limit = {"clipnorm": 0.05, "global_clipnorm": 0.1}[clip]
    for name, (norm, clipped) in run["rows"].items():
        # norm: the gradient before the clip, as the backend's own autodiff gives it
        assert norm == pytest.approx(reference[name], rel=1e-5), name
        # clipped_norm: what the optimizer applied, read back from the weights it moved
        assert clipped == pytest.approx(run["applied"][name], rel=1e-3), name
        assert clipped < norm, name  # the clip acted on every tensor
        expected = min(norm, limit) if clip == "clipnorm" else norm * limit / total
        assert clipped == pytest.approx(expected, rel=1e-5), name


@pytest.mark.slow
def test_on_jax_keep_is_refused_at_watch_naming_the_adapter():
    got = child("jax")
    assert "keep=" in got["keep_refused"]
    assert "keras-jax adapter" in got["keep_refused"]


def _guide_block() -> str:
    """The example of the Keras 3 backends guide (the block after its readme-test marker)."""
    text = (Path(__file__).parent.parent / "docs" / "guides" / "keras3-backends.md").read_text()
    after = text.split("<!-- readme-test: skip: Keras fixes its backend per process", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_guides_example_runs_as_written_on_each_backend(backend):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_ENABLE_ONEDNN_OPTS": "0", "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", _guide_block()], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert first == f"{backend} 16 steps"  # 2 epochs of 8 batches, on the backend asked for
    assert "Empty DataFrame" in done.stdout
