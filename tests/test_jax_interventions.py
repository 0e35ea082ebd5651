"""Interventions on layer outputs and taps against jax.vjp of the explicitly modified graph."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402

import graddebug  # noqa: E402
from graddebug.errors import MaskShapeError  # noqa: E402
from jax_models import MLP, batch, square_loss  # noqa: E402


def modified_grads(model, x, k, change):
    """Parameter gradients when dL/d(layers.k output) is replaced by change(dL/dh)."""
    @jax.custom_vjp
    def edit(h):
        return h

    edit.defvjp(lambda h: (h, None), lambda _, g: (change(g),))

    def loss(model):
        h = x
        for i, layer in enumerate(model.layers):
            h = layer(h)
            if i == k:
                h = edit(h)
            if i < len(model.layers) - 1:
                h = model.act(h)
        return jnp.mean(h ** 2)

    return nnx.grad(loss)(model)


def flat(state):
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize(("spec", "change"), [
    ({"clip_norm": 1e-3}, lambda g: g * jnp.minimum(1.0, 1e-3 / jnp.sqrt(jnp.sum(g * g)))),
    ({"scale": 0.5}, lambda g: g * 0.5),
    ({"clip_value": 1e-3}, lambda g: jnp.clip(g, -1e-3, 1e-3)),
    ({"mask": np.array([[1, 0] * 4], dtype=bool)},
     lambda g: jnp.where(jnp.asarray([[True, False] * 4]), g, 0.0)),
], ids=["clip_norm", "scale", "clip_value", "mask"])
def test_intervention_equals_vjp_of_the_modified_graph(spec, change):
    model, x = MLP([4, 8, 3]), batch()
    want = flat(modified_grads(model, x, 0, change))
    with graddebug.watch(model, intervene={"layers.0": spec}) as dbg:
        grads = jax.jit(nnx.grad(square_loss))(model, x)
        dbg.step(grads)
    got = flat(grads)
    for key, ref in want.items():
        np.testing.assert_allclose(got[key], ref, rtol=1e-6, atol=1e-9)
    row = dbg.frame().query("layer == 'layers.0' and kind == 'activation'").iloc[0]
    h0 = model.layers[0](x)
    _, vjp = jax.vjp(lambda h: jnp.mean(model.layers[1](model.act(h)) ** 2), h0)
    ct = vjp(jnp.float32(1.0))[0]
    np.testing.assert_allclose(row["pre_norm"], float(jnp.linalg.norm(ct)), rtol=1e-5)
    np.testing.assert_allclose(row["norm"], float(jnp.linalg.norm(change(ct))), rtol=1e-5)


def test_tap_clip_norm_records_pre_and_post_norm():
    x = batch(features=3)
    w = jnp.ones((3, 4))
    with graddebug.watch() as dbg:
        def loss(w):
            return jnp.sum(dbg.tap(x @ w, "h", clip_norm=0.5) ** 2)
        g = jax.grad(loss)(w)
        dbg.step()
    raw = 2 * (x @ w)
    clipped = raw * min(1.0, 0.5 / float(jnp.linalg.norm(raw)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(x.T @ clipped), rtol=1e-5)
    row = dbg.frame().iloc[0]
    np.testing.assert_allclose(row["pre_norm"], float(jnp.linalg.norm(raw)), rtol=1e-5)
    np.testing.assert_allclose(row["norm"], 0.5, rtol=1e-5)


def test_a_mask_that_does_not_broadcast_raises_at_the_first_forward():
    model, x = MLP([4, 8, 3]), batch()
    with pytest.raises(MaskShapeError, match=r"layers\.0"), \
            graddebug.watch(model, intervene={"layers.0": {"mask": np.ones((3,), bool)}}):
        nnx.grad(square_loss)(model, x)
