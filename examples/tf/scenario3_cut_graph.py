"""Finding where a ``tf.stop_gradient`` or a numpy round trip silently cuts the graph.

A Keras model built from ``block1 -> block2 -> head`` trains without any error when
``block1``'s output goes through ``tf.stop_gradient`` on its way into ``block2``: the loss goes
down, because ``block2`` and ``head`` still learn, but ``block1`` never changes. The same
happens with a numpy round trip such as ``tf.constant(h.numpy())`` in eager mode, which is easy
to write while debugging or when a preprocessing step lives in numpy. All Keras says is a
``UserWarning`` from the optimizer, "Gradients do not exist for variables [...]", which lists
variable paths and says nothing about where the graph was cut (and which a ``fit`` log easily
buries).

graddebug sees that ``block1``'s output took part in the forward pass but no gradient reached
it in the backward pass, while ``block2``'s did, and reports a ``cut_graph`` finding that names
the boundary between the two blocks, plus a second one for ``block1``'s variables, which got no
gradient at all. This example shows four versions of the same bug:

1. ``tf.stop_gradient`` inside a subclassed model's ``call``, in a ``GradientTape`` loop;
2. the numpy round trip, in the same loop;
3. raw TensorFlow without layers, where ``dbg.tap`` marks the block outputs and
   ``watch(params=...)`` names the variables;
4. ``tf.stop_gradient`` again, trained with ``model.fit`` and ``dbg.callback()``.

Run it with ``python examples/tf/scenario3_cut_graph.py``.
"""

from __future__ import annotations

import os

# Before TensorFlow is imported: no C++ log lines, and no oneDNN rounding differences.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

import graddebug

SEED = 0
STEPS = 2
BATCH = 16
FEATURES = 4
HIDDEN = 8
LR = 0.1
KERAS_WARNING = "Gradients do not exist for variables"
"""The start of the only message Keras gives about the cut (from its optimizer)."""

Cut = Callable[[tf.Tensor], tf.Tensor]


def stop_gradient(h: tf.Tensor) -> tf.Tensor:
    """The explicit cut."""
    return tf.stop_gradient(h)


def numpy_round_trip(h: tf.Tensor) -> tf.Tensor:
    """The accidental cut: the values survive the trip to numpy, the graph does not."""
    return tf.constant(h.numpy())


def no_cut(h: tf.Tensor) -> tf.Tensor:
    """The control: ``block1``'s output flows on unchanged."""
    return h


class BlockNet(keras.Model):
    """``block1 -> cut -> block2 -> head``; ``cut`` stands for the bug under study."""

    def __init__(self, cut: Cut) -> None:
        super().__init__(name="block_net")
        self.cut = cut
        self.block1 = keras.layers.Dense(HIDDEN, activation="tanh", name="block1")
        self.block2 = keras.layers.Dense(HIDDEN, activation="tanh", name="block2")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        """Run the blocks, cutting the graph between ``block1`` and ``block2``."""
        return self.head(self.block2(self.cut(self.block1(x))))


def data(steps: int = STEPS) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """Seeded random regression batches, one ``(x, y)`` pair per step."""
    rng = np.random.default_rng(SEED + 1)
    return [
        (
            tf.constant(rng.standard_normal((BATCH, FEATURES)), tf.float32),
            tf.constant(rng.standard_normal((BATCH, 1)), tf.float32),
        )
        for _ in range(steps)
    ]


def build(cut: Cut) -> keras.Model:
    """Build :class:`BlockNet` from the example's seed, with its variables created."""
    keras.utils.set_random_seed(SEED)
    model = BlockNet(cut)
    model(tf.zeros((1, FEATURES)))
    return model


