"""A deep sigmoid stack whose gradients vanish, next to a ReLU/He-initialised one that is
healthy, both trained under ``nnx.jit`` with optax.

Each sigmoid multiplies the cotangent by at most 1/4, so twelve of them leave the first layer a
gradient thousands of times smaller than the last layer's. graddebug flags ``vanishing`` for
the sigmoid stack and nothing for the ReLU net.

Run it with ``python examples/jax/scenario4_vanishing.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import graddebug
import graddebug_jax


class Stack(nnx.Module):
    """``depth`` Linear layers of ``width`` units with ``act`` between them."""

    def __init__(self, depth: int, width: int, act: Callable[[jax.Array], jax.Array],
                 init: Any, rngs: nnx.Rngs) -> None:
        sizes = [8] + [width] * depth + [1]
        self.layers = nnx.List([nnx.Linear(a, b, kernel_init=init, rngs=rngs)
                                for a, b in itertools.pairwise(sizes)])
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x)


def train(model: Stack, steps: int = 5) -> graddebug.Watcher:
    """Train ``model`` for ``steps`` jitted steps under graddebug; return the Watcher."""
    tx = graddebug_jax.monitor(optax.sgd(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 8))
    y = jnp.sin(x[:, :1])

    @nnx.jit
    def train_step(model: Stack, optimizer: nnx.Optimizer) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    with graddebug.watch(model, optimizer=optimizer) as dbg:
        for _ in range(steps):
            dbg.step(loss=train_step(model, optimizer))
    return dbg


def main() -> dict[str, Any]:
    """Train both nets; print their findings."""
    sigmoid = Stack(12, 32, jax.nn.sigmoid, nnx.initializers.lecun_normal(), nnx.Rngs(0))
    relu = Stack(6, 64, jax.nn.relu, nnx.initializers.he_normal(), nnx.Rngs(0))
    results = {"vanishing": train(sigmoid), "healthy": train(relu)}
    for name, dbg in results.items():
        issues = sorted(set(dbg.findings()["issue"])) or ["no finding"]
        print(f"{name}: {', '.join(issues)}")
    return results


if __name__ == "__main__":
    main()
