"""Op-level capture in TensorFlow (``watch(model, ops=True)``, ``escalate=True``): the op and
the source line behind ``nonfinite`` and ``cut_graph`` findings inside ``tf.function`` and
``model.fit``, layer-level answers in eager mode, no false alarms, no trace left behind.

Source lines are checked against the line numbers of this file, found by searching for a
marker comment, so that editing the file cannot make the tests point at the wrong line.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from tf_models import batches, relu_mlp, res_cnn, train  # noqa: E402

HERE = Path(__file__)
SOURCE = HERE.read_text().splitlines()


def line_of(marker: str) -> int:
    """The number of the one line of this file that ends with ``# <marker>``."""
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def assert_points_at(source: str, marker: str) -> None:
    """``source`` (``file:line``) is the line of this file marked ``marker``."""
    path, _, line = source.rpartition(":")
    assert os.path.realpath(path) == os.path.realpath(HERE), source
    assert int(line) == line_of(marker), (source, marker)


# -- layers with a fault inside their call ---------------------------------------------------


class LogLayer(keras.layers.Layer):
    """log of a negative: NaN born in forward."""

    def call(self, x):
        h = x * 1.0
        return tf.math.log(h - 100.0)  # forward-log


class SqrtLayer(keras.layers.Layer):
    """sqrt at 0: finite in forward, its derivative is Inf there."""

    def call(self, x):
        h = tf.nn.relu(x) * 0.0
        return tf.sqrt(h)  # backward-sqrt


class StopLayer(keras.layers.Layer):
    def call(self, x):
        h = x * 2.0
        h = tf.stop_gradient(h)  # cut-stop
        return h + 1.0


class NumpyLayer(keras.layers.Layer):
    def call(self, x):
        h = tf.numpy_function(lambda a: a * 2.0, [x], tf.float32)  # cut-numpy
        return tf.reshape(h, tf.shape(x)) + 1.0


class IntCastLayer(keras.layers.Layer):
    def call(self, x):
        q = tf.cast(x * 4.0, tf.int32)  # cut-cast
        return tf.cast(q, tf.float32) / 4.0


def model_with(middle: keras.layers.Layer, seed: int = 0) -> keras.Sequential:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="fc1"), middle,
                             keras.layers.Dense(1, name="fc2")])


def run_steps(model, compiled: bool, steps: int = 2, **options):
    x = tf.constant(np.random.default_rng(0).standard_normal((16, 6)), tf.float32)

    with graddebug.watch(model, **options) as dbg:
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - 1.0) ** 2)
            return tape.gradient(loss, model.trainable_variables)

        if compiled:
            step = tf.function(step)
        for _ in range(steps):
            dbg.step(step(x))
    return dbg


def only(findings, issue: str):
    rows = findings[findings["issue"] == issue]
    assert len(rows) >= 1, findings[["layer", "issue", "message"]].to_string()
    return rows.iloc[0]


# -- NaN and Inf ------------------------------------------------------------------------------


def test_forward_nan_in_a_tf_function_names_the_log_op_and_its_line():
    dbg = run_steps(model_with(LogLayer(name="logs")), compiled=True, ops=True)
    found = only(dbg.findings(), "nonfinite")
    assert found["layer"] == "logs"
    assert found["message"].startswith("Log in 'logs'"), found["message"]
    assert_points_at(found["source"], "forward-log")
    events = dbg.events()
    births = events[events["event"] == "op_nonfinite"]
    assert set(births["step"]) == {0, 1} and set(births["detail"]) == {"NaN"}


def test_forward_nan_in_eager_mode_names_the_layer_only():
    dbg = run_steps(model_with(LogLayer(name="logs")), compiled=False, ops=True)
    found = only(dbg.findings(), "nonfinite")
    assert found["layer"] == "logs" and found["source"] == ""
    assert not dbg.events()["event"].str.startswith("op_").any()


