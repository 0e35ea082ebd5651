"""Loss scaling in Keras: the scale that gradients carry, and the steps a scaler skips.

Keras scales the loss before differentiating it (``optimizer.scale_loss``, which ``fit`` and
Keras' mixed-precision loops call): every gradient of the backward pass, layer outputs and
parameters alike, carries the scale, and ``optimizer.apply`` divides it out of the parameter
gradients. The scale is a ``LossScaleOptimizer``'s dynamic one, or a static
``loss_scale_factor`` set on any optimizer. The adapter divides it out of the statistics
instead of the gradients (no gradient-sized temporary), with the scale read in the same
backward pass.

A ``LossScaleOptimizer`` skips a step whose scaled gradients hold Inf or NaN, and halves its
scale; it doubles the scale after ``dynamic_growth_steps`` finite steps. A step is therefore
skipped exactly when the scale after ``apply`` is below the scale before it, which
:func:`note_step` writes into the scaler's row of the state buffers (see
:class:`~.captures.ScalerCol`). No private method of the optimizer is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

from graddebug_tensorflow.captures import ScalerCol
from graddebug_tensorflow.stats import compiled

if TYPE_CHECKING:
    from graddebug_tensorflow.captures import StateBuffers

__all__ = ["LossScale", "given_scale", "note_step"]


class LossScale:
    """How a Keras optimizer scales the loss.

    Args:
        optimizer: The optimizer, a ``LossScaleOptimizer`` or one with ``loss_scale_factor``.
        dynamic: Whether the scale is a ``LossScaleOptimizer``'s, which changes and skips
            steps.
    """

    def __init__(self, optimizer: Any, dynamic: bool) -> None:
        self.optimizer = optimizer
        self.dynamic = dynamic

    @classmethod
    def of(cls, optimizer: Any) -> LossScale | None:
        """The loss scaling of ``optimizer``; None when it scales nothing."""
        if hasattr(optimizer, "inner_optimizer") and hasattr(optimizer, "initial_scale"):
            return cls(optimizer, dynamic=True)
        if getattr(optimizer, "loss_scale_factor", None) is not None:
            return cls(optimizer, dynamic=False)
        return None

    def current(self) -> Any:
        """The scale in use now, as ``optimizer.scale_loss`` reads it: a tensor read from the
        dynamic scale's variable (in a graph, read where this is called), else a float."""
        optimizer = self.optimizer
        if not self.dynamic:
            return float(optimizer.loss_scale_factor)
        if not optimizer.built:  # the first apply builds it; until then scale_loss uses this
            return float(optimizer.initial_scale)
        return tf.convert_to_tensor(optimizer.dynamic_scale)


def _note_step(row: tf.Variable, before: Any, after: Any) -> None:
    """Update the scaler's row for one ``apply``: ``before`` and ``after`` are the scale
    before and after it."""
    f64 = tf.float64
    before = tf.cast(before, f64)
    skipped = tf.cast(after, f64) < before
    old = row.read_value()
    row.assign(tf.stack([
        tf.constant(1.0, f64),
        tf.maximum(old[ScalerCol.SKIPPED], tf.cast(skipped, f64)),
        tf.where(skipped, before, old[ScalerCol.SKIPPED_SCALE]),
        before,
    ]))


_note_step_eagerly = compiled(_note_step)


def note_step(row: tf.Variable, before: Any, after: Any) -> None:
    """Record one ``apply`` of a loss-scaling optimizer in the scaler's ``row``: that the
    optimizer applied or skipped gradients, whether it skipped (``after < before``), and the
    scale of the backward pass (``before``)."""
    if tf.executing_eagerly():
        _note_step_eagerly(row, before, after)
    else:
        _note_step(row, before, after)


def given_scale(scale: LossScale | None, buffers: StateBuffers) -> Any:
    """The loss scale that gradients handed to ``step(grads)`` carry: that of the last
    ``apply`` in the step (from the scaler's row of ``buffers``), else the one in use now;
    None without loss scaling."""
    if scale is None:
        return None
    now = tf.cast(scale.current(), tf.float64)
    row = buffers.scaler
    if row is None:
        return now
    row = buffers.copy(row, 0)
    return tf.where(row[ScalerCol.APPLIED] > 0, row[ScalerCol.SCALE], now)
