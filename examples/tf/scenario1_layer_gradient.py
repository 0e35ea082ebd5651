"""The gradient of a Keras network's output with respect to one hidden layer.

A common debugging question is "what gradient does ``layer_2`` actually receive?". This example
builds a 5-layer Keras MLP of Dense layers ``layer_1`` ... ``layer_5`` with separate
``Activation("tanh")`` layers ``tanh_1`` ... ``tanh_4`` between them. "``layer_2``'s output" is
therefore the affine output ``z_2 = a_1 @ W_2 + b_2`` of the second Dense layer, *before* its
tanh, exactly as in the PyTorch version of this example. (Had the Dense layers been built with
``activation="tanh"``, their output would be the tanh's output instead.)

graddebug keeps the full gradient of ``sum(output)`` at ``layer_2``'s output with
``keep=["layer_2"]``, and the example checks it four ways:

1. against ``tf.gradients(sum(output), z_2)`` inside a ``tf.function``, on a separate forward
   pass without graddebug that runs the layers one by one to get hold of ``z_2``;
2. against ``tape.gradient`` through a multi-output ``keras.Model`` that returns ``z_2`` next
   to the network's output;
3. against the chain rule written out by hand in numpy: starting from d(sum)/d(output) = 1, the
   gradient is pulled back through ``layer_5``, ``tanh_4``, ``layer_4``, ``tanh_3``,
   ``layer_3`` and ``tanh_2`` as a product of transposed Jacobians (``g @ W.T`` for a Dense
   kernel ``W``, ``g * (1 - a**2)`` for ``a = tanh(z)``);
4. by confirming that watching leaves the parameter gradients bitwise unchanged.

Run it with ``python examples/tf/scenario1_layer_gradient.py``.
"""

from __future__ import annotations

import os

# Before TensorFlow is imported: no C++ log lines, and no oneDNN rounding differences.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from typing import Any

import keras
import numpy as np
import tensorflow as tf

import graddebug

SEED = 0
BATCH = 8
SIZES = (6, 16, 12, 10, 8, 3)


def build_model(sizes: tuple[int, ...] = SIZES) -> keras.Sequential:
    """Return ``layer_1`` ... ``layer_5`` (Dense) with ``tanh_1`` ... ``tanh_4`` between them.

    Args:
        sizes: The input width followed by the output width of each Dense layer.

    Returns:
        The model; its output is ``layer_5``'s raw (affine) output.
    """
    layers: list[keras.layers.Layer] = [keras.Input((sizes[0],))]
    for i, width in enumerate(sizes[1:], start=1):
        layers.append(keras.layers.Dense(width, name=f"layer_{i}"))
        if i < len(sizes) - 1:
            layers.append(keras.layers.Activation("tanh", name=f"tanh_{i}"))
    return keras.Sequential(layers, name="five_layer_mlp")


def build(seed: int = SEED) -> tuple[keras.Sequential, tf.Tensor]:
    """Return the model and a batch of inputs, both seeded."""
    keras.utils.set_random_seed(seed)
    model = build_model()
    x = tf.constant(np.random.default_rng(seed).standard_normal((BATCH, SIZES[0])), tf.float32)
    return model, x


def tf_gradients_reference(model: keras.Sequential, x: tf.Tensor) -> np.ndarray:
    """Compute d(sum(output))/d(``layer_2`` output) with ``tf.gradients`` in a ``tf.function``.

    ``tf.gradients`` exists only in graph mode, where any tensor of the graph can be
    differentiated against; the layers are called one by one so that ``z_2`` has a name.

    Args:
        model: The MLP of :func:`build_model`.
        x: Its input batch.

    Returns:
        The gradient, with the shape of ``layer_2``'s output.
    """

    @tf.function
    def grad(x: tf.Tensor) -> tf.Tensor:
        h, z2 = x, None
        for layer in model.layers:
            h = layer(h)
            if layer.name == "layer_2":
                z2 = h
        (g,) = tf.gradients(tf.reduce_sum(h), z2)
        return g

    return grad(x).numpy()


def multi_output_reference(model: keras.Sequential, x: tf.Tensor) -> np.ndarray:
    """Compute the same gradient eagerly, with ``tape.gradient`` through a probe model.

    The probe is a functional ``keras.Model`` that shares the MLP's layers and returns
    ``layer_2``'s output next to the final output, so the tape sees both.

    Args:
        model: The MLP of :func:`build_model`.
        x: Its input batch.

    Returns:
        The gradient, with the shape of ``layer_2``'s output.
    """
    probe = keras.Model(model.inputs, [model.get_layer("layer_2").output, *model.outputs])
    with tf.GradientTape() as tape:
        z2, out = probe(x)
        total = tf.reduce_sum(out)
    return tape.gradient(total, z2).numpy()


