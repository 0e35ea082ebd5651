"""Keras specifics: XLA-compiled fit, mixed precision, unbuilt and nested models."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402


def data(n: int = 64, features: int = 32, classes: int = 10):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n)


def xent():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def first_batch_grads(model, x, y):
    """tape.gradient of fit's loss on the first batch, before any update."""
    with tf.GradientTape() as tape:
        loss = xent()(y, model(x, training=True))
    return {v.path: np.linalg.norm(g.numpy().astype(np.float64))
            for v, g in zip(model.trainable_variables,
                            tape.gradient(loss, model.trainable_variables), strict=True)}


def param_norms(frame, step: int = 0):
    rows = frame[(frame["kind"] == "parameter") & (frame["step"] == step)]
    return {f"{r.layer}/{r.tensor}": r.norm for r in rows.itertuples()}


def test_fit_with_xla_records_the_same_gradients():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10)], name="xla")
    model.compile(optimizer="sgd", loss=xent(), jit_compile=True)
    x, y = data()
    want = first_batch_grads(model, x[:32], y[:32])
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    got = param_norms(dbg.frame())
    assert len(got) == len(want) == 4
    for path, norm in want.items():
        layer, name = path.split("/")[-2:]
        assert got[f"{layer}/{name}"] == pytest.approx(norm, rel=1e-5)


def test_mixed_precision_parameter_gradients_are_unscaled(mixed_precision):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10, dtype="float32")], name="amp")
    model.compile(optimizer="sgd", loss=xent())
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = data()
    start = model.get_weights()
    want = first_batch_grads(model, x[:32], y[:32])  # no loss scaling in this reference
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    frame = dbg.frame()
    got = param_norms(frame)
    for path, norm in want.items():
        layer, name = path.split("/")[-2:]
        # float16 forward: agreement to half precision, far from the 2**15 loss scale.
        assert got[f"{layer}/{name}"] == pytest.approx(norm, rel=1e-2)
    # Layer-output gradients carry the loss scale in flight; the records divide it out.
    with tf.GradientTape() as tape:
        model2 = keras.models.clone_model(model)
        model2.set_weights(start)
        hidden = model2.layers[0](x[:32])
        tape.watch(hidden)
        loss = xent()(y[:32], model2.layers[1](hidden))
    dense = tape.gradient(loss, hidden).numpy().astype(np.float64)
    row = frame[(frame["step"] == 0) & (frame["layer"] == model.layers[0].name)
                & (frame["tensor"] == "output")]
    assert row["norm"].item() == pytest.approx(np.linalg.norm(dense), rel=1e-2)


class Unbuilt(keras.Model):
    def __init__(self) -> None:
        super().__init__(name="unbuilt")
        self.body = keras.layers.Dense(8, activation="tanh", name="body")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.body(x))


def test_subclassed_model_built_inside_the_watch():
    model = Unbuilt()
    assert not model.trainable_variables
    x = tf.random.stateless_normal((4, 3), seed=(1, 1))
    with graddebug.watch(model) as dbg:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        dbg.step(grads)
    frame = dbg.frame().set_index(["layer", "tensor"])
    assert set(frame.index) == {("body", "output"), ("head", "output"), ("body", "kernel"),
                                ("body", "bias"), ("head", "kernel"), ("head", "bias")}
    np.testing.assert_allclose(frame.loc[("body", "kernel"), "norm"],
                               np.linalg.norm(grads[0].numpy()), rtol=1e-6)
    assert frame.loc[("body", "output"), "depth"] < frame.loc[("head", "output"), "depth"]


def test_nested_models_name_inner_layers_uniquely():
    def block(name):
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="dense")],
                                name=name)

    inputs = keras.Input((4,))
    outputs = block("right")(block("left")(inputs))
    model = keras.Model(inputs, outputs)
    x = tf.ones((2, 4))
    with graddebug.watch(model) as dbg:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        dbg.step(tape.gradient(loss, model.trainable_variables))
    frame = dbg.frame()
    acts = frame[frame["kind"] == "activation"]
    assert acts["layer"].tolist() == ["left/dense", "right/dense"]
    params = frame[frame["kind"] == "parameter"]
    assert set(params["layer"]) == {"left/dense", "right/dense"}
    assert (params.groupby("layer")["depth"].first() == acts.set_index("layer")["depth"]).all()


@pytest.mark.parametrize("clip", ["global_clipnorm", "clipnorm"])
def test_fit_logs_each_epoch_and_keeps_the_norms_before_the_optimizer_clips(clip, capfd):
    x, y = data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, **{clip: 0.05}), loss=xent())
    expected = {path.split("/", 1)[1]: norm  # "sequential/dense/kernel": "dense/kernel"
                for path, norm in first_batch_grads(model, x[:16], y[:16]).items()}
    with graddebug.watch(model) as dbg:
        history = model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=1,
                            callbacks=[dbg.callback()])
    out, err = capfd.readouterr()
    assert "graddebug:" not in out + err  # a healthy run: no notice
    frame = dbg.frame()
    got = param_norms(frame)
    assert got == pytest.approx(expected, rel=1e-4)
    rows = frame[(frame["kind"] == "parameter") & (frame["step"] == 0)]
    total = np.sqrt(sum(v * v for v in expected.values()))
    assert total > 0.05  # the clip acted
    for r in rows.itertuples():
        norm = expected[f"{r.layer}/{r.tensor}"]
        after = min(norm, 0.05) if clip == "clipnorm" else norm * 0.05 / total
        assert r.clipped_norm == pytest.approx(after, rel=1e-4)
    # One value a layer and epoch, in the epoch's logs that History keeps.
    for key in ("graddebug/grad_norm", "graddebug/grad_norm/max", "graddebug/findings"):
        assert len(history.history[key]) == 2
    last_of_first_epoch = frame[(frame["kind"] == "parameter") & (frame["step"] == 3)]
    assert history.history["graddebug/grad_norm"][0] == pytest.approx(
        float(np.sqrt((last_of_first_epoch["norm"] ** 2).sum())), rel=1e-5)
