"""graddebug.check and Report.assert_healthy on Keras models."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from tf_models import batches, relu_mlp, sigmoid_mlp, xent  # noqa: E402


def test_check_records_the_gradients_of_tape_gradient():
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=4, width=16)
    x, y = batches(1, (8, 32))[0]
    with tf.GradientTape() as tape:
        loss = xent(model(x, training=True), y)
    want = tape.gradient(loss, model.trainable_variables)
    report = graddebug.check(model, (x, y), xent)
    params = report.frame().query("kind == 'parameter'")
    assert len(params) == len(want)
    norms = {(r.layer, r.tensor): r.norm for r in params.itertuples()}
    for var, grad in zip(model.trainable_variables, want, strict=True):
        owner = var.path.rsplit("/", 2)[-2]
        assert norms[(owner, var.name)] == pytest.approx(np.linalg.norm(grad), rel=1e-5)
    report.assert_healthy()


def test_check_with_an_optimizer_trains_like_a_plain_loop():
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=3, width=16)
    start = model.get_weights()
    x, y = batches(1, (8, 32))[0]
    opt = keras.optimizers.SGD(0.1)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = xent(model(x, training=True), y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    plain = model.get_weights()
    model.set_weights(start)
    report = graddebug.check(model, (x, y), xent, steps=3, optimizer=keras.optimizers.SGD(0.1))
    assert report.frame()["step"].nunique() == 3
    for a, b in zip(plain, model.get_weights(), strict=True):
        assert np.array_equal(a, b)


def test_assert_healthy_names_the_vanishing_keras_layer():
    keras.utils.set_random_seed(0)
    model = sigmoid_mlp(depth=12)
    report = graddebug.check(model, batches(1, (32, 32))[0], xent)
    with pytest.raises(AssertionError, match="fc0") as info:
        report.assert_healthy()
    assert "vanishing" in str(info.value)


def test_check_rejects_a_loss_that_is_not_a_scalar():
    model = relu_mlp(depth=2, width=4)
    x, _ = batches(1, (4, 32))[0]
    with pytest.raises(graddebug.ConfigError, match="scalar"):
        graddebug.check(model, x, lambda out: out)