def test_backward_inf_of_sqrt_at_zero_in_a_tf_function_names_sqrt_and_its_line():
    model = model_with(SqrtLayer(name="roots"))
    dbg = run_steps(model, compiled=True, ops=True)
    found = only(dbg.findings(), "nonfinite")
    # The reference: the gradient at the layer's input is non-finite, the one at its output
    # is not (tape.gradient on the same model, unwatched).
    x = tf.constant(np.random.default_rng(0).standard_normal((16, 6)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        h = model.layers[0](x)
        tape.watch(h)
        r = model.layers[1](h)
        loss = tf.reduce_mean((model.layers[2](r) - 1.0) ** 2)
    assert np.isfinite(tape.gradient(loss, r).numpy()).all()
    assert not np.isfinite(tape.gradient(loss, h).numpy()).all()
    assert found["layer"] == "roots", found["message"]
    assert found["message"].startswith("the backward of Sqrt in 'roots'"), found["message"]
    assert_points_at(found["source"], "backward-sqrt")
    events = dbg.events()
    grads = events[events["event"] == "op_grad_nonfinite"]
    assert len(grads) >= 1 and grads["detail"].iloc[0].startswith("Inf")


def test_backward_inf_of_sqrt_in_eager_mode_names_a_layer_only():
    dbg = run_steps(model_with(SqrtLayer(name="roots")), compiled=False, ops=True)
    found = only(dbg.findings(), "nonfinite")
    assert found["source"] == ""


def test_fit_names_the_log_op_of_a_forward_nan():
    model = model_with(LogLayer(name="logs"))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 6)).astype("float32"), np.zeros((32, 1), "float32")
    with graddebug.watch(model, ops=True) as dbg:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[dbg.callback()])
    found = only(dbg.findings(), "nonfinite")
    assert found["layer"] == "logs"
    assert_points_at(found["source"], "forward-log")


# -- cut graphs -------------------------------------------------------------------------------


CUTS = [(StopLayer, "cut-stop", "StopGradient"), (NumpyLayer, "cut-numpy", "PyFunc"),
        (IntCastLayer, "cut-cast", "Cast")]


@pytest.mark.parametrize("layer_type, marker, op", CUTS)
def test_a_cut_in_a_tf_function_is_named_with_its_line(layer_type, marker, op):
    dbg = run_steps(model_with(layer_type(name="middle")), compiled=True, ops=True)
    findings = dbg.findings()
    starved = findings[(findings["issue"] == "cut_graph") & (findings["layer"] == "fc1")]
    assert len(starved) >= 1, findings[["layer", "issue", "message"]].to_string()
    for row in starved.itertuples():
        assert_points_at(row.source, marker)
        assert f"cut at {op} in 'middle'" in row.message, row.message
    cuts = dbg.events()
    cuts = cuts[cuts["event"] == "op_cut"]
    assert set(cuts["layer"]) == {"middle"}
    assert cuts["tensor"].iloc[0].startswith(f"{op}@")


@pytest.mark.parametrize("layer_type, marker, op", CUTS)
def test_a_cut_in_eager_mode_names_layers_only(layer_type, marker, op):
    dbg = run_steps(model_with(layer_type(name="middle")), compiled=False, ops=True)
    findings = dbg.findings()
    cut = findings[findings["issue"] == "cut_graph"]
    assert "fc1" in set(cut["layer"]), findings[["layer", "issue"]].to_string()
    assert (cut["source"] == "").all()


def test_an_integer_cast_of_the_input_alone_is_not_a_cut():
    # Casting the model's input (no variable upstream) cuts no gradient: no op_cut.
    class Quantise(keras.layers.Layer):
        def call(self, x):
            return tf.cast(tf.cast(x * 4.0, tf.int32), tf.float32)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), Quantise(name="q"),
                              keras.layers.Dense(8, name="fc1"), StopLayer(name="middle"),
                              keras.layers.Dense(1, name="fc2")])
    dbg = run_steps(model, compiled=True, ops=True)
    cuts = dbg.events()
    cuts = cuts[cuts["event"] == "op_cut"]
    assert list(cuts["layer"].unique()) == ["middle"]


# -- no false alarms --------------------------------------------------------------------------


class MaskedAttention(keras.layers.Layer):
    """Self-attention with a causal mask of -inf: non-finite by design inside the layer."""

    def build(self, shape):
        self.qkv = self.add_weight(shape=(shape[-1], 3 * shape[-1]), name="qkv")

    def call(self, x):
        q, k, v = tf.split(tf.matmul(x, self.qkv), 3, axis=-1)
        scores = tf.matmul(q, k, transpose_b=True)
        length = tf.shape(x)[1]
        causal = tf.linalg.band_part(tf.ones((length, length), tf.bool), -1, 0)
        scores = tf.where(causal, scores, tf.constant(-np.inf, scores.dtype))
        return tf.matmul(tf.nn.softmax(scores), v)


