"""Small Flax NNX models and batches shared by the JAX adapter's tests."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    """``depth`` Linear layers with ``act`` between them (none after the last)."""

    def __init__(self, sizes: list[int], *, seed: int = 0, act: Any = jax.nn.relu) -> None:
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                for a, b in itertools.pairwise(sizes)])
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.act(x)
        return x


class Cut(nnx.Module):
    """A layer whose output is ``stop_gradient`` of its input: the graph is cut inside it."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(x)


class CutNet(nnx.Module):
    """Linear -> Cut -> Linear: the first layer gets no gradient."""

    def __init__(self, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.first = nnx.Linear(4, 8, rngs=rngs)
        self.cut = Cut()
        self.last = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.last(self.cut(self.first(x)))


def batch(n: int = 6, features: int = 4, seed: int = 3) -> jax.Array:
    """A float32 batch of standard normals."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, features)),
                       jnp.float32)


def square_loss(model: Any, x: jax.Array) -> jax.Array:
    """``mean(model(x) ** 2)``."""
    return jnp.mean(model(x) ** 2)


def linear_outputs(model: MLP, x: jax.Array) -> list[jax.Array]:
    """The output of every Linear of ``model`` in a fresh forward pass, without graddebug."""
    outs = []
    for i, layer in enumerate(model.layers):
        x = layer(x)
        outs.append(x)
        if i < len(model.layers) - 1:
            x = model.act(x)
    return outs


def train_step(traces: list[int] | None = None) -> Any:
    """An ``nnx.jit`` step ``(model, optimizer, x) -> loss`` that trains on
    :func:`square_loss`; each trace appends to ``traces`` where given."""

    @nnx.jit
    def step(model: Any, optimizer: Any, x: jax.Array) -> jax.Array:
        if traces is not None:
            traces.append(1)
        loss, grads = nnx.value_and_grad(square_loss)(model, x)
        optimizer.update(model, grads)
        return loss

    return step
