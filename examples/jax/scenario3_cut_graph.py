"""``jax.lax.stop_gradient`` inside a module silently cuts the graph; graddebug names the cut.

The model is ``encoder -> Detach -> head``, where ``Detach`` returns ``stop_gradient`` of its
input (a leftover from a frozen-feature experiment, say). Training still runs, the loss still
falls a little (the head learns), and the encoder never changes. ``graddebug.watch(model)``
finds that the cotangent reaching ``encoder``'s output is structurally zero while the one at
``detach``'s output is not, and says where the gradient stops.

Run it with ``python examples/jax/scenario3_cut_graph.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import graddebug
import graddebug_jax


class Detach(nnx.Module):
    """Returns its input with the gradient stopped."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(x)


class Model(nnx.Module):
    """``encoder -> Detach -> head``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.encoder = nnx.Linear(8, 16, rngs=rngs)
        self.detach = Detach()
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.detach(jax.nn.relu(self.encoder(x))))


def main() -> dict[str, Any]:
    """Train three jitted steps under graddebug and print the findings."""
    model = Model(nnx.Rngs(0))
    tx = graddebug_jax.monitor(optax.sgd(0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 8))
    y = jnp.sum(x, axis=1, keepdims=True)

    @nnx.jit
    def train_step(model: Model, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array
                   ) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    with graddebug.watch(model, optimizer=optimizer) as dbg:
        for _ in range(3):
            dbg.step(loss=train_step(model, optimizer, x, y))
    findings = dbg.findings()
    for message in findings.query("issue == 'cut_graph'")["message"]:
        print(message)
    return {"frame": dbg.frame(), "findings": findings, "model": model}


if __name__ == "__main__":
    main()
