"""The optimizer's view of the weights: each watched variable's norm before the step's update,
and the norm of the update the optimizer applied, estimated from a fixed sample of entries.

Reading every weight before and after each update would double the optimizer's memory traffic;
a fixed index set per variable costs a strided slice of a small fraction of the entries, the
plan every adapter shares (:func:`graddebug.sampling.plan`): every ``p``-th entry from the
first, ``p`` a prime that divides none of the variable's row lengths, so that the samples visit
the columns of a matrix instead of one (a stride equal to the row length would alias them onto
a single column). Small variables are taken whole, and give the exact norms. A norm is
estimated as ``||sample|| * sqrt(n / k)`` for ``k`` entries read.

The ops run around the optimizer's ``apply`` (eagerly, in a ``tf.function`` or in ``fit``'s
graph): before it, the samples of the step's first apply are kept in a state variable of
``k`` entries per variable; after it, the sums of squares of the kept weights and of the change
are written into the rows of :attr:`~.captures.StateBuffers.updates`, which the close reads
with every other buffer, in its one transfer. Several applies in one step (gradient
accumulation) give the change since the first. The kept samples are never read back to the
host.

Without an optimizer in view (``dbg.step(grads)`` alone), the close samples the weights as
they are then, in the same ``tf.function`` that writes the gradient rows: that is
``weight_norm`` after the update where the loop applies it before ``dbg.step``, which moves
it by the update, far below the weights' own norm in a healthy run; ``update_norm`` stays
NaN there, since no update was seen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from graddebug import sampling
from graddebug_tensorflow.captures import StateBuffers, UpdateCol
from graddebug_tensorflow.stats import compiled

__all__ = ["Sample", "UpdateView", "plan_samples", "update_columns"]

_F64 = tf.float64


@dataclass(frozen=True)
class Sample:
    """The fixed entries sampled from one variable (:class:`graddebug.sampling.Sample`), and
    where they are kept.

    Attributes:
        numel: The variable's number of entries.
        count: How many are sampled (``numel`` when taken whole).
        stride: The stride between sampled flat indices (1 when taken whole).
        offset: Where this variable's samples start in the kept-samples variable.
    """

    numel: int
    count: int
    stride: int
    offset: int

    @property
    def whole(self) -> bool:
        """Whether every entry is sampled (the norms are then exact)."""
        return self.count == self.numel

    @property
    def factor(self) -> float:
        """``sqrt(numel / count)``: what scales a sample's norm to the variable's."""
        return math.sqrt(self.numel / self.count) if self.count else math.nan

    def indices(self) -> np.ndarray:
        """The sampled flat indices, in the order they are gathered."""
        return np.arange(0, self.numel, self.stride, dtype=np.int64)


def plan_samples(shapes: Sequence[Sequence[int]]) -> list[Sample]:
    """The samples of variables of ``shapes``, as :func:`graddebug.sampling.plan` reads them,
    each with its offset in the kept-samples variable.

    Args:
        shapes: Each variable's shape.

    Returns:
        One :class:`Sample` per variable, in the order of ``shapes``.
    """
    samples, offset = [], 0
    for planned in sampling.plan(shapes):
        samples.append(Sample(planned.numel, planned.count, planned.stride, offset))
        offset += planned.count
    return samples


class UpdateView:
    """Samples the watched variables around an optimizer's ``apply`` (or at the close) and
    writes their rows into :attr:`StateBuffers.updates`.

    Args:
        buffers: The adapter's buffers; under several replicas nothing is measured (the
            optimizer updates mirrored variables in a cross-replica merge, where the replica
            functions that hold the samples no longer run), and the rows stay NaN.
    """

    def __init__(self, buffers: StateBuffers) -> None:
        self._buffers = buffers
        self.samples: list[Sample] = []
        self._kept: tf.Variable | None = None
        self._eager_before = compiled(self._before)
        self._eager_after = compiled(self._after)
        self._eager_weights = compiled(self._weights)

    @property
    def active(self) -> bool:
        """Whether the variables are sampled (one replica, at least one sampled entry)."""
        return self._kept is not None

    def resolve(self, variables: Sequence[Any]) -> None:
        """Plan the samples of the watched ``variables`` (in buffer order) and create their
        state, outside any graph; again only when their count changes."""
        if self._buffers.replicas > 1 or len(self.samples) == len(variables):
            return
        self.samples = plan_samples([tuple(int(d) for d in v.shape) for v in variables])
        total = sum(s.count for s in self.samples)
        self._buffers.ensure_updates(len(variables))
        if total:
            with tf.init_scope():
                self._kept = tf.Variable(tf.zeros([total], _F64), trainable=False,
                                         name="graddebug_kept_weights")

    def _gather(self, row: int, var: Any) -> tf.Tensor:
        """The sampled entries of ``var`` now, in float64 (exact for narrower floats)."""
        flat = tf.reshape(tf.convert_to_tensor(var), [-1])
        sample = self.samples[row]
        if not sample.whole:
            # The indices of Sample.indices() as a strided slice: a constant of them would
            # weigh 8 bytes per sampled entry in every graph that samples.
            flat = flat[:: sample.stride]
        return tf.cast(flat, _F64)

    def _sampled(self, pairs: Sequence[tuple[int, Any]]) -> list[tuple[int, Any]]:
        return [(i, v) for i, v in pairs if self.samples[i].count]

    def _before(self, pairs: Sequence[tuple[int, Any]]) -> tf.Tensor:
        """Keep the samples of the variables whose rows are not yet seen in the step."""
        kept, rows = self._kept, self._buffers.updates
        assert kept is not None and rows is not None
        values, seen = kept.read_value(), rows.read_value()[:, UpdateCol.SEEN]
        for i, var in self._sampled(pairs):
            s = self.samples[i]
            # The first apply of the step keeps the weights its gradients were computed at.
            kept[s.offset : s.offset + s.count].assign(tf.where(
                seen[i] > 0, values[s.offset : s.offset + s.count], self._gather(i, var)))
        return tf.constant(True)

    def _after(self, pairs: Sequence[tuple[int, Any]]) -> tf.Tensor:
        """Write each applied variable's row: its kept weights and the change since then."""
        kept, rows = self._kept, self._buffers.updates
        assert kept is not None and rows is not None
        sampled = self._sampled(pairs)
        if not sampled:
            return tf.constant(False)
        values = kept.read_value()
        new = []
        for i, var in sampled:
            s = self.samples[i]
            base = values[s.offset : s.offset + s.count]
            change = self._gather(i, var) - base
            new.append(tf.stack([tf.constant(1.0, _F64), tf.reduce_sum(base * base),
                                 tf.reduce_sum(change * change)]))
        rows.scatter_nd_update([[i] for i, _ in sampled], tf.stack(new))
        return tf.constant(True)

    def _weights(self, pairs: Sequence[tuple[int, Any]]) -> tf.Tensor:
        """Write the rows of variables not yet seen in the step from their weights now, with
        no update (``UPDATE_SQ`` -1)."""
        rows = self._buffers.updates
        assert rows is not None
        sampled = self._sampled(pairs)
        if not sampled:
            return tf.constant(False)
        old = rows.read_value()
        new = []
        for i, var in sampled:
            w = self._gather(i, var)
            mine = tf.stack([tf.constant(1.0, _F64), tf.reduce_sum(w * w),
                             tf.constant(-1.0, _F64)])
            new.append(tf.where(old[i, UpdateCol.SEEN] > 0, old[i], mine))
        rows.scatter_nd_update([[i] for i, _ in sampled], tf.stack(new))
        return tf.constant(True)

    def before(self, pairs: Sequence[tuple[int, Any]]) -> tf.Tensor:
        """Before an ``apply``: keep the samples of ``(row, variable)`` pairs (eagerly: one
        ``tf.function`` call)."""
        if not self.active:
            return tf.constant(False)
        if tf.executing_eagerly():
            return self._eager_before(_plain(pairs))
        return self._before(pairs)

    def after(self, pairs: Sequence[tuple[int, Any]]) -> tf.Tensor:
        """After an ``apply``: write the rows of ``(row, variable)`` pairs."""
        if not self.active:
            return tf.constant(False)
        if tf.executing_eagerly():
            return self._eager_after(_plain(pairs))
        return self._after(pairs)

    def weights(self, pairs: Sequence[tuple[int, Any]]) -> tf.Tensor:
        """At a close that no apply preceded: the rows of the weights as they are (called
        inside the close's own ``tf.function``, or eagerly)."""
        if not self.active:
            return tf.constant(False)
        if tf.executing_eagerly():
            return self._eager_weights(_plain(pairs))
        return self._weights(pairs)


def _plain(pairs: Sequence[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """``(row, variable)`` pairs with Keras variables as the ``tf.Variable`` they hold, which
    a ``tf.function`` takes as an argument without tracing again for each value."""
    return [(i, getattr(v, "value", v) if not isinstance(v, tf.Variable) else v)
            for i, v in pairs]


def update_columns(rows: np.ndarray, row: int, factor: float) -> tuple[float, float]:
    """``(weight_norm, update_norm)`` from row ``row`` of the optimizer's view; NaN where it
    was not measured (``factor`` is :attr:`Sample.factor`, NaN for a variable not sampled)."""
    if row >= len(rows) or rows[row, UpdateCol.SEEN] <= 0:
        return math.nan, math.nan
    weight_sq = float(rows[row, UpdateCol.WEIGHT_SQ])
    update_sq = float(rows[row, UpdateCol.UPDATE_SQ])
    return (math.sqrt(weight_sq) * factor,
            math.sqrt(update_sq) * factor if update_sq >= 0 else math.nan)
