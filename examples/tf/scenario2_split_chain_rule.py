"""Splitting the chain rule at an intermediate tensor in raw TensorFlow, and editing it there.

Take ``h = x @ W + b``, ``y = tanh(h)`` and ``loss = mean((y - y0)**2)``, written with plain
``tf.Variable`` objects and no Keras layers. It is tempting to get dL/dW in two pieces,
``tape.gradient(loss, h)`` and ``tape.gradient(h, W)``, and to multiply them elementwise. A
popular write-up does exactly that. For a matrix product it is wrong: dh/dW is a 4-D Jacobian,
and what ``tape.gradient(h, W)`` returns is the gradient of ``sum(h)``, which has thrown the
needed structure away. The right way to finish the chain rule is a vector-Jacobian product:
hand dL/dh to the tape as the output gradient, ``tape.gradient(h, W, output_gradients=dL_dh)``,
which for a matmul is ``x.T @ dL_dh``.

The same split point is where you may want to clip or mask the gradient before it flows on into
``W``. ``dbg.tap(x @ W + b, "h", clip_norm=c)`` does that in flight, and records the norm
before and after. This example checks every claim against numpy, using the same seed values as
the PyTorch version:

    W = [[1, 2], [3, 4]]    b = [0.5, 0.5]    x = [[0.1, 0.2], [0.3, 0.4]]
    y0 = [[0.8, 0.9], [0.7, 0.6]]

Run it with ``python examples/tf/scenario2_split_chain_rule.py``.
"""

from __future__ import annotations

import os

# Before TensorFlow is imported: no C++ log lines, and no oneDNN rounding differences.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from typing import Any

import numpy as np
import tensorflow as tf

import graddebug

W0 = [[1.0, 2.0], [3.0, 4.0]]
B0 = [0.5, 0.5]
X0 = [[0.1, 0.2], [0.3, 0.4]]
Y0 = [[0.8, 0.9], [0.7, 0.6]]
CLIP_NORM = 0.005
"""Below the norm of dL/dh for the seed values (about 0.011), so clipping acts."""
MASK = [[True, False]]
"""Let the gradient of the first unit of h through, and stop the second."""


def seed_tensors() -> tuple[tf.Variable, tf.Variable, tf.Tensor, tf.Tensor]:
    """Return fresh ``W, b`` variables and ``x, y0`` constants, all float32."""
    w = tf.Variable(W0, dtype=tf.float32, name="W")
    b = tf.Variable(B0, dtype=tf.float32, name="b")
    return w, b, tf.constant(X0, tf.float32), tf.constant(Y0, tf.float32)


def loss_of(h: tf.Tensor, y0: tf.Tensor) -> tf.Tensor:
    """The loss of the example: ``mean((tanh(h) - y0)**2)``."""
    return tf.reduce_mean(tf.square(tf.tanh(h) - y0))


def numpy_dl_dh() -> np.ndarray:
    """dL/dh for the seed values, derived by hand: ``2 (y - y0) / n * (1 - y**2)``."""
    x, w, b, y0 = (np.array(v, dtype=np.float64) for v in (X0, W0, B0, Y0))
    y = np.tanh(x @ w + b)
    return 2.0 * (y - y0) / y.size * (1.0 - y**2)


def clip_by_norm(g: np.ndarray, clip_norm: float) -> np.ndarray:
    """``g * min(1, clip_norm / ||g||)``, graddebug's documented clip-by-norm rule."""
    return g * min(1.0, clip_norm / float(np.linalg.norm(g)))


def split_chain_rule() -> dict[str, np.ndarray]:
    """Compute dL/dW directly, by a vector-Jacobian product, and by the elementwise mistake.

    Returns:
        ``direct``: ``tape.gradient(loss, W)``; ``vjp``: ``tape.gradient(h, W,
        output_gradients=dL_dh)``; ``x_t_g``: ``x.T @ dL_dh``; ``elementwise``: ``dL_dh *
        tape.gradient(h, W)``; ``dl_dh``: dL/dh.
    """
    w, b, x, y0 = seed_tensors()
    # persistent: the same forward pass is differentiated four times.
    with tf.GradientTape(persistent=True) as tape:
        h = x @ w + b
        loss = loss_of(h, y0)
    dl_dh = tape.gradient(loss, h)
    # What "the gradient of h with respect to W" returns: the gradient of sum(h).
    dh_dw = tape.gradient(h, w)
    vjp = tape.gradient(h, w, output_gradients=dl_dh)
    direct = tape.gradient(loss, w)
    del tape
    return {
        "direct": direct.numpy(),
        "vjp": vjp.numpy(),
        "x_t_g": tf.matmul(x, dl_dh, transpose_a=True).numpy(),
        "elementwise": (dl_dh * dh_dw).numpy(),
        "dl_dh": dl_dh.numpy(),
    }


