"""The conformance suite's model, batch and independent references.

Every mode builds the same three-layer MLP from the same float32 weights::

    l1 = tanh(x @ W1 + b1)    l2 = tanh(l1 @ W2 + b2)    l3 = l2 @ W3 + b3
    loss = mean((l3 - y) ** 2)

Each framework's own autodiff gives the reference gradients of the parameters (``"l1.w"``,
``"l1.b"``, ...) and of the layer outputs (``"l1"``, ``"l2"``, ``"l3"``): ``torch.autograd``,
``tf.GradientTape``, ``tf.compat.v1.gradients``, ``jax.grad``, each imported only by the
function that uses it. The interventions are applied by hand here, in numpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

LAYERS = ("l1", "l2", "l3")
SIZES = (4, 4, 4, 2)  # every tensor at most 32 entries: every adapter reads it whole
ACTS = ("tanh", "tanh", None)
BATCH = 6
LR = 0.5

Weights = dict[str, tuple[np.ndarray, np.ndarray]]
Grads = dict[str, np.ndarray]


WIDE = (64, 256, 256, 8)  # the optimizer's view: large enough that every adapter samples


def initial_weights(wide: bool = False) -> Weights:
    """The MLP's weights, from a fixed seed: ``{"l1": (W1, b1), ...}``, float32; of the
    :data:`WIDE` sizes where ``wide``."""
    rng = np.random.RandomState(7)
    sizes = WIDE if wide else SIZES
    return {name: ((rng.randn(a, b) * 0.8 / np.sqrt(a / SIZES[0])).astype("float32"),
                   (rng.randn(b) * 0.3).astype("float32"))
            for name, (a, b) in zip(LAYERS, itertools.pairwise(sizes), strict=True)}


def batch(wide: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The one batch every step trains on: ``x`` (6, 4) and ``y`` (6, 2), float32 (6, 64)
    and (6, 8) where ``wide``."""
    rng = np.random.RandomState(11)
    sizes = WIDE if wide else SIZES
    return (rng.randn(BATCH, sizes[0]).astype("float32"),
            rng.randn(BATCH, sizes[-1]).astype("float32"))


def numpy_loss(weights: Weights, x: np.ndarray, y: np.ndarray) -> float:
    """The loss at ``weights``, in float64."""
    h = x.astype(np.float64)
    for name, act in zip(LAYERS, ACTS, strict=True):
        w, b = weights[name]
        h = h @ w.astype(np.float64) + b.astype(np.float64)
        h = np.tanh(h) if act == "tanh" else h
    return float(np.mean((h - y) ** 2))


def _pairs(items: list[Any]) -> list[tuple[Any, Any]]:
    return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]


def _named(params: list[Any], outs: list[Any], to_numpy: Callable[[Any], np.ndarray]) -> Grads:
    grads: Grads = {}
    for name, (gw, gb), go in zip(LAYERS, _pairs(params), outs, strict=True):
        grads[f"{name}.w"], grads[f"{name}.b"] = to_numpy(gw), to_numpy(gb)
        grads[name] = to_numpy(go)
    return grads


def torch_grads(weights: Weights, x: np.ndarray, y: np.ndarray) -> Grads:
    """``torch.autograd.grad`` of the loss for every parameter and layer output."""
    import torch

    params = [torch.tensor(a, requires_grad=True) for name in LAYERS for a in weights[name]]
    h, outs = torch.tensor(x), []
    for (w, b), act in zip(_pairs(params), ACTS, strict=True):
        h = h @ w + b
        h = torch.tanh(h) if act == "tanh" else h
        outs.append(h)
    loss = torch.mean((h - torch.tensor(y)) ** 2)
    got = torch.autograd.grad(loss, params + outs)
    return _named(list(got[:6]), list(got[6:]), lambda t: t.detach().numpy())


def tf_grads(weights: Weights, x: np.ndarray, y: np.ndarray) -> Grads:
    """``tf.GradientTape.gradient`` of the loss for every parameter and layer output."""
    import tensorflow as tf

    params = [tf.Variable(a) for name in LAYERS for a in weights[name]]
    with tf.GradientTape() as tape:
        h, outs = tf.constant(x), []
        for (w, b), act in zip(_pairs(params), ACTS, strict=True):
            h = h @ w + b
            h = tf.tanh(h) if act == "tanh" else h
            outs.append(h)
        loss = tf.reduce_mean((h - y) ** 2)
    got = tape.gradient(loss, params + outs)
    return _named(got[:6], got[6:], lambda t: t.numpy())


def tf1_grads(weights: Weights, x: np.ndarray, y: np.ndarray) -> Grads:
    """``tf.compat.v1.gradients`` of the loss, run in a session of its own graph."""
    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        params = [v1.Variable(a) for name in LAYERS for a in weights[name]]
        h, outs = tf.constant(x), []
        for (w, b), act in zip(_pairs(params), ACTS, strict=True):
            h = tf.matmul(h, w) + b
            h = tf.tanh(h) if act == "tanh" else h
            outs.append(h)
        loss = tf.reduce_mean(tf.square(h - y))
        grads = v1.gradients(loss, params + outs)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            got = sess.run(grads)
    return _named(got[:6], got[6:], np.asarray)


def jax_grads(weights: Weights, x: np.ndarray, y: np.ndarray) -> Grads:
    """``jax.grad`` of the loss, with a zero added to each layer output for its gradient."""
    import jax
    import jax.numpy as jnp

    def loss(params: list[Any], eps: list[Any]) -> Any:
        h = jnp.asarray(x)
        for (w, b), act, e in zip(_pairs(params), ACTS, eps, strict=True):
            h = h @ w + b
            h = (jnp.tanh(h) if act == "tanh" else h) + e
        return jnp.mean((h - y) ** 2)

    params = [jnp.asarray(a) for name in LAYERS for a in weights[name]]
    eps = [jnp.zeros((BATCH, n), jnp.float32) for n in SIZES[1:]]
    gp, ge = jax.grad(loss, argnums=(0, 1))(params, eps)
    return _named(list(gp), list(ge), np.asarray)


# -- interventions, by hand -----------------------------------------------------------------

MASK = np.array([[True, False] * (SIZES[1] // 2)])

INTERVENTIONS: dict[str, tuple[dict[str, Any], Callable[[np.ndarray], np.ndarray]]] = {
    "clip_norm": ({"clip_norm": 1e-3},
                  lambda g: g * min(1.0, 1e-3 / float(np.linalg.norm(g)))),
    "clip_value": ({"clip_value": 1e-3}, lambda g: np.clip(g, -1e-3, 1e-3)),
    "mask": ({"mask": MASK}, lambda g: np.where(MASK, g, 0.0)),
    "scale": ({"scale": 0.5}, lambda g: g * 0.5),
}
"""Each intervention on ``l1``'s output: the options of ``intervene=`` and the same change by
hand. All of them act on this model's gradient (none is a no-op)."""


def first_layer_grads(weights: Weights, x: np.ndarray, g_out: np.ndarray) -> Grads:
    """``l1``'s parameter gradients for the gradient ``g_out`` at its output: the chain rule
    through ``tanh(x @ W1 + b1)``, by hand in float64."""
    w, b = (a.astype(np.float64) for a in weights["l1"])
    h = np.tanh(x.astype(np.float64) @ w + b)
    g_pre = g_out.astype(np.float64) * (1.0 - h * h)
    return {"l1.w": x.astype(np.float64).T @ g_pre, "l1.b": g_pre.sum(axis=0)}
