"""Host transfers on TensorFlow's step path: one per recorded step, none on unrecorded steps.

Every way TF moves an eager tensor's values to the host (``.numpy()``, ``np.asarray``,
``float()``, ``bool()``) goes through ``_EagerTensorBase._numpy``, which is counted here while
graddebug closes each step. The user's own reads happen outside the counted span.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from tensorflow.python.framework import ops  # noqa: E402

import graddebug  # noqa: E402


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the host transfers of eager tensors."""
    counts: Counter[str] = Counter()
    original = ops._EagerTensorBase._numpy

    def counted(self: Any) -> Any:
        counts["host"] += 1
        return original(self)

    monkeypatch.setattr(ops._EagerTensorBase, "_numpy", counted)
    yield counts


def _model(cnn: bool) -> Any:
    keras.utils.set_random_seed(0)
    if cnn:
        return keras.Sequential([
            keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, padding="same"),
            keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.Flatten(),
            keras.layers.Dense(4)])
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])


def _run(transfers: Counter[str], loop: str, *, cnn: bool = False, every: int = 1,
         steps: int = 4, **options: Any) -> list[int]:
    """Train ``steps`` steps; return the host transfers of each ``dbg.step`` call."""
    model = _model(cnn)
    x = tf.random.stateless_normal((16, 8, 8, 3) if cnn else (16, 8), seed=(1, 2))
    y = tf.random.stateless_normal((16, 4), seed=(3, 4))
    opt = keras.optimizers.SGD(0.01)
    by_optimizer = loop == "optimizer="
    seen = []
    with graddebug.watch(model, every=every, **options,
                         **({"optimizer": opt} if by_optimizer else {})) as dbg:

        def train(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return grads

        step = train if loop == "eager" else tf.function(train)
        for _ in range(steps):
            grads = step(x, y)
            transfers.clear()
            dbg.step(None if by_optimizer else grads)
            seen.append(transfers["host"])
    assert dbg.frame()["step"].nunique() == len(range(0, steps, every))  # it did record
    return seen


LOOPS = ["eager", "tf.function", "optimizer="]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("cnn", [False, True], ids=["mlp", "cnn"])
def test_one_transfer_per_recorded_step(transfers: Counter[str], loop: str, cnn: bool) -> None:
    assert _run(transfers, loop, cnn=cnn) == [1] * 4


@pytest.mark.parametrize("loop", LOOPS)
def test_no_transfer_on_steps_every_skips(transfers: Counter[str], loop: str) -> None:
    assert _run(transfers, loop, every=2) == [1, 0, 1, 0]


def test_one_transfer_for_parameters_only(transfers: Counter[str]) -> None:
    assert _run(transfers, "tf.function", outputs=False) == [1] * 4


def test_a_second_step_call_reads_once_and_records_nothing(transfers: Counter[str]) -> None:
    model = _model(cnn=False)
    opt = keras.optimizers.SGD(0.01)
    x, y = tf.ones((4, 8)), tf.zeros((4, 4))
    with graddebug.watch(model, optimizer=opt) as dbg:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables, strict=True))
        dbg.step()
        transfers.clear()
        with pytest.warns(graddebug.GradDebugWarning, match="called again"):
            assert dbg.step() is None
        assert transfers["host"] == 1  # the read that found nothing new
    assert dbg.frame()["step"].unique().tolist() == [0]
