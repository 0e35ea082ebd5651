"""Splitting the chain rule in a TF1 graph (``tf.compat.v1``), and editing it at the split.

The TensorFlow 1 version of ``examples/tf/scenario2_split_chain_rule.py``: the same
``h = x @ W + b``, ``y = tanh(h)``, ``loss = mean((y - y0)**2)``, written as a
``tf.compat.v1`` graph run by a session, as the original question was. With
``g = tf.compat.v1.gradients(loss, h)``, the tempting shortcut multiplies ``g`` elementwise by
``tf.compat.v1.gradients(h, W)``; that is the gradient of ``sum(h)``, and the product is not
dL/dW. The chain rule is a vector-Jacobian product, ``tf.compat.v1.gradients(h, W,
grad_ys=g)``, which for a matmul is ``x.T @ g``.

At the split point, ``dbg.tap(x @ W + b, "h", clip_norm=c)`` (or ``mask=``) alters dL/dh
before it flows on into ``W`` and ``b``, and records its norm before and after. In a graph,
the statistics come back through the session that trains: a bare ``Session`` fetches
``dbg.fetches()`` in its own ``run`` and hands the values to ``dbg.step()``; a
``MonitoredTrainingSession`` takes ``hooks=[dbg.session_hook()]``. Seed values, as in the
TF2 and PyTorch versions:

    W = [[1, 2], [3, 4]]    b = [0.5, 0.5]    x = [[0.1, 0.2], [0.3, 0.4]]
    y0 = [[0.8, 0.9], [0.7, 0.6]]

Run it with ``python examples/tf1/scenario2_split_chain_rule.py``.
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

v1 = tf.compat.v1

W0 = [[1.0, 2.0], [3.0, 4.0]]
B0 = [0.5, 0.5]
X0 = [[0.1, 0.2], [0.3, 0.4]]
Y0 = [[0.8, 0.9], [0.7, 0.6]]
CLIP_NORM = 0.005
"""Below the norm of dL/dh for the seed values (about 0.011), so clipping acts."""
MASK = [[True, False]]
"""Let the gradient of the first unit of h through, and stop the second."""
LEARNING_RATE = 0.5


def seed_graph() -> tuple[Any, Any, tf.Tensor, tf.Tensor]:
    """In the default graph: ``W, b`` variables and ``x, y0`` constants, all float32."""
    w = v1.Variable(W0, dtype=tf.float32, name="W")
    b = v1.Variable(B0, dtype=tf.float32, name="b")
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
    """Compute dL/dW directly, by a vector-Jacobian product, and by the elementwise mistake,
    in one v1 graph and one session.

    Returns:
        ``direct``: ``gradients(loss, W)``; ``vjp``: ``gradients(h, W, grad_ys=dL_dh)``;
        ``x_t_g``: ``x.T @ dL_dh``; ``elementwise``: ``dL_dh * gradients(h, W)``;
        ``dl_dh``: dL/dh.
    """
    with tf.Graph().as_default():
        w, b, x, y0 = seed_graph()
        h = x @ w + b
        loss = loss_of(h, y0)
        (dl_dh,) = v1.gradients(loss, h)
        # What "the gradient of h with respect to W" returns: the gradient of sum(h).
        (dh_dw,) = v1.gradients(h, w)
        (vjp,) = v1.gradients(h, w, grad_ys=dl_dh)
        (direct,) = v1.gradients(loss, w)
        parts = {"direct": direct, "vjp": vjp, "x_t_g": tf.matmul(x, dl_dh, transpose_a=True),
                 "elementwise": dl_dh * dh_dw, "dl_dh": dl_dh}
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            values: dict[str, np.ndarray] = sess.run(parts)
    return values


def tapped_step(hook: bool, **intervention: Any) -> dict[str, Any]:
    """One gradient-descent step through the split chain rule, with ``h`` tapped and dL/dh
    altered in flight.

    Args:
        hook: Run the step in a ``MonitoredTrainingSession`` with ``dbg.session_hook()``;
            otherwise in a bare ``Session`` that fetches ``dbg.fetches()``.
        **intervention: ``clip_norm=``, ``mask=``, ... for :meth:`graddebug.Watcher.tap`.

    Returns:
        ``w_grad`` and ``b_grad`` as the step applied them, and ``row``: the record of
        ``h``.
    """
    with tf.Graph().as_default():
        w, b, x, y0 = seed_graph()
        with graddebug.watch(params={"W": w, "b": b}) as dbg:
            h = dbg.tap(x @ w + b, "h", **intervention)
            loss = loss_of(h, y0)
            (dl_dh,) = v1.gradients(loss, h)  # above the tap: not altered yet
            # The VJP runs through the tap, whose gradient applies the intervention.
            grads = v1.gradients(h, [w, b], grad_ys=dl_dh)
            train = v1.train.GradientDescentOptimizer(LEARNING_RATE).apply_gradients(
                zip(grads, [w, b], strict=True))
            if hook:
                with v1.train.MonitoredTrainingSession(
                        hooks=[dbg.session_hook(grads=grads)], log_step_count_steps=None,
                        save_summaries_steps=None) as sess:
                    _, (w_grad, b_grad) = sess.run([train, grads])
            else:
                fetches = dbg.fetches(grads=grads)
                with v1.Session() as sess:
                    sess.run(v1.global_variables_initializer())
                    out = sess.run({"train": train, "grads": grads, "dbg": fetches})
                    dbg.step(out["dbg"])
                    w_grad, b_grad = out["grads"]
    frame = dbg.frame()
    row = frame[frame["layer"] == "h"].iloc[0]
    return {"w_grad": w_grad, "b_grad": b_grad, "row": row}


def main() -> dict[str, Any]:
    """Show the wrong split, the right split, and clipping/masking at the split point.

    Returns:
        The arrays of :func:`split_chain_rule`, plus ``clipped`` (a bare session) and
        ``masked`` (a monitored session with the hook), each a dict with ``w_grad``,
        ``b_grad``, ``expected_w``, ``expected_b``, ``norm``, ``pre_norm``;
        ``dl_dh_numpy``, ``clip_norm`` and ``learning_rate``.
    """
    parts = split_chain_rule()
    x = np.array(X0)
    g = numpy_dl_dh()
    runs = {}
    for label, hook, options, modified in (
        ("clipped", False, {"clip_norm": CLIP_NORM}, clip_by_norm(g, CLIP_NORM)),
        ("masked", True, {"mask": tf.constant(MASK)}, g * np.array(MASK, dtype=np.float64)),
    ):
        run = tapped_step(hook, **options)
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
    return {**parts, **runs, "dl_dh_numpy": g, "clip_norm": CLIP_NORM,
            "learning_rate": LEARNING_RATE}


def _report(parts: dict[str, np.ndarray], runs: dict[str, dict[str, Any]], g: np.ndarray) -> None:
    """Print the comparisons of :func:`main` in a few readable lines."""
    print("direct dL/dW (gradients(loss, W)):\n", parts["direct"])
    print("elementwise dL/dh * gradients(h, W), the claimed shortcut:\n", parts["elementwise"])
    print("  equal to dL/dW?", np.allclose(parts["elementwise"], parts["direct"]))
    print("VJP gradients(h, W, grad_ys=dL/dh):\n", parts["vjp"])
    print(
        "  equal to dL/dW?",
        np.allclose(parts["vjp"], parts["direct"]),
        "| equal to x.T @ dL/dh?",
        np.allclose(parts["vjp"], parts["x_t_g"]),
    )
    print(f"||dL/dh|| = {np.linalg.norm(g):.6f}; tap(h, clip_norm={CLIP_NORM}) in a Session, "
          f"tap(h, mask={MASK}) in a MonitoredTrainingSession:")
    for label, run in runs.items():
        print(
            f"  {label}: dL/dW == x.T @ {label}(dL/dh)? "
            f"{np.allclose(run['w_grad'], run['expected_w'], rtol=1e-5, atol=1e-8)}; "
            f"frame pre_norm={run['pre_norm']:.6f} norm={run['norm']:.6f}"
        )


if __name__ == "__main__":
    main()