def transformer_block(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = inputs = keras.Input((8, 16))
    attention = keras.layers.MultiHeadAttention(2, 8, name="mha")
    x = keras.layers.LayerNormalization(name="ln1")(
        x + attention(x, x, use_causal_mask=True))
    x = keras.layers.LayerNormalization(name="ln2")(x + MaskedAttention(name="masked")(x))
    x = keras.layers.Dense(32, activation="gelu", name="ff1")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(keras.layers.Dense(16, name="ff2")(x))
    out = keras.layers.Dense(10, activation="softmax", name="head")(x)
    return keras.Model(inputs, out, name="block")


def softmax_training(model, shape, steps: int = 6, **options):
    keras.utils.set_random_seed(0)
    data = batches(steps, shape)
    opt = keras.optimizers.SGD(0.05)

    def step(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, out))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return grads

    step = tf.function(step)
    with graddebug.watch(model, **options) as dbg:
        for x, y in data:
            dbg.step(step(x, y))
    return dbg


def with_softmax(model: keras.Model) -> keras.Model:
    return keras.Sequential([model, keras.layers.Softmax(name="probs")])


@pytest.mark.parametrize("build, shape", [
    (lambda: with_softmax(relu_mlp(depth=4, width=32)), (16, 32)),
    (lambda: with_softmax(res_cnn()), (8, 16, 16, 3)),
    (transformer_block, (8, 8, 16)),
])
def test_healthy_models_give_no_finding_with_ops(build, shape):
    model = build()
    dbg = softmax_training(model, shape, ops=True)
    assert dbg.frame()["step"].nunique() == 6
    assert dbg.findings().empty, dbg.findings()["message"].tolist()
    if any(layer.name == "masked" for layer in model.layers):
        # The checks ran and saw the mask's -inf, born there by design: no finding.
        births = dbg.events()
        births = births[births["event"] == "op_nonfinite"]
        assert set(births["layer"]) == {"masked"} and set(births["detail"]) == {"Inf"}


def test_a_nan_after_a_mask_of_minus_inf_is_placed_in_its_own_layer():
    # The masked attention holds -inf by design; the log behind it is where NaN is born.
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((8, 16))
    x = MaskedAttention(name="masked")(x)
    x = LogLayer(name="logs")(x)
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(
        keras.layers.GlobalAveragePooling1D(name="pool")(x)))
    dbg = softmax_training(model, (8, 8, 16), steps=1, ops=True)
    found = only(dbg.findings(), "nonfinite")
    assert found["layer"] == "logs"
    assert_points_at(found["source"], "forward-log")


# -- what is installed, and what it changes ---------------------------------------------------


