"""Splitting the chain rule at an intermediate array, and editing the cotangent there, in JAX.

Take ``h = x @ W + b``, ``y = tanh(h)`` and ``loss = mean((y - y0)**2)``. Multiplying
``dL/dh`` elementwise by "the gradient of h with respect to W" is not the chain rule for a
matrix product: that gradient is the one of ``sum(h)``, which has thrown the needed structure
away. The chain rule is a vector-Jacobian product: ``jax.vjp(lambda W: x @ W + b, W)`` gives a
function that maps ``dL/dh`` to ``dL/dW``, which for a matmul is ``x.T @ dL/dh``.

The split point is where one may clip or mask the cotangent before it flows on into ``W``:
``dbg.tap(x @ W + b, "h", clip_norm=c)`` does that in flight, under ``jax.grad`` and
``jax.jit``, and records the norm before and after. Seed values:

    W = [[1, 2], [3, 4]]    b = [0.5, 0.5]    x = [[0.1, 0.2], [0.3, 0.4]]
    y0 = [[0.8, 0.9], [0.7, 0.6]]

Run it with ``python examples/jax/scenario2_split_chain_rule.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import graddebug

W0 = [[1.0, 2.0], [3.0, 4.0]]
B0 = [0.5, 0.5]
X0 = [[0.1, 0.2], [0.3, 0.4]]
Y0 = [[0.8, 0.9], [0.7, 0.6]]

CLIP_NORM = 0.005
"""Below the norm of dL/dh for the seed values (about 0.011), so clipping acts."""


def loss_of(h: jax.Array, y0: jax.Array) -> jax.Array:
    """The loss of the example: ``mean((tanh(h) - y0)**2)``."""
    return jnp.mean((jnp.tanh(h) - y0) ** 2)


def split_chain_rule() -> dict[str, np.ndarray]:
    """dL/dW directly (``jax.grad``), by a VJP of ``h(W)`` with ``dL/dh``, as ``x.T @ dL/dh``,
    and by the elementwise mistake; and ``dL/dh`` itself."""
    w, b, x, y0 = (jnp.asarray(v, jnp.float32) for v in (W0, B0, X0, Y0))
    direct = jax.grad(lambda w: loss_of(x @ w + b, y0))(w)
    h, h_vjp = jax.vjp(lambda w: x @ w + b, w)
    dl_dh = jax.grad(loss_of)(h, y0)
    (vjp,) = h_vjp(dl_dh)
    dh_dw = jax.grad(lambda w: jnp.sum(x @ w + b))(w)  # "the gradient of h": that of sum(h)
    return {"direct": np.asarray(direct), "vjp": np.asarray(vjp),
            "x_t_g": np.asarray(x.T @ dl_dh), "elementwise": np.asarray(dl_dh * dh_dw),
            "dl_dh": np.asarray(dl_dh)}


def tapped_run(**intervention: Any) -> dict[str, Any]:
    """One jitted gradient step with ``h`` tapped, altering dL/dh in flight.

    Returns:
        ``dl_dw``: the gradient that reached W; ``frame``: graddebug's rows.
    """
    w, b, x, y0 = (jnp.asarray(v, jnp.float32) for v in (W0, B0, X0, Y0))
    with graddebug.watch() as dbg:
        def loss(w: jax.Array) -> jax.Array:
            return loss_of(dbg.tap(x @ w + b, "h", **intervention), y0)

        dl_dw = jax.jit(jax.grad(loss))(w)
        dbg.step()
    return {"dl_dw": np.asarray(dl_dw), "frame": dbg.frame()}


def main() -> dict[str, Any]:
    """Run every part and print the comparison."""
    parts = split_chain_rule()
    plain = tapped_run()
    clipped = tapped_run(clip_norm=CLIP_NORM)
    print("dL/dW, jax.grad:        ", parts["direct"].tolist())
    print("dL/dW, VJP with dL/dh:  ", parts["vjp"].tolist())
    print("elementwise (wrong):    ", parts["elementwise"].tolist())
    row = clipped["frame"].iloc[0]
    print(f"tap h: norm {row['norm']:.6f} after clipping, {row['pre_norm']:.6f} before")
    return {**parts, "plain": plain, "clipped": clipped}


if __name__ == "__main__":
    main()
