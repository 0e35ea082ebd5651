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
