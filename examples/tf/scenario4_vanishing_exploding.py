"""Vanishing and exploding gradients in Keras, and two healthy networks that show neither.

Training that "does nothing" or that blows up to NaN after a few steps usually comes down to
how the gradient's size changes from the loss back to the input:

* A deep MLP with sigmoid activations and Keras' default initialisation (Glorot uniform)
  shrinks the gradient at every layer (the sigmoid's slope is at most 1/4), so its first layers
  get a gradient millions of times smaller than its last layer and barely learn: the gradient
  *vanishes*.
* The same depth with weights that are too large grows the gradient at every layer instead.
  Here a ReLU MLP whose Glorot-uniform weights are 3 times too large, and a deep linear network
  with the same large weights: the gradient *explodes* towards the input.
* A ReLU MLP with He initialisation, and a small residual CNN with batch normalisation, keep the
  gradient's size roughly constant with depth. graddebug must report nothing for them.

Each network trains for a few SGD steps on random data in a ``GradientTape`` loop under
``graddebug.watch``. (A ``tf.function`` train step records the same way, but tracing it costs
more than these five eager steps.) The findings name the layers at fault. Layers have readable
names (``layer_1`` ... ``layer_12``, activations ``act_1`` ... ``act_11``), so the findings can
be read without counting layers.

Run it with ``python examples/tf/scenario4_vanishing_exploding.py``.
"""

from __future__ import annotations

import os

# Before TensorFlow is imported: no C++ log lines, and no oneDNN rounding differences.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

import graddebug

SEED = 0
STEPS = 5
DEPTH = 12
WIDTH = 64
INPUTS = 32
CLASSES = 10
BATCH = 64
LARGE_WEIGHT_SCALE = 3.0

ModelBuilder = Callable[[], keras.Model]


def build_mlp(
    activation: str | None, initializer: Any = "glorot_uniform", depth: int = DEPTH
) -> keras.Sequential:
    """Return ``layer_1`` ... ``layer_<depth>`` Dense layers with an activation between each.

    Args:
        activation: The Keras activation placed after every layer but the last, as a separate
            ``Activation`` layer; None for a deep linear network.
        initializer: The kernel initializer of every Dense layer (biases start at zero).
        depth: Number of Dense layers.

    Returns:
        The network; activations are named ``act_1`` ... ``act_<depth - 1>``.
    """
    layers: list[keras.layers.Layer] = [keras.Input((INPUTS,))]
    for i in range(1, depth + 1):
        units = CLASSES if i == depth else WIDTH
        layers.append(keras.layers.Dense(units, kernel_initializer=initializer, name=f"layer_{i}"))
        if i < depth and activation is not None:
            layers.append(keras.layers.Activation(activation, name=f"act_{i}"))
    return keras.Sequential(layers, name="mlp")


def large_weights() -> keras.initializers.Initializer:
    """Keras' default Glorot uniform with :data:`LARGE_WEIGHT_SCALE` times the spread: too large.

    Variance scales with the square of the spread, hence ``scale=LARGE_WEIGHT_SCALE**2``.
    """
    return keras.initializers.VarianceScaling(
        scale=LARGE_WEIGHT_SCALE**2, mode="fan_avg", distribution="uniform"
    )


def residual_block(x: Any, channels: int, name: str) -> Any:
    """``relu(x + bn2(conv2(relu(bn1(conv1(x))))))`` with 3x3 convolutions."""
    y = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False, name=f"{name}_conv1")(x)
    y = keras.layers.BatchNormalization(name=f"{name}_bn1")(y)
    y = keras.layers.ReLU(name=f"{name}_relu")(y)
    y = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = keras.layers.BatchNormalization(name=f"{name}_bn2")(y)
    return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([x, y]))


def small_resnet(channels: int = 8, blocks: int = 3) -> keras.Model:
    """A stem convolution, residual blocks, global average pooling and a classifier.

    Args:
        channels: Channels of every convolution.
        blocks: Number of residual blocks.

    Returns:
        A functional model for 8x8 RGB images (channels last).
    """
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(channels, 3, padding="same", activation="relu", name="stem")(inputs)
    for b in range(1, blocks + 1):
        x = residual_block(x, channels, f"block{b}")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(CLASSES, name="classifier")(x)
    return keras.Model(inputs, outputs, name="small_resnet")


MODELS: dict[str, tuple[ModelBuilder, tuple[int, ...], float]] = {
    # name: (builder, input shape, SGD learning rate). The large-weight networks get a tiny
    # learning rate: with 0.01 their gradients are non-finite by the third step, and the example
    # is about the explosion itself, not the non-finite values it leads to.
    "sigmoid_default_init": (lambda: build_mlp("sigmoid"), (BATCH, INPUTS), 0.1),
    "relu_large_weights": (lambda: build_mlp("relu", large_weights()), (BATCH, INPUTS), 1e-6),
    "linear_large_weights": (lambda: build_mlp(None, large_weights()), (BATCH, INPUTS), 1e-6),
    "relu_he_init": (lambda: build_mlp("relu", "he_normal"), (BATCH, INPUTS), 0.01),
    "small_resnet": (small_resnet, (16, 8, 8, 3), 0.01),
}
"""Every network of the example, by name."""


def batches(shape: tuple[int, ...], steps: int = STEPS) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """Seeded random inputs and class labels, one pair per step."""
    rng = np.random.default_rng(SEED + 1)
    return [
        (
            tf.constant(rng.standard_normal(shape), tf.float32),
            tf.constant(rng.integers(0, CLASSES, shape[0]), tf.int64),
        )
        for _ in range(steps)
    ]


def build(name: str) -> keras.Model:
    """Build the network ``name`` of :data:`MODELS` from the example's seed."""
    keras.utils.set_random_seed(SEED)
    return MODELS[name][0]()


def cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Mean softmax cross-entropy of ``logits`` against integer ``labels``."""
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    )


def train(name: str, steps: int = STEPS) -> graddebug.Watcher:
    """Train the network ``name`` for ``steps`` SGD steps under ``graddebug.watch``.

    Returns:
        The Watcher, after its ``with`` block.
    """
    _, shape, lr = MODELS[name]
    model = build(name)
    optimizer = keras.optimizers.SGD(lr)
    variables = model.trainable_variables

    with graddebug.watch(model) as dbg:
        for x, y in batches(shape, steps):
            with tf.GradientTape() as tape:
                loss = cross_entropy(model(x, training=True), y)
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables, strict=True))
            dbg.step(grads)
    return dbg


def main() -> dict[str, Any]:
    """Train every network of :data:`MODELS` and print what graddebug finds.

    Returns:
        ``findings``: the findings frame of each network, by name; ``frames``: the record
        frame of each network, by name.
    """
    findings: dict[str, pd.DataFrame] = {}
    frames: dict[str, pd.DataFrame] = {}
    for name in MODELS:
        dbg = train(name)
        findings[name], frames[name] = dbg.findings(), dbg.frame()
    for name, found in findings.items():
        counts = found["issue"].value_counts().to_dict() if len(found) else {}
        print(f"--- {name}: {counts or 'no findings'}")
        for issue, rows in found.groupby("issue", sort=False):
            layers = ", ".join(dict.fromkeys(rows["layer"]))
            print(f"  {issue} at: {layers}")
            print(f"  e.g. {rows['message'].iloc[0]}")
    return {"findings": findings, "frames": frames}


if __name__ == "__main__":
    main()
