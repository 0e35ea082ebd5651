"""Clip, mask and scale gradients in flight in TF; checked against x.T @ modified(dL/dh)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from graddebug import MaskShapeError  # noqa: E402

X = np.array([[0.1, 0.2], [0.3, 0.4]])
W0 = np.array([[1.0, 2.0], [3.0, 4.0]])
B0 = np.array([0.5, 0.5])
Y0 = np.array([[0.8, 0.9], [0.7, 0.6]])


def dl_dh_numpy() -> np.ndarray:
    """dL/dh for L = mean((tanh(xW+b) - y0)^2), by hand in float64."""
    y = np.tanh(X @ W0 + B0)
    return 2 * (y - Y0) / y.size * (1 - y**2)


def clip_norm_np(g: np.ndarray, c: float) -> np.ndarray:
    return g * min(1.0, c / np.linalg.norm(g))


def run_tapped(compiled: bool = False, dtype=tf.float32, **intervention):
    W = tf.Variable(W0, dtype=dtype)
    b = tf.Variable(B0, dtype=dtype)
    x, y0 = tf.constant(X, dtype), tf.constant(Y0, dtype)
    with graddebug.watch(params={"W": W, "b": b}) as dbg:
        def step():
            with tf.GradientTape() as tape:
                h = dbg.tap(x @ W + b, "h", **intervention)
                loss = tf.reduce_mean(tf.square(tf.tanh(h) - y0))
            return tape.gradient(loss, [W, b])

        grads = (tf.function(step) if compiled else step)()
        dbg.step(grads)
    return [g.numpy() for g in grads], dbg


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize(
    ("options", "modify"),
    [
        ({"clip_norm": 0.01}, lambda g: clip_norm_np(g, 0.01)),
        ({"clip_value": 0.005}, lambda g: np.clip(g, -0.005, 0.005)),
        ({"mask": tf.constant([[True, False], [False, True]])},
         lambda g: g * np.array([[1, 0], [0, 1]])),
        ({"mask": tf.constant([[1.0, 0.0]])}, lambda g: g * np.array([[1, 0]])),
        ({"mask": np.array([[0.0, 1.0]])}, lambda g: g * np.array([[0, 1]])),
        ({"scale": -2.5}, lambda g: g * -2.5),
        ({"mask": lambda g: tf.reverse(g, [0])}, lambda g: g[::-1]),
        ({"scale": 3.0, "clip_norm": 0.02}, lambda g: clip_norm_np(g * 3.0, 0.02)),
    ],
)
def test_tap_intervention_changes_dl_dw_by_the_vjp_formula(options, modify, compiled):
    (grad_w, grad_b), dbg = run_tapped(compiled=compiled, **options)
    g = dl_dh_numpy()
    modified = modify(g)
    np.testing.assert_allclose(grad_w, X.T @ modified, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(grad_b, modified.sum(0), rtol=1e-5, atol=1e-9)
    row = dbg.frame().query("layer == 'h'")
    assert row["pre_norm"].item() == pytest.approx(np.linalg.norm(g), rel=1e-5)
    assert row["norm"].item() == pytest.approx(np.linalg.norm(modified), rel=1e-5)
    params = dbg.frame().query("kind == 'parameter'").set_index("tensor")["norm"]
    assert params["W"] == pytest.approx(np.linalg.norm(X.T @ modified), rel=1e-5)


def test_no_intervention_leaves_no_pre_norm_column():
    _, dbg = run_tapped()
    assert "pre_norm" not in dbg.frame().columns
    assert set(dbg.frame()["layer"]) == {"h", "W", "b"}


def test_float64_tap_with_clip_norm_is_exact():
    (grad_w, _), _ = run_tapped(dtype=tf.float64, clip_norm=0.01)
    np.testing.assert_allclose(grad_w, X.T @ clip_norm_np(dl_dh_numpy(), 0.01), rtol=1e-12)


def test_elementwise_product_is_not_the_chain_rule_but_the_vjp_is():
    W = tf.Variable(W0)
    b = tf.Variable(B0)
    x = tf.constant(X)
    with tf.GradientTape(persistent=True) as tape:
        h = x @ W + b
        loss = tf.reduce_mean(tf.square(tf.tanh(h) - Y0))
        h_sum = tf.reduce_sum(h)
    direct = tape.gradient(loss, W)
    dl_dh = tape.gradient(loss, h)
    dh_dw = tape.gradient(h_sum, W)
    assert not np.allclose((dl_dh * dh_dw).numpy(), direct.numpy())
    vjp = tape.gradient(h, W, output_gradients=dl_dh)
    np.testing.assert_allclose(vjp.numpy(), direct.numpy(), rtol=1e-12)
    np.testing.assert_allclose((X.T @ dl_dh.numpy()), direct.numpy(), rtol=1e-12)


def model_and_input():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(4, name="d0"),
        keras.layers.Activation("tanh", name="tanh"),
        keras.layers.Dense(2, name="d1"),
    ])
    return model, tf.random.stateless_normal((5, 3), seed=(0, 3))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_intervene_on_a_layer_output_and_record_pre_norm(compiled):
    model, x = model_and_input()
    # Reference: the gradient at d0's output, clipped by hand, pushed through d0's kernel.
    with tf.GradientTape() as tape:
        h = model.get_layer("d0")(x)
        tape.watch(h)
        loss = tf.reduce_sum(tf.square(model.get_layer("d1")(model.get_layer("tanh")(h))))
    g = tape.gradient(loss, h).numpy().astype(np.float64)
    clipped = clip_norm_np(g, 0.1)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)))
        return tape.gradient(loss, model.trainable_variables)

    with graddebug.watch(model, intervene={"d0": {"clip_norm": 0.1}}) as dbg:
        grads = (tf.function(step) if compiled else step)(x)
        dbg.step(grads)
    np.testing.assert_allclose(grads[0].numpy(), x.numpy().T @ clipped, rtol=1e-5)
    frame = dbg.frame()
    row = frame.query("layer == 'd0' and kind == 'activation'")
    assert row["pre_norm"].item() == pytest.approx(np.linalg.norm(g), rel=1e-5)
    assert row["norm"].item() == pytest.approx(0.1, rel=1e-5)
    assert frame.query("layer != 'd0'")["pre_norm"].isna().all()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_interventions_act_on_steps_that_every_skips(compiled):
    model, x = model_and_input()

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return tape.gradient(loss, model.trainable_variables)

    step = tf.function(step) if compiled else step
    with graddebug.watch(model, every=2, intervene={"d1": {"scale": 0.0}}) as dbg:
        for _ in range(3):
            grads = step(x)
            assert np.count_nonzero(grads[-2].numpy()) == 0  # d1's kernel
            dbg.step(grads)
    assert sorted(dbg.frame()["step"].unique()) == [0, 2]


def test_mask_that_does_not_broadcast_names_layer_and_both_shapes():
    model, x = model_and_input()
    bad = tf.ones((3, 5), tf.bool)
    with pytest.raises(MaskShapeError, match=r"'d0'.*\(3, 5\).*\(5, 4\)"), \
            graddebug.watch(model, intervene={"d0": {"mask": bad}}), tf.GradientTape():
        model(x)


def test_mask_callable_returning_wrong_shape_raises():
    W = tf.Variable(W0)
    with graddebug.watch(params={"W": W}) as dbg, tf.GradientTape() as tape:
        h = dbg.tap(tf.constant(X) @ W, "h", mask=lambda g: g[:1])
        loss = tf.reduce_sum(h)
        with pytest.raises(MaskShapeError, match="'h'"):
            tape.gradient(loss, W)
