"""The rows of an eager step's sentinel statistics, written with a few raw ops.

In eager mode each watched output of a step that measures the sentinel only (see
:mod:`graddebug.capture.tiers`) costs one reduction forward, the finiteness sum, and two
backward, the sum of squares and the sum. Through a compiled writer (:class:`.FlatWriter`) each
of them is a function call, most of whose cost is TF's cost of running a function; as single ops
they take a fraction of that (the Performance page has the timings). :class:`EagerRows` runs
those ops, keeps their scalar results and the values the host already knows (the flags, the
shape, the markers of statistics not measured), and writes them all into the buffers
(:mod:`.captures`) when the step is read: a few ops for the whole step, and no transfer of its
own.

The rows written are those :func:`.write_forward` and :func:`.write_activation` would write
(with no loss scale, no intervention and ``full=False``), bit for bit: the same kernels reduce
the same tensors. Other cases, and graphs, keep those writers.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import tensorflow as tf

from graddebug_tensorflow.stats import EAGER_TENSOR, MAX_DIMS, NOT_MEASURED, Col

__all__ = ["EagerRows"]

_R = tf.raw_ops
_WIDENED = (tf.float16, tf.bfloat16)  # measured in float32, as the writers measure them


class _Rows:
    """What one buffer variable gets when the step is read."""

    __slots__ = ("fixed", "measured", "var")

    def __init__(self, var: tf.Variable) -> None:
        self.var = var
        # (row, column) -> value known on the host
        self.fixed: dict[tuple[int, int], float] = {}
        # (row, column) -> (float32 scalar tensor, factor): the column's value is their product
        self.measured: dict[tuple[int, int], tuple[tf.Tensor, float]] = {}


class EagerRows:
    """Sentinel rows of one eager step with one replica, gathered as it runs and written into
    the buffer variables by :meth:`flush`.

    A cell written twice in a step (a second backward pass through the same call) keeps the
    later value, as a second write of the row would.
    """

    __slots__ = ("_axes", "_by_var")

    def __init__(self) -> None:
        self._by_var: dict[int, _Rows] = {}
        self._axes: dict[int, tf.Tensor] = {}  # rank -> every axis, for a full reduction

    def __bool__(self) -> bool:
        return bool(self._by_var)

    def forward(self, var: tf.Variable, row: int, output: Any, check: bool) -> bool:
        """Note that the layer of ``row`` ran forward, with the sum of ``output`` as its
        finiteness check where ``check`` asks for one.

        Returns:
            False, noting nothing, where the output is not a float32 (or narrower) eager
            tensor: the caller writes the row with :func:`.write_forward`.
        """
        if check:
            wide = _wide(output)
            if wide is None:
                return False
            self._rows(var).measured[(row, Col.FWD_SUM)] = (self._sum(wide), 1.0)
        self._rows(var).fixed[(row, Col.FWD)] = 1.0
        return True

    def backward(self, var: tf.Variable, row: int, grad: Any) -> bool:
        """Measure the sentinel of ``grad`` (its sum of squares, and its sum) for ``row``.

        Returns:
            False, measuring nothing, where ``grad`` is not a float32 (or narrower) eager
            tensor: the caller writes the row with :func:`.write_activation`.
        """
        wide = _wide(grad)
        if wide is None:
            return False
        rows = self._rows(var)
        # 2 * l2_loss, in float32 as square_sum computes it: the doubling is done at the flush.
        rows.measured[(row, Col.SQ)] = (_R.L2Loss(t=wide), 2.0)
        rows.measured[(row, Col.SUM)] = (self._sum(wide), 1.0)
        fixed = rows.fixed
        for col, value in _known_columns(grad._shape_tuple()):
            fixed[(row, col)] = value
        return True

    def flush(self) -> None:
        """Write every noted value into its buffer, and forget them."""
        try:
            for rows in self._by_var.values():
                if rows.measured:
                    tensors, factors = zip(*rows.measured.values(), strict=True)
                    values = _R.Mul(x=_R.Pack(values=list(tensors)),
                                    y=tf.constant(factors, tf.float32))
                    _R.ResourceScatterNdUpdate(
                        ref=rows.var.handle, indices=np.array(list(rows.measured), np.int64),
                        updates=_R.Cast(x=values, DstT=tf.float64))
                if rows.fixed:
                    _R.ResourceScatterNdUpdate(
                        ref=rows.var.handle, indices=np.array(list(rows.fixed), np.int64),
                        updates=np.fromiter(rows.fixed.values(), np.float64, len(rows.fixed)))
        finally:
            self.clear()

    def clear(self) -> None:
        """Forget every noted value (a step that is not recorded, or one already written)."""
        self._by_var.clear()

    def _rows(self, var: tf.Variable) -> _Rows:
        rows = self._by_var.get(id(var))
        if rows is None:
            rows = self._by_var[id(var)] = _Rows(var)
        return rows

    def _sum(self, wide: tf.Tensor) -> tf.Tensor:
        rank = len(wide._shape_tuple())
        axes = self._axes.get(rank)
        if axes is None:
            axes = self._axes[rank] = tf.constant(list(range(rank)), tf.int32)
        return _R.Sum(input=wide, axis=axes)


@functools.lru_cache(maxsize=1024)
def _known_columns(shape: tuple[int, ...]) -> tuple[tuple[int, float], ...]:
    """The columns of a sentinel row that the gradient's shape decides, with their values: the
    flag, the markers of what is not measured, numel, rank and dims (as
    :func:`.activation_row` writes them with ``full=False``)."""
    dims = [*shape[:MAX_DIMS], *[0] * (MAX_DIMS - min(len(shape), MAX_DIMS))]
    return ((Col.BWD, 1.0), (Col.ABSMAX, math.nan), (Col.LIVE, NOT_MEASURED),
            (Col.UNITS, -1.0), (Col.PRE_SQ, -1.0), (Col.NUMEL, float(math.prod(shape))),
            (Col.RANK, float(len(shape))),
            *((Col.DIMS + i, float(d)) for i, d in enumerate(dims)))


def _wide(tensor: Any) -> tf.Tensor | None:
    """``tensor`` in float32 where it is an eager float32, float16 or bfloat16 tensor, else
    None."""
    if type(tensor) is not EAGER_TENSOR:
        return None
    dtype = tensor.dtype
    if dtype == tf.float32:
        return tensor
    if dtype in _WIDENED:
        return _R.Cast(x=tensor, DstT=tf.float32)
    return None
