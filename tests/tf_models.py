"""Small Keras models shared by the TensorFlow tests."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


def relu_mlp(depth: int = 6, width: int = 64, inputs: int = 32, classes: int = 10,
             seed: int = 0) -> keras.Sequential:
    """A He-initialised ReLU MLP with separate activation layers (fc1, act1, ..., fcN)."""
    layers: list[keras.layers.Layer] = [keras.Input((inputs,))]
    for i in range(1, depth):
        layers += [
            keras.layers.Dense(width, kernel_initializer=keras.initializers.HeNormal(seed + i),
                               name=f"fc{i}"),
            keras.layers.ReLU(name=f"act{i}"),
        ]
    layers.append(keras.layers.Dense(
        classes, kernel_initializer=keras.initializers.HeNormal(seed), name=f"fc{depth}"))
    return keras.Sequential(layers, name="relu_mlp")


def sigmoid_mlp(depth: int = 12, width: int = 32, seed: int = 0) -> keras.Sequential:
    """A default-initialised sigmoid MLP: its early gradients vanish."""
    layers: list[keras.layers.Layer] = [keras.Input((width,))]
    for i in range(depth):
        layers.append(keras.layers.Dense(
            width, activation="sigmoid",
            kernel_initializer=keras.initializers.GlorotUniform(seed + i), name=f"fc{i}"))
    layers.append(keras.layers.Dense(10, name="head"))
    return keras.Sequential(layers, name="sigmoid_mlp")


def res_cnn(channels: int = 8, classes: int = 10, seed: int = 0) -> keras.Model:
    """A small functional residual CNN with BatchNorm for 16x16x3 inputs."""
    init = keras.initializers.HeNormal(seed)
    x = inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(channels, 3, padding="same", kernel_initializer=init,
                            name="stem")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU(name="act")(x)
    for b in (1, 2):
        y = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False,
                                kernel_initializer=init, name=f"b{b}_conv1")(x)
        y = keras.layers.BatchNormalization(name=f"b{b}_bn1")(y)
        y = keras.layers.ReLU(name=f"b{b}_relu")(y)
        y = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False,
                                kernel_initializer=init, name=f"b{b}_conv2")(y)
        y = keras.layers.BatchNormalization(name=f"b{b}_bn2")(y)
        x = keras.layers.ReLU(name=f"b{b}_out")(keras.layers.Add(name=f"b{b}_add")([x, y]))
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    out = keras.layers.Dense(classes, kernel_initializer=init, name="head")(x)
    return keras.Model(inputs, out, name="res_cnn")


class TwoTower(keras.Model):
    """A subclassed model with a layer called twice per forward pass."""

    def __init__(self) -> None:
        super().__init__(name="two_tower")
        self.embed = keras.layers.Dense(16, activation="tanh", name="embed")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        return self.head(self.embed(inputs) + self.embed(inputs * 2.0))


def batches(n: int, shape: tuple[int, ...], classes: int = 10, seed: int = 0):
    """``n`` seeded random (x, y) batches as tf tensors."""
    rng = np.random.default_rng(seed)
    return [
        (tf.constant(rng.standard_normal(shape), tf.float32),
         tf.constant(rng.integers(0, classes, shape[0]), tf.int64))
        for _ in range(n)
    ]


def xent(logits: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """Mean sparse cross-entropy of logits."""
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def train(model: keras.Model, data, dbg=None, lr: float = 0.05, compiled: bool = False) -> None:
    """Plain SGD with a GradientTape, eager or in a tf.function; ``dbg.step(grads)`` after
    each step when given."""
    opt = keras.optimizers.SGD(lr)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = xent(model(x, training=True), y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return grads

    if compiled:
        step = tf.function(step)
    for x, y in data:
        grads = step(x, y)
        if dbg is not None:
            dbg.step(grads)
