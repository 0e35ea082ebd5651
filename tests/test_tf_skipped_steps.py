"""Eager steps ``every=`` skips: the gradients handed to ``dbg.step(grads)`` are checked but not
measured, layer outputs pass through untouched, and the next recorded step is measured whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from graddebug.errors import GradientCountError  # noqa: E402
from graddebug_tensorflow.params import ParamSet  # noqa: E402


class Last(keras.layers.Layer):
    """Dense-like layer that keeps the tensor its ``call`` returned."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1], 8), initializer="glorot_uniform")

    def call(self, x: Any) -> Any:
        self.last = tf.matmul(x, self.w)
        return self.last


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), Last(), keras.layers.Dense(3)])


def _grads(model: keras.Model, x: Any, y: Any) -> list[Any]:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return tape.gradient(loss, model.trainable_variables)


def test_a_skipped_step_checks_the_gradients_and_measures_none(monkeypatch):
    model = _model()
    x, y = tf.random.normal((4, 6)), tf.random.normal((4, 3))
    stored: list[int] = []
    original = ParamSet._store

    def counted(self: ParamSet, pairs: Any, *args: Any, **kwargs: Any) -> Any:
        stored.append(len(pairs))
        return original(self, pairs, *args, **kwargs)

    monkeypatch.setattr(ParamSet, "_store", counted)
    with graddebug.watch(model, every=2) as dbg:
        dbg.step(_grads(model, x, y))
        recorded = len(stored)
        grads = _grads(model, x, y)
        with pytest.raises(GradientCountError):
            dbg.step(grads[::-1])  # still checked on a skipped step
        dbg.step(grads)
        assert len(stored) == recorded  # step 1: nothing measured
        last = _grads(model, x, y)
        dbg.step(last)
    rows = dbg.frame().query("kind == 'parameter'")
    assert sorted(rows["step"].unique()) == [0, 2]
    step2 = rows[rows["step"] == 2]
    expected = sorted(float(np.linalg.norm(g.numpy())) for g in last)
    np.testing.assert_allclose(sorted(step2["norm"]), expected, rtol=1e-6)


def test_a_skipped_eager_step_returns_layer_outputs_untouched():
    model = _model()
    layer = model.layers[0]
    x = tf.random.normal((4, 6))
    with graddebug.watch(model, every=2) as dbg:
        with tf.GradientTape():
            assert layer(x) is not layer.last  # step 0: passed through the recording identity
        dbg.step(_grads(model, x, tf.zeros((4, 3))))
        with tf.GradientTape():
            assert layer(x) is layer.last  # step 1, skipped