def chain_rule_reference(model: keras.Sequential, x: tf.Tensor) -> np.ndarray:
    """Pull d(sum(output))/d(output) back to ``layer_2``'s output by hand, in numpy.

    For ``z = a @ W + b`` (a Dense kernel ``W`` of shape ``(in, out)``) the transposed Jacobian
    maps ``g`` to ``g @ W.T``; for ``a = tanh(z)`` it maps ``g`` to ``g * (1 - a**2)``. The
    arithmetic runs in float64, so it agrees with the float32 model to float32 rounding.

    Args:
        model: The MLP of :func:`build_model`.
        x: Its input batch.

    Returns:
        The gradient at ``layer_2``'s output (before ``tanh_2``).
    """
    weights = []
    for i in range(1, 6):
        kernel, bias = model.get_layer(f"layer_{i}").get_weights()
        weights.append((kernel.astype(np.float64), bias.astype(np.float64)))
    activations = []  # tanh outputs a_1 .. a_4
    a = x.numpy().astype(np.float64)
    for w, b in weights[:4]:
        a = np.tanh(a @ w + b)
        activations.append(a)
    out = activations[-1] @ weights[4][0] + weights[4][1]
    g = np.ones_like(out)  # d(sum(out)) / d(out)
    g = g @ weights[4][0].T  # through layer_5
    for index in (3, 2):  # through tanh_4, layer_4, then tanh_3, layer_3
        g = g * (1.0 - activations[index] ** 2)
        g = g @ weights[index][0].T
    return g * (1.0 - activations[1] ** 2)  # through tanh_2: now at layer_2's output


def parameter_grads(model: keras.Model, x: tf.Tensor) -> list[tf.Tensor]:
    """Return d(sum(output))/dv for every ``v`` in ``model.trainable_variables``.

    Raises:
        RuntimeError: A variable received no gradient.
    """
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(model(x))
    grads = tape.gradient(total, model.trainable_variables)
    for var, grad in zip(model.trainable_variables, grads, strict=True):
        if grad is None:
            raise RuntimeError(f"variable {var.path!r} received no gradient")
    return grads


def main() -> dict[str, Any]:
    """Capture the gradient at ``layer_2`` with graddebug and compare it with the references.

    Returns:
        ``kept``: the gradient graddebug kept; ``tf_gradients``: the ``tf.gradients``
        reference; ``multi_output``: the ``tape.gradient`` reference; ``chain_rule``: the
        hand-written numpy reference; ``max_abs_diff``: the largest difference between
        ``kept`` and ``tf_gradients``; ``weight_grads_equal``: whether the parameter gradients
        with and without graddebug are bitwise identical; ``frame``: the record frame.
    """
    model, x = build()
    # References first: graddebug is not attached yet, so none of them goes through it.
    reference = tf_gradients_reference(model, x)
    multi = multi_output_reference(model, x)
    chain = chain_rule_reference(model, x)
    plain_grads = parameter_grads(model, x)

    with graddebug.watch(model, keep=["layer_2"]) as dbg:
        watched_grads = parameter_grads(model, x)
        dbg.step(watched_grads)
    kept = dbg.tensors(0)["layer_2"]
    same = all(
        np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(plain_grads, watched_grads, strict=True)
    )
    diff = float(np.abs(kept - reference).max())

    frame = dbg.frame()
    print("Gradient of sum(output) with respect to layer_2's output, first two rows:")
    print(np.array2string(kept[:2], precision=5, suppress_small=True))
    print(f"graddebug keep=['layer_2'] vs tf.gradients in a tf.function: max |diff| = {diff:.2e}")
    multi_diff = float(np.abs(kept - multi).max())
    print(f"tape.gradient through a multi-output model: max |diff| = {multi_diff:.2e}")
    chain_diff = float(np.abs(kept - chain).max())
    print(f"hand-written chain rule through layer_3..layer_5: max |diff| = {chain_diff:.2e}")
    print(f"parameter gradients bitwise unchanged by watching: {same}")
    activations = frame.loc[frame["kind"] == "activation", ["layer", "shape", "norm", "absmax"]]
    print(activations.to_string(index=False))
    return {
        "kept": kept,
        "tf_gradients": reference,
        "multi_output": multi,
        "chain_rule": chain,
        "max_abs_diff": diff,
        "weight_grads_equal": same,
        "frame": frame,
    }


if __name__ == "__main__":
    main()