def tapped_run(**intervention: Any) -> dict[str, Any]:
    """Take one gradient step's gradients with ``h`` tapped, altering dL/dh in flight.

    Args:
        **intervention: ``clip_norm=``, ``mask=``, ... for :meth:`graddebug.Watcher.tap`.

    Returns:
        ``w_grad`` and ``b_grad`` from the tape, and ``row``: the record of ``h``.
    """
    w, b, x, y0 = seed_tensors()
    with graddebug.watch(params={"W": w, "b": b}) as dbg:
        with tf.GradientTape() as tape:
            h = dbg.tap(x @ w + b, "h", **intervention)
            loss = loss_of(h, y0)
        w_grad, b_grad = tape.gradient(loss, [w, b])
        dbg.step([w_grad, b_grad])
    frame = dbg.frame()
    row = frame[frame["layer"] == "h"].iloc[0]
    return {"w_grad": w_grad.numpy(), "b_grad": b_grad.numpy(), "row": row}


def main() -> dict[str, Any]:
    """Show the wrong split, the right split, and clipping/masking at the split point.

    Returns:
        The arrays of :func:`split_chain_rule`, plus ``clipped`` and ``masked`` (each a dict
        with ``w_grad``, ``b_grad``, ``expected_w``, ``expected_b``, ``norm``, ``pre_norm``),
        ``dl_dh_numpy`` and ``clip_norm``.
    """
    parts = split_chain_rule()
    x = np.array(X0)
    g = numpy_dl_dh()

    expected_clip = clip_by_norm(g, CLIP_NORM)
    expected_mask = g * np.array(MASK, dtype=np.float64)
    runs = {}
    for label, options, modified in (
        ("clipped", {"clip_norm": CLIP_NORM}, expected_clip),
        ("masked", {"mask": tf.constant(MASK)}, expected_mask),
    ):
        run = tapped_run(**options)
        runs[label] = {
            "w_grad": run["w_grad"],
            "b_grad": run["b_grad"],
            "expected_w": x.T @ modified,
            "expected_b": modified.sum(axis=0),
            "norm": float(run["row"]["norm"]),
            "pre_norm": float(run["row"]["pre_norm"]),
        }

    with np.printoptions(precision=6, suppress=True):
        _report(parts, runs, g)
    return {**parts, **runs, "dl_dh_numpy": g, "clip_norm": CLIP_NORM}


def _report(parts: dict[str, np.ndarray], runs: dict[str, dict[str, Any]], g: np.ndarray) -> None:
    """Print the comparisons of :func:`main` in a few readable lines."""
    print("direct dL/dW (tape.gradient(loss, W)):\n", parts["direct"])
    print("elementwise dL/dh * tape.gradient(h, W), the claimed shortcut:\n", parts["elementwise"])
    print("  equal to dL/dW?", np.allclose(parts["elementwise"], parts["direct"]))
    print("VJP tape.gradient(h, W, output_gradients=dL/dh):\n", parts["vjp"])
    print(
        "  equal to dL/dW?",
        np.allclose(parts["vjp"], parts["direct"]),
        "| equal to x.T @ dL/dh?",
        np.allclose(parts["vjp"], parts["x_t_g"]),
    )
    print(
        f"||dL/dh|| = {np.linalg.norm(g):.6f}; tap(h, clip_norm={CLIP_NORM}) and "
        f"tap(h, mask={MASK}):"
    )
    for label, run in runs.items():
        print(
            f"  {label}: dL/dW == x.T @ {label}(dL/dh)? "
            f"{np.allclose(run['w_grad'], run['expected_w'], rtol=1e-5, atol=1e-8)}; "
            f"frame pre_norm={run['pre_norm']:.6f} norm={run['norm']:.6f}"
        )


if __name__ == "__main__":
    main()
