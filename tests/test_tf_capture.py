"""Captured gradients against tape.gradient, parity with torch, and the adapter's edge cases."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from tf_models import TwoTower, batches, relu_mlp, res_cnn, train  # noqa: E402


def leaf_names(model) -> list[str]:
    return [layer.name for layer in model.layers if not layer._flatten_layers(
        include_self=False, recursive=False) and not isinstance(layer, keras.layers.InputLayer)]


def reference(model, x, names):
    """dL/d(output) of each named layer and dL/dW, through a multi-output copy of the graph."""
    probe = keras.Model(model.inputs,
                        [model.get_layer(n).output for n in names] + [model.layers[-1].output])
    with tf.GradientTape() as tape:
        *hidden, out = probe(x, training=True)
        loss = tf.reduce_mean(tf.square(out))
    grads = tape.gradient(loss, [*hidden, *model.trainable_variables])
    acts = {n: g.numpy() for n, g in zip(names, grads[: len(names)], strict=True)}
    params = [g.numpy() for g in grads[len(names):]]
    return acts, params


def square_loss_step(model, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
    return tape.gradient(loss, model.trainable_variables)


MODELS = {
    "mlp": (lambda: relu_mlp(depth=4, width=16), (8, 32)),
    "cnn_bn": (res_cnn, (4, 16, 16, 3)),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("kind", MODELS)
def test_activation_and_parameter_gradients_equal_tape_gradient(kind, compiled):
    build, shape = MODELS[kind]
    keras.utils.set_random_seed(0)
    model = build()
    x = tf.random.stateless_normal(shape, seed=(1, 2))
    names = leaf_names(model)
    want_acts, want_params = reference(model, x, names)
    step = tf.function(square_loss_step) if compiled else square_loss_step
    with graddebug.watch(model, keep=names) as dbg:
        dbg.step(step(model, x))
    kept = dbg.tensors(0)
    for name in names:
        np.testing.assert_allclose(kept[name], want_acts[name], rtol=1e-5, atol=1e-7)
    for var, grad in zip(model.trainable_variables, want_params, strict=True):
        owner = var.path.rsplit("/", 2)[-2]
        np.testing.assert_allclose(kept[f"{owner}.{var.name}"], grad, rtol=1e-5, atol=1e-7)
    assert len(kept) == len(names) + len(want_params)
    frame = dbg.frame()
    acts = frame[frame["kind"] == "activation"].set_index("layer")
    for name in names:
        np.testing.assert_allclose(acts.loc[name, "norm"], np.linalg.norm(want_acts[name]),
                                   rtol=1e-5)
    params = frame[frame["kind"] == "parameter"]
    assert len(params) == len(model.trainable_variables)
    by_key = {(r.layer, r.tensor): r.norm for r in params.itertuples()}
    for var, grad in zip(model.trainable_variables, want_params, strict=True):
        owner = var.path.rsplit("/", 2)[-2]
        # atol: the stem's bias sits before BatchNorm, so its true gradient is 0 and what is
        # left is rounding noise, which differs between graph and eager kernels.
        np.testing.assert_allclose(by_key[(owner, var.name)], np.linalg.norm(grad), rtol=1e-5,
                                   atol=1e-7)
    assert list(acts["depth"]) == sorted(acts["depth"])  # forward order


def test_parity_with_torch_on_the_same_weights_and_batch():
    torch = pytest.importorskip("torch")
    from torch import nn

    keras.utils.set_random_seed(0)
    kmodel = relu_mlp(depth=4, width=16, inputs=12, classes=5)
    tlayers = OrderedDict()
    for layer in kmodel.layers:
        if isinstance(layer, keras.layers.Dense):
            kernel, bias = (w.numpy() for w in layer.weights)
            linear = nn.Linear(*kernel.shape)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
                linear.bias.copy_(torch.from_numpy(bias))
            tlayers[layer.name] = linear
        else:
            tlayers[layer.name] = nn.ReLU()
    tmodel = nn.Sequential(tlayers)
    x = np.random.default_rng(3).standard_normal((6, 12)).astype(np.float32)

    with graddebug.watch(kmodel) as kdbg:
        kdbg.step(square_loss_step(kmodel, tf.constant(x)))
    with graddebug.watch(tmodel) as tdbg:
        tmodel(torch.from_numpy(x)).square().mean().backward()
        tdbg.step()

    kframe = kdbg.frame().replace({"tensor": {"kernel": "weight"}})
    joined = kframe.merge(tdbg.frame(), on=["layer", "tensor", "kind"], suffixes=("_tf", "_torch"))
    assert len(joined) == len(kframe) == len(tdbg.frame()) == 7 + 8
    np.testing.assert_allclose(joined["norm_tf"], joined["norm_torch"], rtol=1e-5)
    assert (joined["depth_tf"] == joined["depth_torch"]).all()
    acts = joined[joined["kind"] == "activation"]
    assert (acts["shape_tf"] == acts["shape_torch"]).all()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_no_observer_effect_over_20_steps(compiled):
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=5, width=32)
    start = model.get_weights()
    data = batches(20, (16, 32))
    train(model, data, compiled=compiled)
    plain = model.get_weights()
    model.set_weights(start)
    with graddebug.watch(model) as dbg:
        train(model, data, dbg, compiled=compiled)
    watched = model.get_weights()
    assert dbg.frame()["step"].nunique() == 20
    for a, b in zip(plain, watched, strict=True):
        assert np.array_equal(a, b)


def test_tf_function_is_traced_once_and_records_every_step():
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=4, width=16)
    step = tf.function(square_loss_step)
    with graddebug.watch(model) as dbg:
        for x, _ in batches(6, (8, 32)):
            dbg.step(step(model, x))
    assert step.experimental_get_tracing_count() == 1
    frame = dbg.frame()
    assert frame.groupby("step").size().tolist() == [7 + 8] * 6
    # Each step's statistics are that step's, not a stale copy of the first.
    assert frame[(frame["layer"] == "fc1") & (frame["tensor"] == "output")]["norm"].nunique() == 6


def test_every_n_under_tf_function_records_only_those_steps_and_no_retrace():
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=3, width=16)
    step = tf.function(square_loss_step)
    data = batches(5, (8, 32))
    with graddebug.watch(model, every=2) as dbg:
        for x, _ in data:
            dbg.step(step(model, x))
    assert step.experimental_get_tracing_count() == 1
    frame = dbg.frame()
    assert sorted(frame["step"].unique()) == [0, 2, 4]
    want, _ = reference(model, data[2][0], ["fc2"])
    got = frame.set_index(["step", "layer", "tensor"]).loc[(2, "fc2", "output"), "norm"]
    np.testing.assert_allclose(got, np.linalg.norm(want["fc2"]), rtol=1e-5)


def test_tf_gradients_inside_tf_function():
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=3, width=16)
    x = tf.random.stateless_normal((8, 32), seed=(4, 5))
    want, want_params = reference(model, x, ["fc1", "act1", "fc2"])

    @tf.function
    def grads_of(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        return tf.gradients(loss, model.trainable_variables)

    with graddebug.watch(model) as dbg:
        dbg.step(grads_of(x))
    frame = dbg.frame().set_index(["layer", "tensor"])
    for name in ("fc1", "act1", "fc2"):
        np.testing.assert_allclose(frame.loc[(name, "output"), "norm"],
                                   np.linalg.norm(want[name]), rtol=1e-5)
    np.testing.assert_allclose(frame.loc[("fc1", "kernel"), "norm"],
                               np.linalg.norm(want_params[0]), rtol=1e-5)


def test_model_fit_records_each_batch_with_gradients_from_the_optimizer():
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=3, width=16, classes=4)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 32)).astype(np.float32)
    y = rng.standard_normal((32, 4)).astype(np.float32)
    start = model.get_weights()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y[:8], model(x[:8], training=True))
    want = tape.gradient(loss, model.trainable_variables)
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[dbg.callback()])
    frame = dbg.frame()
    assert frame["step"].nunique() == 8  # 4 batches x 2 epochs
    first = frame[(frame["step"] == 0) & (frame["kind"] == "parameter")]
    assert len(first) == len(model.trainable_variables)
    norms = {(r.layer, r.tensor): r.norm for r in first.itertuples()}
    np.testing.assert_allclose(norms[("fc1", "kernel")], np.linalg.norm(want[0]), rtol=1e-5)
    np.testing.assert_allclose(norms[("fc3", "bias")], np.linalg.norm(want[-1]), rtol=1e-5)
    # The same fit without graddebug lands on the same weights.
    watched = model.get_weights()
    model.set_weights(start)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), watched, strict=True):
        assert np.array_equal(a, b)


def test_everything_is_restored_after_exit_even_when_the_body_raised(tmp_path):
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=3, width=16, classes=4)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.ones((8, 32), np.float32)
    y = np.zeros((8, 4), np.float32)
    model.fit(x, y, verbose=0)  # compiled before watch: must be re-traced inside and after
    opt = model.optimizer
    with pytest.raises(RuntimeError, match="boom"), graddebug.watch(model, optimizer=opt) as dbg:
        model.fit(x, y, verbose=0, callbacks=[dbg.callback()])
        raise RuntimeError("boom")
    assert dbg.frame()["step"].nunique() == 1
    for layer in model._flatten_layers():
        assert "call" not in vars(layer), layer.name
    assert "apply" not in vars(opt)
    rows = len(dbg.frame())
    model.fit(x, y, verbose=0)
    assert len(dbg.frame()) == rows
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    clone = keras.models.clone_model(model)
    assert clone(x).shape == (8, 4)
    with graddebug.watch(model) as again:  # a second watch works
        again.step(square_loss_step(model, tf.constant(x)))
    assert again.frame()["step"].nunique() == 1


def test_layer_called_twice_sums_both_calls_and_keeps_each():
    keras.utils.set_random_seed(0)
    model = TwoTower()
    x = tf.random.stateless_normal((4, 8), seed=(0, 1))
    model(x)
    with graddebug.watch(model, keep=["embed"]) as dbg:
        dbg.step(square_loss_step(model, x))
    # Independent: the same forward by hand, differentiated at both embed outputs.
    with tf.GradientTape() as tape:
        e1, e2 = model.embed(x), model.embed(x * 2.0)
        loss = tf.reduce_mean(tf.square(model.head(e1 + e2)))
    g1, g2 = tape.gradient(loss, [e1, e2])
    kept = dbg.tensors(0)
    np.testing.assert_allclose(kept["embed"], g1.numpy(), rtol=1e-6)
    np.testing.assert_allclose(kept["embed#1"], g2.numpy(), rtol=1e-6)
    row = dbg.frame().set_index(["layer", "tensor"]).loc[("embed", "output")]
    np.testing.assert_allclose(row["norm"], np.sqrt(np.sum(g1**2) + np.sum(g2**2)), rtol=1e-5)
    assert row["numel"] == 2 * 4 * 16


class Split(keras.layers.Layer):
    def call(self, x):
        return {"pos": tf.nn.relu(x), "neg": tf.nn.relu(-x)}, x * 2.0


def test_nested_outputs_get_one_row_per_tensor():
    x = tf.random.stateless_normal((4, 3), seed=(0, 2))
    layer = Split(name="split")
    with graddebug.watch(layer) as dbg, tf.GradientTape() as tape:
        tape.watch(x)
        (parts, double) = layer(x)
        loss = tf.reduce_sum(parts["pos"] * 3.0) + tf.reduce_sum(parts["neg"]) + tf.reduce_sum(
            double * double)
        tape.gradient(loss, x)
        dbg.step()
    norms = dbg.frame().set_index("tensor")["norm"]
    assert set(norms.index) == {"output.0.pos", "output.0.neg", "output.1"}
    np.testing.assert_allclose(norms["output.0.pos"], 3.0 * np.sqrt(12), rtol=1e-6)
    np.testing.assert_allclose(norms["output.0.neg"], np.sqrt(12), rtol=1e-6)
    np.testing.assert_allclose(norms["output.1"], np.linalg.norm(4.0 * x.numpy()), rtol=1e-6)


def test_raw_tf_taps_and_params_without_a_model():
    rng = np.random.default_rng(0)
    W = tf.Variable(rng.standard_normal((5, 4)).astype(np.float32))
    b = tf.Variable(np.zeros(4, np.float32))
    x = tf.constant(rng.standard_normal((3, 5)).astype(np.float32))
    with graddebug.watch(params={"W": W, "b": b}, keep=["h"]) as dbg:
        with tf.GradientTape(persistent=True) as tape:
            h = dbg.tap(x @ W + b, "h")
            y = tf.tanh(h)
            loss = tf.reduce_sum(y**2)
        grads = tape.gradient(loss, [W, b])
        dbg.step(grads)
    # Independent: dL/dh by the chain rule in numpy.
    h_np = x.numpy() @ W.numpy()
    y_np = np.tanh(h_np)
    want_h = 2 * y_np * (1 - y_np**2)
    np.testing.assert_allclose(dbg.tensors(0)["h"], want_h, rtol=1e-5, atol=1e-7)
    frame = dbg.frame().set_index(["layer", "tensor"])
    np.testing.assert_allclose(frame.loc[("W", "W"), "norm"],
                               np.linalg.norm(x.numpy().T @ want_h), rtol=1e-5)
    np.testing.assert_allclose(frame.loc[("b", "b"), "norm"],
                               np.linalg.norm(want_h.sum(0)), rtol=1e-5)
    assert frame.loc[("h", "output"), "depth"] >= 0


def test_forward_without_a_tape_records_nothing():
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=3, width=16)
    x = tf.ones((2, 32))
    with graddebug.watch(model) as dbg:
        model(x)  # evaluation: nobody differentiates it
        with pytest.warns(graddebug.GradDebugWarning, match="no gradient since the last step"):
            dbg.step()
        dbg.step(square_loss_step(model, x))
    assert list(dbg.frame()["step"].unique()) == [1]
    assert dbg.events().empty
    assert dbg.findings().empty


def test_eager_statistics_are_compiled_once_not_once_per_layer():
    import graddebug_tensorflow.watching as tf_watching

    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=8, width=24, inputs=40, classes=7)  # shapes no other test uses
    before = tf_watching._write_activation.function.experimental_get_tracing_count()
    with graddebug.watch(model) as dbg:
        train(model, batches(2, (6, 40), classes=7), dbg)
    assert dbg.frame()["layer"].nunique() == 15
    # reduce_retracing generalises the shapes; the buffer row is a tensor, not a constant.
    assert tf_watching._write_activation.function.experimental_get_tracing_count() - before <= 2