@contextmanager
def keras_warnings() -> Iterator[list[str]]:
    """Collect the text of the optimizer's "Gradients do not exist" warnings.

    Every occurrence is collected, not only the first, and none is printed; any other warning
    is issued again once the block ends.
    """
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=KERAS_WARNING)
        yield messages
    for w in caught:
        if str(w.message).startswith(KERAS_WARNING):
            messages.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def train_module(cut: Cut) -> dict[str, Any]:
    """Train :class:`BlockNet` for a few SGD steps in a ``GradientTape`` loop under ``watch``.

    Args:
        cut: How ``block1``'s output is cut off.

    Returns:
        ``findings``; ``frozen``: whether ``block1``'s kernel stayed exactly as initialised;
        ``keras_warnings``: what Keras said about it.
    """
    model = build(cut)
    kernel = model.block1.kernel
    before = kernel.numpy().copy()
    optimizer = keras.optimizers.SGD(LR)
    with keras_warnings() as said, graddebug.watch(model) as dbg:
        for x, y in data():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            dbg.step(grads)
    frozen = bool(np.array_equal(before, kernel.numpy()))
    return {"findings": dbg.findings(), "frozen": frozen, "keras_warnings": said}


def train_fit() -> dict[str, Any]:
    """The ``tf.stop_gradient`` model trained by ``model.fit``, recorded by ``dbg.callback()``.

    Returns:
        The same keys as :func:`train_module`.
    """
    model = build(stop_gradient)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    before = model.block1.kernel.numpy().copy()
    x = tf.concat([x for x, _ in data()], axis=0)
    y = tf.concat([y for _, y in data()], axis=0)
    with keras_warnings() as said, graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    frozen = bool(np.array_equal(before, model.block1.kernel.numpy()))
    return {"findings": dbg.findings(), "frozen": frozen, "keras_warnings": said}


def train_raw() -> pd.DataFrame:
    """The same network as plain variables, with taps at each block's output.

    Returns:
        The findings.
    """
    rng = np.random.default_rng(SEED)
    params = {
        "W1": tf.Variable(rng.standard_normal((FEATURES, HIDDEN)) * 0.5, dtype=tf.float32),
        "W2": tf.Variable(rng.standard_normal((HIDDEN, HIDDEN)) * 0.3, dtype=tf.float32),
        "w3": tf.Variable(rng.standard_normal((HIDDEN, 1)) * 0.3, dtype=tf.float32),
    }
    with graddebug.watch(params=params) as dbg:
        for x, y in data():
            with tf.GradientTape() as tape:
                h1 = dbg.tap(tf.tanh(x @ params["W1"]), "block1")
                h2 = dbg.tap(tf.tanh(tf.stop_gradient(h1) @ params["W2"]), "block2")
                out = dbg.tap(h2 @ params["w3"], "head")
                loss = tf.reduce_mean(tf.square(out - y))
            grads = tape.gradient(loss, list(params.values()))
            for var, grad in zip(params.values(), grads, strict=True):
                if grad is not None:  # W1's is None: plain SGD just skips it
                    var.assign_sub(LR * grad)
            dbg.step(grads)
    return dbg.findings()


def main() -> dict[str, Any]:
    """Run the four versions of the cut and print what graddebug and Keras report.

    Returns:
        ``stop_gradient``, ``numpy``, ``raw``, ``fit``: the findings frame of each version;
        ``block1_frozen``: for the three Keras versions, whether ``block1``'s kernel never
        changed during training; ``keras_warnings``: for the same three, the messages of
        Keras' "Gradients do not exist" warnings.
    """
    runs = {
        "stop_gradient": train_module(stop_gradient),
        "numpy": train_module(numpy_round_trip),
        "fit": train_fit(),
    }
    results = {label: run["findings"] for label, run in runs.items()}
    results["raw"] = train_raw()
    for label, findings in results.items():
        print(f"--- {label}: {len(findings)} finding(s)")
        for row in findings.itertuples():
            print(f"[{row.issue}/{row.severity}] {row.layer}: {row.message}")
    print(f"Keras, in model.fit: {runs['fit']['keras_warnings'][0]}")
    frozen = {label: run["frozen"] for label, run in runs.items()}
    print(f"block1's kernel unchanged after {STEPS} SGD steps: {frozen}")
    return {
        **results,
        "block1_frozen": frozen,
        "keras_warnings": {label: run["keras_warnings"] for label, run in runs.items()},
    }


if __name__ == "__main__":
    main()
