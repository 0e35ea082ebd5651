"""Keras mixed precision: statistics without the loss scale, and the steps a
LossScaleOptimizer skips, checked against ``tape.gradient`` of a float32 run."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from graddebug.errors import ConfigError  # noqa: E402

BATCH = 16
HUGE = 2.0**40  # scaled gradients of a float16 layer overflow at this scale
FP16 = 2e-2  # float16 forward and backward: agreement to half precision, far from 2**15


def data(steps: int = 3):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * steps, 8)).astype(np.float32)
    return x, rng.integers(0, 3, BATCH * steps)


def mlp(dtype: str | None = None):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="tanh", name="d1", dtype=dtype),
        keras.layers.Dense(3, name="d2", dtype="float32"),  # float32 logits, as Keras advises
    ], name="amp")


def xent():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def float32_reference(weights, x, y):
    """``tape.gradient`` of the float32 model: parameter norms and the layers' output
    gradient norms, with no loss scaling anywhere."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        model = mlp("float32")
        model.set_weights(weights)
        d1, d2 = model.layers
        with tf.GradientTape() as tape:
            h1 = d1(x)
            tape.watch(h1)
            h2 = d2(h1)
            tape.watch(h2)
            loss = xent()(y, h2)
        grads = tape.gradient(loss, [h1, h2, *model.trainable_variables])
    finally:
        keras.mixed_precision.set_global_policy(previous)
    norms = [float(np.linalg.norm(g.numpy().astype(np.float64))) for g in grads]
    names = ["d1/output", "d2/output", "d1/kernel", "d1/bias", "d2/kernel", "d2/bias"]
    return dict(zip(names, norms, strict=True))


def step_norms(frame, step: int):
    rows = frame[(frame["step"] == step) & (frame["kind"] != "loss")]  # the gradients
    return {f"{r.layer}/{r.tensor}": r.norm for r in rows.itertuples()}


class ForceOverflow(keras.callbacks.Callback):
    """Sets the loss scale so high before batch ``at`` that its gradients overflow, and back
    after it: the optimizer skips that step alone."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            self.model.optimizer.dynamic_scale.assign(HUGE)
        elif batch == self.at + 1:
            self.model.optimizer.dynamic_scale.assign(2.0**15)


def fit(model, x, y, callbacks=()):
    model.compile(optimizer="sgd", loss=xent())
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=list(callbacks))


def test_fit_records_the_float32_gradients(mixed_precision):
    x, y = data()
    model = mlp()
    want = float32_reference(model.get_weights(), x[:BATCH], y[:BATCH])
    with graddebug.watch(model) as dbg:
        fit(model, x, y, [dbg.callback()])
    got = step_norms(dbg.frame(), 0)
    assert got.keys() == want.keys()
    assert got == pytest.approx(want, rel=FP16)
    assert dbg.events().empty


def test_a_skipped_step_is_marked_once_and_kept_apart(mixed_precision):
    x, y = data(steps=4)
    model = mlp()
    with graddebug.watch(model) as dbg:
        fit(model, x, y, [ForceOverflow(at=1), dbg.callback()])
    events = dbg.events()
    assert events[["step", "layer", "tensor", "depth", "event", "detail"]].to_dict("records") \
        == [{"step": 1, "layer": "", "tensor": "", "depth": -1, "event": "skipped_step",
             "detail": f"scale={HUGE!r}"}]
    frame = dbg.frame()
    per_step = frame[frame["kind"] != "loss"].groupby("step").size()
    assert per_step.to_dict() == {0: 6, 1: 6, 2: 6, 3: 6}  # not lost, not merged
    skipped = frame[frame["step"] == 1]
    assert not np.isfinite(skipped[skipped["layer"] == "d1"]["norm"]).all()
    later = frame[frame["step"] >= 2]
    assert np.isfinite(later["norm"]).all() and not later["nan"].any()
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15


def test_the_step_after_a_skip_records_its_own_gradients(mixed_precision):
    """The step after a skipped one starts from the weights before it: its gradients are the
    float32 gradients of batch 2 at the weights after step 0."""
    x, y = data(steps=3)
    model = mlp()
    with graddebug.watch(model) as dbg:
        fit(model, x, y, [ForceOverflow(at=1), dbg.callback()])
    # Replay unwatched: step 0 applied, step 1 skipped.
    replay = mlp()
    fit(replay, x[:BATCH], y[:BATCH])
    want = float32_reference(replay.get_weights(), x[2 * BATCH:], y[2 * BATCH:])
    assert step_norms(dbg.frame(), 2) == pytest.approx(want, rel=FP16)


def test_watching_changes_no_weight(mixed_precision):
    x, y = data(steps=4)
    model, plain = mlp(), mlp()
    with graddebug.watch(model) as dbg:
        fit(model, x, y, [ForceOverflow(at=1), dbg.callback()])
    fit(plain, x, y, [ForceOverflow(at=1)])
    assert len(dbg.events()) == 1
    for watched, unwatched in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(watched, unwatched)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("hand_over", [False, True], ids=["optimizer", "step-grads"])
def test_a_custom_loop_with_a_loss_scale_optimizer(mixed_precision, compiled, hand_over):
    x, y = data(steps=3)
    model = mlp()
    model.build((None, 8))
    start = model.get_weights()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.build(model.trainable_variables)
    loss_fn = xent()

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(loss_fn(yb, model(xb, training=True)))
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return grads

    run = tf.function(train_step) if compiled else train_step
    with graddebug.watch(model, optimizer=optimizer) as dbg:
        for i in range(3):
            if i == 1:
                optimizer.dynamic_scale.assign(HUGE)
            grads = run(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
            if i == 1:
                optimizer.dynamic_scale.assign(2.0**15)
            dbg.step(grads if hand_over else None)
    frame = dbg.frame()
    want = float32_reference(start, x[:BATCH], y[:BATCH])
    assert step_norms(frame, 0) == pytest.approx(want, rel=FP16)
    assert dbg.events()[["step", "event", "detail"]].values.tolist() == [
        [1, "skipped_step", f"scale={HUGE!r}"]]
    gradients = frame[frame["kind"] != "loss"]
    assert gradients.groupby("step").size().to_dict() == {0: 6, 1: 6, 2: 6}


def test_a_static_loss_scale_factor_is_divided_out():
    x, y = data(steps=1)
    model = mlp("float32")
    want = float32_reference(model.get_weights(), x, y)
    model.compile(optimizer=keras.optimizers.SGD(loss_scale_factor=1024.0), loss=xent())
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[dbg.callback()])
    assert step_norms(dbg.frame(), 0) == pytest.approx(want, rel=1e-5)


def test_scaler_takes_the_loss_scale_optimizer_only(mixed_precision):
    model = mlp()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    with graddebug.watch(model, scaler=optimizer):
        pass
    with pytest.raises(ConfigError, match="LossScaleOptimizer"):
        graddebug.watch(model, scaler=keras.optimizers.SGD()).__enter__()
