"""Healthy CNNs with a bias in front of each BatchNorm give no finding, in torch, Keras and Flax.

A convolution's bias followed by a batch normalisation has no effect: the normalisation
subtracts it again, so its gradient is float noise (1e-8 to 1e-7) and its update tiny. That is
the normalisation's doing, not the optimizer's, and no ``stalled`` (or any other finding) may
come of it. Each model trains 300 steps on real data (``load_digits``, no download) with AdamW,
a linear warmup and a cosine decay, as users' CNNs do.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import graddebug

STEPS, WARMUP, BATCH, PEAK = 300, 30, 32, 3e-3
LEARNED = 0.8 * math.log(10)
"""A loss well below chance (ln 10): the run learned, so its quiet is a healthy run's."""

pytestmark = pytest.mark.slow


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 digits, channels last, in [0, 1]; the labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.images[..., None] / 16.0).astype("float32"), data.target


def batches(seed: int) -> np.ndarray:
    """The indices of every step's batch."""
    return np.random.default_rng(seed).integers(0, len(digits()[1]), (STEPS, BATCH))


def described(findings) -> str:
    return findings[["step", "layer", "tensor", "issue", "cause"]].to_string()


def test_torch_conv_bias_before_batchnorm() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    x, y = digits()
    x_t, y_t = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(y)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=True), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, bias=True), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK, weight_decay=1e-2)

    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    with graddebug.watch(model) as dbg:
        for idx in batches(0):
            index = torch.from_numpy(idx)
            loss = nn.functional.cross_entropy(model(x_t[index]), y_t[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            dbg.step(loss=loss)
    assert float(loss) < LEARNED  # it learned: the quiet is that of a healthy run
    frame = dbg.frame()
    bias = frame[(frame["layer"] == "0") & (frame["tensor"] == "bias")]
    assert bias["norm"].max() < 1e-5  # the bias's gradient is float noise
    assert dbg.findings().empty, described(dbg.findings())


def test_keras_conv_bias_before_batchnorm() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow backend in this process")

    x, y = digits()
    keras.utils.set_random_seed(0)
    layers = keras.layers
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(8, 3, padding="same", use_bias=True), layers.BatchNormalization(),
        layers.ReLU(),
        layers.Conv2D(16, 3, padding="same", use_bias=True), layers.BatchNormalization(),
        layers.ReLU(), layers.GlobalAveragePooling2D(), layers.Dense(10)])
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, STEPS - WARMUP, warmup_target=PEAK, warmup_steps=WARMUP)
    model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    idx = batches(0).ravel()
    with graddebug.watch(model) as dbg:
        history = model.fit(x[idx], y[idx], batch_size=BATCH, epochs=1, verbose=0,
                            shuffle=False, callbacks=[dbg.callback()])
    assert history.history["loss"][-1] < LEARNED
    assert dbg.frame()["step"].nunique() == STEPS
    assert dbg.findings().empty, described(dbg.findings())


def test_flax_conv_bias_before_batchnorm() -> None:
    jax = pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    import graddebug_jax

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.c1 = nnx.Conv(1, 8, (3, 3), use_bias=True, rngs=rngs)
            self.n1 = nnx.BatchNorm(8, rngs=rngs)
            self.c2 = nnx.Conv(8, 16, (3, 3), use_bias=True, rngs=rngs)
            self.n2 = nnx.BatchNorm(16, rngs=rngs)
            self.head = nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, inputs: jax.Array) -> jax.Array:
            h = nnx.relu(self.n1(self.c1(inputs)))
            h = nnx.relu(self.n2(self.c2(h)))
            return self.head(h.mean(axis=(1, 2)))

    x, y = digits()
    model = CNN(nnx.Rngs(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, STEPS)
    tx = graddebug_jax.monitor(optax.adamw(schedule, weight_decay=1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, inputs, labels):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(inputs), labels).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with graddebug.watch(model, optimizer=tx) as dbg:
        for idx in batches(0):
            loss = train_step(model, optimizer, x[idx], y[idx])
            dbg.step(loss=loss)
    assert float(loss) < LEARNED
    assert dbg.findings().empty, described(dbg.findings())
