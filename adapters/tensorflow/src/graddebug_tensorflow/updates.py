"""The optimizer's view of the weights: each watched variable's norm before the step's update,
and the norm of the update the optimizer applied, estimated from a fixed sample of entries.

Reading every weight before and after each update would double the optimizer's memory traffic;
a fixed index set per variable costs a gather of at most :data:`BUDGET` of the entries. The
set is strided: ``(p // 2 + j * p) mod n`` for ``j < k``, with ``p`` the smallest prime of at
least ``n / k`` that does not divide ``n``. Being prime and coprime with ``n``, ``p`` is coprime
with every dimension of the variable, so that the samples visit every column of a matrix
instead of one (a stride equal to the row length would alias them onto a single column), and
the ``k`` indices are distinct. The budget is shared max-min fairly (water-filling): small
variables are taken whole, and the rest share what is left equally, so every sampled row's
estimate has about the same relative error, ``1 / sqrt(2 k)`` for Gaussian-like entries. A
variable taken whole gives the exact norms. A norm is estimated as ``||sample|| * sqrt(n / k)``.

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

from graddebug_tensorflow.captures import StateBuffers, UpdateCol
from graddebug_tensorflow.stats import compiled

__all__ = ["BUDGET", "Sample", "UpdateView", "plan_samples", "update_columns"]

BUDGET = 0.01
"""The fraction of the watched variables' entries that is sampled, at most."""

_F64 = tf.float64


@dataclass(frozen=True)
class Sample:
    """The fixed entries sampled from one variable.

    Attributes:
        numel: The variable's number of entries.
        count: How many are sampled (``numel`` when taken whole, 0 for none).
        stride: The prime stride between sampled flat indices (1 when taken whole).
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
        """The sampled flat indices, distinct, in the order they are gathered."""
        if self.whole:
            return np.arange(self.numel, dtype=np.int64)
        j = np.arange(self.count, dtype=np.int64)
        return (self.stride // 2 + j * self.stride) % self.numel


FEWEST = 8
"""The fewest entries a variable's sample may hold, unless it is taken whole."""


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


def _stride(numel: int, count: int) -> int:
    """The smallest prime of at least ``numel / count`` that does not divide ``numel``."""
    p = max(2, math.ceil(numel / count))
    while not _is_prime(p) or numel % p == 0:
        p += 1
    return p


def plan_samples(sizes: Sequence[int], budget: float = BUDGET) -> list[Sample]:
    """The samples of variables of ``sizes`` entries, at most ``budget`` of them in all.

    Args:
        sizes: Each variable's number of entries.
        budget: The fraction of all entries that may be sampled.

    Returns:
        One :class:`Sample` per variable, in the order of ``sizes``; a variable gets none
        (``count == 0``) where its share of the budget is below :data:`FEWEST` entries and
        below its size.
    """
    left = math.floor(sum(sizes) * budget)
    counts = [0] * len(sizes)
    # Water-filling: the smallest first, each taking at most an equal share of what is left.
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for rank, i in enumerate(order):
        share = left // (len(order) - rank)
        counts[i] = min(sizes[i], share)
        left -= counts[i]
    # An estimate from a handful of entries is noise (a sampled entry of a dead unit's row
    # reads an update of 0): a variable that cannot have FEWEST, and is not taken whole, gets
    # none and NaN norms. 8 keeps the kernels of the small Keras references sampled.
    counts = [0 if 0 < c < min(FEWEST, n) else c for c, n in zip(counts, sizes, strict=True)]
    samples, offset = [], 0
    for numel, count in zip(sizes, counts, strict=True):
        stride = 1 if count in (0, numel) else _stride(numel, count)
        samples.append(Sample(numel, count, stride, offset))
        offset += count
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
        sizes = [int(np.prod(tuple(v.shape), dtype=np.int64)) for v in variables]
        self.samples = plan_samples(sizes)
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
            # The indices of Sample.indices(), made in the graph: a constant of them would
            # weigh 8 bytes per sampled entry in every graph that samples.
            j = tf.range(sample.count, dtype=tf.int64)
            flat = tf.gather(flat, (sample.stride // 2 + j * sample.stride) % sample.numel)
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
