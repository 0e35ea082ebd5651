"""Hardening of capture in TensorFlow: gradients handed to ``step(grads)`` are checked, and a
step that records no parameter gradient says why."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from graddebug import GradDebugWarning, GradientCountError  # noqa: E402


def _model() -> keras.Sequential:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def _grads(model: keras.Model, x: tf.Tensor) -> list[tf.Tensor]:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x, training=True)))
    return tape.gradient(loss, model.trainable_variables)


# -- 8 and 15: step(grads) checks each gradient against its variable ----------------------


def test_step_grads_in_the_wrong_order_raise_naming_the_first_mismatch():
    model = _model()
    x = tf.ones((2, 3))
    with graddebug.watch(model) as dbg:
        grads = _grads(model, x)
        with pytest.raises(GradientCountError, match=r"#0 .*kernel.*shape \(4,\)"):
            dbg.step([grads[1], grads[0], *grads[2:]])
        grads = _grads(model, x)
        with pytest.raises(GradientCountError, match=r"#3 .*float64"):
            dbg.step([*grads[:3], tf.cast(grads[3], tf.float64)])
        grads = _grads(model, x)
        dbg.step(grads)
    kernel = dbg.frame().query("kind == 'parameter' and tensor == 'kernel'")
    assert kernel["norm"].iloc[0] == pytest.approx(float(tf.norm(grads[0])), rel=1e-5)


def test_step_with_strings_raises_a_typed_error_not_attribute_error():
    model = _model()
    with graddebug.watch(model) as dbg:
        grads = _grads(model, tf.ones((2, 3)))
        with pytest.raises(GradientCountError, match=r"#0 .*is a str, not a tensor"):
            dbg.step(["a", "b", "c", "d"])
        dbg.step(grads)  # the step is still open, and records once given the gradients
    assert len(dbg.frame().query("kind == 'parameter'")) == 4


def test_step_accepts_none_and_numpy_gradients_of_the_right_shape():
    model = _model()
    with graddebug.watch(model) as dbg:
        grads = _grads(model, tf.ones((2, 3)))
        dbg.step([grads[0].numpy(), None, grads[2], grads[3]])
    params = dbg.frame().query("kind == 'parameter'")
    assert len(params) == 3
    assert dbg.events()["event"].tolist() == ["no_grad"]


# -- 13: no gradients and no optimizer ------------------------------------------------------


def test_step_without_gradients_or_optimizer_warns_once():
    model = _model()
    with pytest.warns(GradDebugWarning, match="no parameter gradients") as caught, \
            graddebug.watch(model) as dbg:
        for _ in range(3):
            _grads(model, tf.ones((2, 3)))
            dbg.step()
    assert len(caught) == 1
    frame = dbg.frame()
    assert set(frame["kind"]) == {"activation"}
    assert sorted(frame["step"].unique()) == [0, 1, 2]


def test_step_with_an_optimizer_does_not_warn():
    model = _model()
    opt = keras.optimizers.SGD(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradDebugWarning)
        with graddebug.watch(model, optimizer=opt) as dbg:
            grads = _grads(model, tf.ones((2, 3)))
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            dbg.step()
    params = dbg.frame().query("kind == 'parameter'")
    np.testing.assert_allclose(sorted(params["norm"]),
                               sorted(float(tf.norm(g)) for g in grads), rtol=1e-5)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A layer output that ``tf.nest`` sees as one leaf."""

    left: tf.Tensor
    right: tf.Tensor


class Split(keras.layers.Layer):
    """Returns its two halves through two Dense layers, as a dataclass."""

    def __init__(self) -> None:
        super().__init__(name="split")
        self.a, self.b = keras.layers.Dense(3, name="a"), keras.layers.Dense(3, name="b")

    def call(self, x: tf.Tensor) -> Pair:
        return Pair(self.a(x), self.b(x))


class Net(keras.Model):
    def __init__(self) -> None:
        super().__init__(name="net")
        self.split = Split()

    def call(self, x: tf.Tensor) -> Pair:
        return self.split(x)


def test_a_dataclass_output_gets_one_row_per_field_equal_to_tape_gradient() -> None:
    keras.utils.set_random_seed(0)
    net = Net()
    x = tf.random.normal((5, 4))
    net(x)  # build
    split = net.split
    with graddebug.watch(net, layers=["split"]) as dbg:
        with tf.GradientTape(persistent=True) as tape:
            out = net(x)
            loss = tf.reduce_sum(out.left ** 2) + 3.0 * tf.reduce_sum(out.right)
        assert isinstance(out, Pair)
        want = {name: float(tf.norm(tape.gradient(loss, getattr(out, name))))
                for name in ("left", "right")}
        dbg.step(tape.gradient(loss, split.trainable_variables))
    rows = dbg.frame().query("layer == 'split' and kind == 'activation'")
    got = dict(zip(rows["tensor"], rows["norm"], strict=True))
    assert set(got) == {"output.left", "output.right"}
    for name, norm in want.items():
        assert got[f"output.{name}"] == pytest.approx(norm, rel=1e-6)
