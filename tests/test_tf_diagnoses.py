"""Keras models: healthy ones give no finding; broken ones are diagnosed at the right layer."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from tf_models import batches, relu_mlp, res_cnn, sigmoid_mlp, train, xent  # noqa: E402


def watched_training(model, data, lr: float = 0.05, **options):
    with graddebug.watch(model, **options) as dbg:
        train(model, data, dbg, lr=lr, compiled=True)
    return dbg


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_relu_mlp_gives_no_finding_over_50_steps(seed):
    keras.utils.set_random_seed(seed)
    dbg = watched_training(relu_mlp(depth=8, width=64, seed=seed),
                           batches(50, (32, 32), seed=seed))
    assert dbg.frame()["step"].nunique() == 50
    assert dbg.findings().empty, dbg.findings()["message"].tolist()


def test_healthy_residual_cnn_gives_no_finding_over_50_steps():
    keras.utils.set_random_seed(0)
    dbg = watched_training(res_cnn(), batches(50, (16, 16, 16, 3)))
    assert dbg.frame()["step"].nunique() == 50
    assert dbg.findings().empty, dbg.findings()["message"].tolist()


def test_sigmoid_mlp_vanishes_in_the_early_layers():
    keras.utils.set_random_seed(0)
    model = sigmoid_mlp(depth=12)
    dbg = watched_training(model, batches(5, (32, 32)))
    found = dbg.findings()
    vanishing = found[found["issue"] == "vanishing"]
    assert set(found["issue"]) == {"vanishing"}
    depth = dict(zip(dbg.frame()["layer"], dbg.frame()["depth"], strict=False))
    flagged = sorted(depth[layer] for layer in vanishing["layer"])
    assert flagged[0] == 0  # the first layer
    assert max(flagged) < max(depth.values()) - 4  # the layers near the loss are fine
    # Independent check: the first kernel's gradient really is tiny relative to the last.
    x, y = batches(1, (32, 32), seed=9)[0]
    with tf.GradientTape() as tape:
        loss = xent(model(x), y)
    grads = tape.gradient(loss, model.trainable_variables)
    assert np.linalg.norm(grads[0]) / np.linalg.norm(grads[-2]) < 1e-3


def test_large_weights_explode_towards_the_input():
    keras.utils.set_random_seed(0)
    init = keras.initializers.RandomNormal(stddev=3.0 / np.sqrt(32), seed=0)
    model = keras.Sequential([keras.Input((32,))] + [
        keras.layers.Dense(32, use_bias=False, kernel_initializer=init, name=f"d{i}")
        for i in range(10)])
    with graddebug.watch(model) as dbg:
        for x, _ in batches(3, (16, 32)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x)))
            dbg.step(tape.gradient(loss, model.trainable_variables))
    found = dbg.findings()
    assert set(found["issue"]) == {"exploding"}
    assert "explodes" in found.set_index("layer").loc["d0", "message"]


def log_model(k: int) -> keras.Sequential:
    layers = [keras.Input((16,))] + [keras.layers.Dense(16, name=f"d{i}") for i in range(5)]
    layers.insert(k + 2, keras.layers.Lambda(tf.math.log, name="log"))
    return keras.Sequential(layers)


@pytest.mark.parametrize("k", [1, 3])
def test_log_of_negative_is_traced_to_its_layer(k):
    keras.utils.set_random_seed(0)
    model = log_model(k)
    with graddebug.watch(model) as dbg:
        for x, _ in batches(2, (8, 16)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x))
            dbg.step(tape.gradient(loss, model.trainable_variables))
    found = dbg.findings()
    nonfinite = found[found["issue"] == "nonfinite"]
    assert nonfinite["layer"].tolist() == ["log"]
    assert nonfinite["step"].item() == 0
    assert "forward" in nonfinite["message"].item()
    # log's derivative 1/x is finite but huge near 0: layers behind it may be flagged too,
    # never the ones after it.
    depth = dict(zip(dbg.frame()["layer"], dbg.frame()["depth"], strict=False))
    others = found[found["issue"] != "nonfinite"]
    assert all(depth[layer] < depth["log"] for layer in others["layer"])


def test_layers_that_keep_values_finite_skip_the_forward_check_and_the_birth_is_named():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(16, name="d0"),
        keras.layers.Lambda(tf.math.log, name="log"), keras.layers.ReLU(name="relu"),
        keras.layers.Dropout(0.1, name="drop"), keras.layers.Activation("tanh", name="tanh"),
        keras.layers.Activation("softplus", name="softplus"), keras.layers.Dense(4, name="d1")])
    with graddebug.watch(model) as dbg:
        for x, _ in batches(1, (8, 16)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True))
            dbg.step(tape.gradient(loss, model.trainable_variables))
    events = dbg.report().events()
    forward = events[events["event"] == "forward_nonfinite"]
    # the NaN born in log passes through every layer after it; only those that can make one
    # from finite values are checked
    assert forward["layer"].tolist() == ["log", "softplus", "d1"]
    found = dbg.findings()
    assert found[found["issue"] == "nonfinite"]["layer"].tolist() == ["log"]


class SqrtAtZero(keras.layers.Layer):
    """Finite forward; in backward sqrt' = inf at the masked zeros, and inf * 0 = NaN."""

    def call(self, x):
        mask = tf.concat([tf.zeros_like(x[:, :1]), tf.ones_like(x[:, 1:])], 1)
        return tf.sqrt(tf.square(x) * mask)


