"""Tiered statistics in the TensorFlow adapter: sentinel steps measure the norm and the mean of
layer-output gradients, full steps their extremes too, in eager loops, compiled steps and
``fit``. References: ``tape.gradient`` on the same intermediate tensors."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402

STEPS = 12


def mlp() -> keras.Sequential:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh",
                                                                    name="d0"),
                             keras.layers.Dense(32, activation="tanh", name="d1"),
                             keras.layers.Dense(4, name="d2")])


def data(steps: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((8, 16)).astype(np.float32),
             rng.integers(0, 4, 8)) for _ in range(steps)]


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference(model: keras.Sequential, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The gradient at every layer's output, by ``tape.gradient``."""
    with tf.GradientTape() as tape:
        outputs, h = [], tf.constant(x)
        for layer in model.layers:
            h = layer(h)
            outputs.append(h)
        loss = LOSS(y, h)
    grads = tape.gradient(loss, outputs)
    return {layer.name: g.numpy().astype(np.float64) for layer, g in zip(model.layers, grads,
                                                                         strict=True)}


def activations(dbg: graddebug.Watcher) -> pd.DataFrame:
    frame = dbg.frame()
    return frame[frame["kind"] == "activation"]


def full_steps(rows: pd.DataFrame) -> list[int]:
    return sorted(set(rows.loc[rows["absmax"].notna(), "step"]))


def test_eager_steps_measure_norm_and_mean_and_extremes_on_full_steps() -> None:
    model, batches = mlp(), data()
    with graddebug.watch(model) as dbg:  # no optimizer: the weights stay as they are
        for x, y in batches:
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x))
            dbg.step(tape.gradient(loss, model.trainable_variables))
    rows = activations(dbg)
    assert full_steps(rows) == [0, 10]
    for step, (x, y) in enumerate(batches):
        expected = reference(model, x, y)
        for _, row in rows[rows["step"] == step].iterrows():
            g = expected[row["layer"]]
            assert row["norm"] == pytest.approx(np.linalg.norm(g), rel=1e-5)
            # The logits' gradient (softmax minus one-hot) sums to zero in every row, so its
            # mean is float32 rounding alone, whose size follows the entries' (and the CPU's
            # summation order), not a fixed absolute bound.
            assert row["mean"] == pytest.approx(g.mean(), rel=1e-4, abs=1e-6 * np.abs(g).max())
            assert not row["nan"] and not row["inf"]
            if step in (0, 10):
                assert row["absmax"] == pytest.approx(np.abs(g).max(), rel=1e-6)
                assert row["zero_frac"] == pytest.approx((np.abs(g).max(0) == 0).mean())
            else:
                assert math.isnan(row["absmax"]) and math.isnan(row["zero_frac"])


def test_compiled_steps_and_fit_follow_the_same_tiers() -> None:
    model, batches = mlp(), data()
    opt = keras.optimizers.SGD(1e-3)
    with graddebug.watch(model, optimizer=opt) as dbg:

        @tf.function
        def train(x: tf.Tensor, y: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        for x, y in batches:
            train(x, y)
            dbg.step()
    assert full_steps(activations(dbg)) == [0, 10]

    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=LOSS)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    assert full_steps(activations(dbg)) == [0, 10]
    with graddebug.watch(model, full_stats_every=1) as dbg:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    assert full_steps(activations(dbg)) == list(range(STEPS))


def test_a_nan_on_a_sentinel_step_is_flagged_and_makes_the_next_step_full() -> None:
    model, batches = mlp(), data(6)
    model(batches[0][0])
    with graddebug.watch(model) as dbg:
        for step, (x, y) in enumerate(batches):
            with tf.GradientTape() as tape:
                out = model(x)
                if step == 3:
                    out = out * tf.constant(math.nan)
                loss = LOSS(y, out)
            dbg.step(tape.gradient(loss, model.trainable_variables))
    rows = activations(dbg)
    assert full_steps(rows) == [0, 4]
    assert rows.loc[rows["step"] == 3, "nan"].all()  # NaN reached every layer's output
    assert not rows.loc[rows["step"] != 3, "nan"].any()


@pytest.mark.parametrize("every", [1, 3])
def test_a_watcher_entered_again_goes_on_with_the_same_tiers(every: int) -> None:
    """The graph reads the next step's tier (and, with ``every=``, whether it is recorded) from
    variables made when the Watcher is entered: entered again at step 5, it goes on from there."""
    batches = data()
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=LOSS)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    dbg = graddebug.Watcher(model, every=every)
    for part in (slice(0, 40), slice(40, None)):  # steps 0-4, then 5-11
        with dbg:
            model.fit(x[part], y[part], batch_size=8, shuffle=False, verbose=0,
                      callbacks=[dbg.callback()])
    rows = activations(dbg)
    recorded = list(range(0, STEPS, every))
    assert sorted(set(rows["step"])) == recorded
    assert full_steps(rows) == ([0, 10] if every == 1 else recorded)
