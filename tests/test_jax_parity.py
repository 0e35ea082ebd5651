"""The JAX adapter's rows equal the torch adapter's on the same MLP, weights and batch."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from jax_models import MLP, square_loss  # noqa: E402


def test_parity_with_torch_on_the_same_weights_and_batch():
    jmodel = MLP([12, 16, 16, 16, 5], seed=0)
    tlayers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, layer in enumerate(jmodel.layers):
        kernel = np.asarray(layer.kernel.get_value())
        linear = nn.Linear(*kernel.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
            linear.bias.copy_(torch.from_numpy(np.array(layer.bias.get_value())))
        tlayers[str(i)] = linear
        if i < len(jmodel.layers) - 1:
            tlayers[f"relu{i}"] = nn.ReLU()
    tmodel = nn.Sequential(tlayers)
    x = np.random.default_rng(3).standard_normal((6, 12)).astype(np.float32)

    with graddebug.watch(jmodel) as jdbg:
        jdbg.step(jax.jit(nnx.grad(square_loss))(jmodel, jnp.asarray(x)))
    with graddebug.watch(tmodel, layers=[nn.Linear]) as tdbg:
        tmodel(torch.from_numpy(x)).square().mean().backward()
        tdbg.step()

    jframe = jdbg.frame().replace({"tensor": {"kernel": "weight"}})
    jframe["layer"] = jframe["layer"].str.removeprefix("layers.")
    joined = jframe.merge(tdbg.frame(), on=["layer", "tensor", "kind"],
                          suffixes=("_jax", "_torch"))
    assert len(joined) == len(jframe) == len(tdbg.frame()) == 4 + 8
    np.testing.assert_allclose(joined["norm_jax"], joined["norm_torch"], rtol=1e-5)
    np.testing.assert_allclose(joined["mean_jax"], joined["mean_torch"], rtol=1e-4, atol=1e-8)
    assert (joined["depth_jax"] == joined["depth_torch"]).all()
    acts = joined[joined["kind"] == "activation"]
    assert (acts["shape_jax"] == acts["shape_torch"]).all()
    np.testing.assert_allclose(acts["zero_frac_jax"], acts["zero_frac_torch"])


def test_parity_with_tensorflow_on_the_same_weights_and_batch():
    """With the torch test above and torch's against TF in test_tf_capture.py, the three
    frameworks give the same rows; this one holds JAX to Keras on TF directly."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")

    jmodel = MLP([12, 16, 16, 16, 5], seed=1)
    names = [f"L{i}" for i in range(len(jmodel.layers))]
    stack: list = [keras.Input((12,))]
    for i, name in enumerate(names):
        stack.append(keras.layers.Dense(jmodel.layers[i].kernel.get_value().shape[1],
                                        name=name))
        if i < len(names) - 1:
            stack.append(keras.layers.ReLU(name=f"relu{i}"))
    kmodel = keras.Sequential(stack)
    for i, name in enumerate(names):
        layer = jmodel.layers[i]
        kmodel.get_layer(name).set_weights([np.asarray(layer.kernel.get_value()),
                                            np.asarray(layer.bias.get_value())])
    x = np.random.default_rng(4).standard_normal((6, 12)).astype(np.float32)

    with graddebug.watch(jmodel) as jdbg:
        jdbg.step(jax.jit(nnx.grad(square_loss))(jmodel, jnp.asarray(x)))
    with graddebug.watch(kmodel, layers=names) as kdbg:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(kmodel(tf.constant(x))))
        kdbg.step(tape.gradient(loss, kmodel.trainable_variables))

    jframe = jdbg.frame()
    jframe["layer"] = "L" + jframe["layer"].str.removeprefix("layers.")
    joined = jframe.merge(kdbg.frame(), on=["layer", "tensor", "kind"], suffixes=("_jax", "_tf"))
    assert len(joined) == len(jframe) == len(kdbg.frame()) == 4 + 8
    np.testing.assert_allclose(joined["norm_jax"], joined["norm_tf"], rtol=1e-5)
    np.testing.assert_allclose(joined["mean_jax"], joined["mean_tf"], rtol=1e-4, atol=1e-8)
    acts = joined[joined["kind"] == "activation"]
    assert (acts["shape_jax"] == acts["shape_tf"]).all()
    np.testing.assert_allclose(acts["zero_frac_jax"], acts["zero_frac_tf"])
    # forward order alike (TF counts the unwatched ReLU layers too, so compare the order)
    assert list(acts.sort_values("depth_jax")["layer"]) == list(
        acts.sort_values("depth_tf")["layer"])