def test_backward_born_nan_is_traced_to_the_layer_below_the_op():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="d0"),
                              SqrtAtZero(name="sqrt"), keras.layers.Dense(1, name="d1")])
    with graddebug.watch(model) as dbg, tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.random.stateless_normal((4, 8), seed=(0, 0))))
        dbg.step(tape.gradient(loss, model.trainable_variables))
    found = dbg.findings()
    assert list(found["issue"]) == ["nonfinite"]
    assert found["layer"].item() == "d0"  # the first non-finite gradient, behind sqrt
    assert "'sqrt'" in found["message"].item()  # and the layer whose backward produced it


class Cut(keras.Model):
    """Two blocks and a head; the graph is cut between the blocks in one of three ways."""

    def __init__(self, how: str) -> None:
        super().__init__(name="cut")
        self.how = how
        self.block1 = keras.layers.Dense(8, activation="relu", name="block1")
        self.block2 = keras.layers.Dense(8, activation="relu", name="block2")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        h = self.block1(x)
        if self.how == "stop_gradient":
            h = tf.stop_gradient(h)
        elif self.how == "numpy":
            h = tf.constant(h.numpy())
        return self.head(self.block2(h))


@pytest.mark.parametrize("how", ["stop_gradient", "numpy"])
def test_cut_graph_names_the_boundary_and_the_starved_variables(how):
    keras.utils.set_random_seed(0)
    model = Cut(how)
    data = batches(2, (4, 5), classes=3)
    model(data[0][0])
    with graddebug.watch(model) as dbg:
        for x, y in data:
            with tf.GradientTape() as tape:
                loss = xent(model(x), y)
            grads = tape.gradient(loss, model.trainable_variables)
            assert grads[0] is None and grads[1] is None  # independent: block1 gets nothing
            dbg.step(grads)
    found = dbg.findings()
    assert set(found["issue"]) == {"cut_graph"}
    boundary = found[found["severity"] == "error"]
    assert boundary["layer"].tolist() == ["block2"]
    assert "between 'block1' and 'block2'" in boundary["message"].item()
    starved = found[found["severity"] == "warning"]
    assert starved["layer"].tolist() == ["block1"]
    assert "kernel, bias" in starved["message"].item()


def test_model_fit_with_a_cut_gets_a_finding_not_just_a_keras_warning():
    keras.utils.set_random_seed(0)
    model = Cut("stop_gradient")
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).standard_normal((16, 5)).astype(np.float32)
    y = np.arange(16) % 3
    with graddebug.watch(model) as dbg, \
            pytest.warns(UserWarning, match="Gradients do not exist"):  # all Keras says
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[dbg.callback()])
    found = dbg.findings()
    assert "between 'block1' and 'block2'" in " ".join(found["message"])
    starved = found[found["severity"] == "warning"]
    assert starved["layer"].tolist() == ["block1"]


def test_fit_stops_on_nonfinite_and_names_the_layer():
    keras.utils.set_random_seed(0)
    model = log_model(1)
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    y = np.zeros((32, 16), np.float32)
    with graddebug.watch(model) as dbg:
        callback = dbg.callback(stop_on=("nonfinite",))
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[callback])
    assert dbg.frame()["step"].nunique() == 1  # stopped after the first batch
    assert len(history.history["loss"]) == 1
    assert "'log'" in callback.stop_reason
    assert "forward" in callback.stop_reason


@pytest.mark.slow
def test_efficientnet_b0_at_initialisation_gives_no_finding():
    # Its stem's activation gradient has 1,000 times the entries of the 1000-wide head's, and
    # a norm 2,700 times larger; per entry it is 480 times larger, spread over 230 layers.
    keras.utils.set_random_seed(0)
    model = keras.applications.EfficientNetB0(weights=None, input_shape=(64, 64, 3))
    x = np.random.default_rng(0).standard_normal((2, 64, 64, 3)).astype(np.float32)
    y = np.array([3, 7])
    with graddebug.watch(model) as dbg:
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = keras.losses.SparseCategoricalCrossentropy()(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            dbg.step(grads)
    frame = dbg.frame()
    acts = frame[(frame["kind"] == "activation") & (frame["step"] == 0)].sort_values("depth")
    assert acts["norm"].iloc[0] / acts["norm"].iloc[-1] > 70  # the old norm ratio fired
    assert dbg.findings().empty, dbg.findings()["message"].tolist()


class Frozen(keras.layers.Layer):
    """A weightless layer that cuts the graph inside its call."""

    def call(self, x):
        return tf.stop_gradient(x)


def _frozen_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              Frozen(name="frozen"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("loop", ["fit", "tape", "tf.function"])
def test_a_cut_inside_a_weightless_layer_names_that_layer(loop):
    model = _frozen_model()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 8)).astype("float32"), rng.integers(0, 3, 32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, model.trainable_variables, strict=True)
                 if g is not None]
        model.optimizer.apply_gradients(pairs)
        return loss

    with graddebug.watch(model, optimizer=model.optimizer if loop != "fit" else None) as dbg:
        if loop == "fit":
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[dbg.callback()])
        else:
            run = tf.function(step) if loop == "tf.function" else step
            for _ in range(2):
                dbg.step(loss=run())
    found = dbg.findings()
    cut = found[(found["issue"] == "cut_graph") & (found["severity"] == "error")]
    assert list(zip(cut["layer"], cut["tensor"], strict=True)) == [("frozen", "output")]
    assert "gradient stops at 'frozen'" in cut["message"].iloc[0]
    # The layer downstream of the cut is healthy: it has rows and no finding of its own.
    last = model.layers[-1].name
    assert last in set(dbg.frame()["layer"])
    assert last not in set(found["layer"])