def graddebug_ops_in_a_fresh_trace(model) -> list[str]:
    """The names of graddebug's finiteness checks in a newly traced forward and backward."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec((4, 6), tf.float32)).graph
    return [op.name for op in graph.get_operations() if "graddebug_check" in op.name]


def test_checks_are_traced_only_with_ops_and_none_after_exit():
    model = model_with(LogLayer(name="logs"))
    with graddebug.watch(model):
        assert graddebug_ops_in_a_fresh_trace(model) == []  # ops=False adds nothing
    with graddebug.watch(model, ops=True):
        assert graddebug_ops_in_a_fresh_trace(model) != []
    assert graddebug_ops_in_a_fresh_trace(model) == []


def test_nothing_is_left_installed_after_an_exception():
    model = model_with(LogLayer(name="logs"))
    with pytest.raises(RuntimeError, match="user code"), graddebug.watch(model, ops=True):
        assert graddebug_ops_in_a_fresh_trace(model) != []
        raise RuntimeError("user code")
    assert graddebug_ops_in_a_fresh_trace(model) == []
    assert "call" not in vars(model.layers[1])


def trained_weights(build, ops: bool | None, steps: int = 5):
    model = build()
    keras.utils.set_random_seed(1)
    data = batches(steps, (16, 32))
    if ops is None:
        train(model, data, compiled=True)
    else:
        with graddebug.watch(model, ops=ops) as dbg:
            train(model, data, dbg, compiled=True)
    return [w.copy() for w in model.get_weights()]


def test_weights_are_bitwise_identical_with_ops():
    def build():
        return relu_mlp(depth=4, width=32)

    plain = trained_weights(build, None)
    assert not np.array_equal(plain[0], build().get_weights()[0])  # training moved them
    for a, b in zip(plain, trained_weights(build, True), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(plain, trained_weights(build, False), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fit_weights_are_bitwise_identical_with_ops():
    def fitted(ops: bool | None):
        keras.utils.set_random_seed(0)
        model = res_cnn()
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((32, 16, 16, 3)).astype("float32")
        y = rng.integers(0, 10, 32)
        kwargs = dict(batch_size=8, epochs=1, shuffle=False, verbose=0)
        if ops is None:
            model.fit(x, y, **kwargs)
        else:
            with graddebug.watch(model, ops=ops) as dbg:
                model.fit(x, y, callbacks=[dbg.callback()], **kwargs)
            assert dbg.findings().empty, dbg.findings()["message"].tolist()
        return model.get_weights()

    plain = fitted(None)
    for a, b in zip(plain, fitted(True), strict=True):
        np.testing.assert_array_equal(a, b)


# -- escalate ---------------------------------------------------------------------------------


def test_escalate_names_the_op_on_the_step_after_the_first_nan():
    dbg = run_steps(model_with(LogLayer(name="logs")), compiled=True, steps=3, escalate=True)
    events = dbg.events()
    births = events[events["event"] == "op_nonfinite"]
    assert list(births["step"]) == [1]  # step 0 was layer-level; step 1 was escalated
    found = only(dbg.findings(), "nonfinite")
    assert found["step"] == 0 and found["layer"] == "logs"
    assert_points_at(found["source"], "forward-log")


def test_escalate_on_a_healthy_model_arms_nothing():
    dbg = run_steps(model_with(keras.layers.Dense(8, activation="relu", name="mid")),
                    compiled=True, steps=3, escalate=True)
    assert dbg.findings().empty
    assert not dbg.events()["event"].str.startswith("op_").any()


def test_escalate_names_a_cut_on_the_step_after_it_appeared():
    dbg = run_steps(model_with(StopLayer(name="middle")), compiled=True, steps=3, escalate=True)
    cuts = dbg.events()
    cuts = cuts[cuts["event"] == "op_cut"]
    assert list(cuts["step"].unique()) == [1]
    starved = dbg.findings()
    starved = starved[(starved["issue"] == "cut_graph") & (starved["layer"] == "fc1")]
    assert len(starved) == 1
    assert_points_at(starved["source"].iloc[0], "cut-stop")


# -- fail-open --------------------------------------------------------------------------------


def test_a_bug_in_the_op_callback_becomes_an_internal_error_and_training_goes_on(monkeypatch):
    from graddebug_tensorflow.ops import capture

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in op capture")

    def build():
        return relu_mlp(depth=3, width=16)

    plain = trained_weights(build, None)
    monkeypatch.setattr(capture.OpCapture, "_trace", broken)
    model = build()
    keras.utils.set_random_seed(1)
    with pytest.warns(graddebug.errors.GradDebugWarning, match="a bug in op capture"), \
            graddebug.watch(model, ops=True) as dbg:
        train(model, batches(5, (16, 32)), dbg, compiled=True)
    issues = set(dbg.findings()["issue"])
    assert issues == {"internal_error"}, dbg.findings()["message"].tolist()
    for a, b in zip(plain, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_tf_gradients_in_a_tf_function_names_the_backward_of_sqrt():
    model = model_with(SqrtLayer(name="roots"))
    x = tf.constant(np.random.default_rng(0).standard_normal((16, 6)), tf.float32)
    with graddebug.watch(model, ops=True) as dbg:
        @tf.function
        def step(x):
            loss = tf.reduce_mean((model(x, training=True) - 1.0) ** 2)
            return tf.gradients(loss, model.trainable_variables)

        dbg.step(step(x))
    found = only(dbg.findings(), "nonfinite")
    assert found["message"].startswith("the backward of Sqrt in 'roots'"), found["message"]
    assert_points_at(found["source"], "backward-sqrt")
