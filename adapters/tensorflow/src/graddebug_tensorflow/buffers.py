"""TF state that statistics are written into, read back and cleared once per recorded step.

Hooks inside a ``tf.function`` run once, at trace time; what they leave in the graph must write
somewhere every step. They write rows into ``tf.Variable`` buffers: activation rows in chunks
of :data:`CHUNK` rows (a chunk is added, outside any graph, when a new slot needs one, so
graphs traced earlier stay valid), parameter rows in one variable. Closing a step concatenates
every buffer into one tensor, copies it to the host (one transfer per step) and zeroes the
buffers.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from graddebug_tensorflow.stats import ACT_WIDTH, PARAM_WIDTH

__all__ = ["CHUNK", "StateBuffers", "shapeless_variable"]

CHUNK = 64


class StateBuffers:
    """Activation and parameter rows in ``tf.Variable`` buffers."""

    def __init__(self) -> None:
        self._chunks: list[tf.Variable] = []
        self._rows = 0
        self.params: tf.Variable | None = None

    @property
    def rows(self) -> int:
        """Number of activation rows handed out."""
        return self._rows

    def new_row(self) -> tuple[tf.Variable, int, int]:
        """Hand out the next activation row as ``(chunk variable, row in the chunk, index)``.

        Safe to call while a ``tf.function`` traces: a new chunk is created outside the graph.
        """
        index = self._rows
        if index // CHUNK >= len(self._chunks):
            with tf.init_scope():
                self.reserve(index + 1)
        self._rows += 1
        return self._chunks[index // CHUNK], index % CHUNK, index

    def reserve(self, rows: int) -> None:
        """Create the chunks for ``rows`` activation rows now, outside any graph, so that a
        ``tf.function`` traced later creates no variable (which would make it trace twice)."""
        while len(self._chunks) * CHUNK < rows:
            self._chunks.append(
                tf.Variable(
                    tf.zeros([CHUNK, ACT_WIDTH], tf.float64),
                    trainable=False,
                    name=f"graddebug_rows_{len(self._chunks)}",
                )
            )

    def ensure_params(self, count: int) -> tf.Variable:
        """Return the parameter buffer, (re)created for ``count`` parameters.

        Its last row is the source row: column 0 is set when gradients were handed over in the
        step (by the optimizer or ``step(grads)``), even if every one of them was None.
        """
        if self.params is None or self.params.shape[0] != count + 1:
            with tf.init_scope():
                self.params = tf.Variable(
                    tf.zeros([count + 1, PARAM_WIDTH], tf.float64),
                    trainable=False,
                    name="graddebug_params",
                )
        return self.params

    def _variables(self) -> list[tf.Variable]:
        return [*self._chunks, *([self.params] if self.params is not None else [])]

    def read_and_clear(self) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(activation rows, parameter rows)`` as arrays, and zero every buffer."""
        variables = self._variables()
        if not variables:
            return np.zeros((0, ACT_WIDTH)), np.zeros((0, PARAM_WIDTH))
        flat = tf.concat([tf.reshape(v, [-1]) for v in variables], 0).numpy()
        self.clear()
        split = len(self._chunks) * CHUNK * ACT_WIDTH
        acts = flat[:split].reshape(-1, ACT_WIDTH)
        return acts[: self._rows], flat[split:].reshape(-1, PARAM_WIDTH)

    def peek(self) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(activation rows, parameter rows)`` without clearing them, with one
        transfer (not one per chunk: a model of thousands of layers has hundreds of chunks)."""
        variables = self._variables()
        if not variables:
            return np.zeros((0, ACT_WIDTH)), np.zeros((0, PARAM_WIDTH))
        flat = tf.concat([tf.reshape(v, [-1]) for v in variables], 0).numpy()
        split = len(self._chunks) * CHUNK * ACT_WIDTH
        return flat[:split].reshape(-1, ACT_WIDTH)[: self._rows], \
            flat[split:].reshape(-1, PARAM_WIDTH)

    def clear(self) -> None:
        """Zero every buffer (without reading it on steps that ``every=`` skips)."""
        for v in self._variables():
            v.assign(tf.zeros_like(v))


def shapeless_variable(name: str) -> tf.Variable:
    """A variable that takes any shape: where ``keep=`` copies a gradient inside a graph."""
    return tf.Variable(
        tf.zeros([0]), shape=tf.TensorShape(None), validate_shape=False, trainable=False,
        name=name,
    )
