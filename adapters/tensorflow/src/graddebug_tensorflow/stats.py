"""Gradient statistics as TF ops, laid out as rows of the adapter's state buffers.

The ops run wherever the gradient is computed: eagerly, inside a ``tf.function`` trace, or in
the graph ``model.fit`` compiles. A gradient costs four reductions: the sum of squares
(``l2_loss``, one fused kernel with no squared temporary), the sum, and the per-unit max and
min. The per-unit extremes give ``absmax`` and the number of live units. NaN propagates through
all four, so no entry is counted unless asked.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from graddebug.capture.layers import Intervention

__all__ = [
    "ACT_WIDTH",
    "EAGER_TENSOR",
    "MAX_DIMS",
    "PARAM_WIDTH",
    "Col",
    "FlatWriter",
    "activation_row",
    "apply_intervention",
    "compiled",
    "flat_entry",
    "forward_row",
    "param_row",
    "square_sum",
    "unscale_param_rows",
    "unscale_row",
    "write_activation",
    "write_forward",
]

MAX_DIMS = 6
"""Dimensions of a gradient's shape stored in its row; deeper shapes store the first ones."""


class Col:
    """Column indices of an activation row."""

    FWD = 0  # 1 once the layer ran forward in the step
    FWD_SUM = 1  # sum of the forward output: non-finite iff the output is
    BWD = 2  # 1 once a gradient reached the output
    SQ = 3
    SUM = 4
    ABSMAX = 5
    LIVE = 6  # units whose gradient is non-zero somewhere in the batch (-1 without units;
    # NOT_MEASURED on a step that measured the sentinel only)
    UNITS = 7
    PRE_SQ = 8  # sum of squares before an intervention (-1 when none acted)
    NUMEL = 9
    RANK = 10
    DIMS = 11


NOT_MEASURED = -2.0
"""``Col.LIVE`` of a row whose extremes (``absmax``, live units) were not measured: a step that
is not full (:mod:`graddebug.capture.tiers`)."""

ACT_WIDTH = Col.DIMS + MAX_DIMS
PARAM_WIDTH = 5  # written, sum of squares, sum, absmax, zero fraction
_ROW = tf.float64


def square_sum(grad: tf.Tensor) -> tf.Tensor:
    """Sum of squares of ``grad``, in float32 or wider, with no gradient-sized temporary."""
    wide = grad if grad.dtype in (tf.float32, tf.float64) else tf.cast(grad, tf.float32)
    return 2.0 * tf.nn.l2_loss(wide)


def _scalar(value: Any) -> tf.Tensor:
    return tf.cast(value, _ROW)


def forward_row(output: tf.Tensor, check: bool = True) -> tf.Tensor:
    """``[1, sum(output)]``: the forward flag and the one-reduction finiteness check; ``[1, 0]``
    without the ``check`` (a layer that cannot make a non-finite value)."""
    if not check:
        return tf.constant([1.0, 0.0], _ROW)
    wide = output if output.dtype in (tf.float32, tf.float64) else tf.cast(output, tf.float32)
    return tf.stack([tf.constant(1.0, _ROW), _scalar(tf.reduce_sum(wide))])


def _extremes(wide: tf.Tensor, unit_axis: int | None) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """``absmax``, live units and units of a gradient (units -1 without a unit axis)."""
    rank = wide.shape.rank
    if unit_axis is not None and rank is not None and rank >= 2:
        axes = [a for a in range(rank) if a != unit_axis]
        per_unit = tf.maximum(tf.reduce_max(wide, axes), -tf.reduce_min(wide, axes))
        return (_scalar(tf.reduce_max(per_unit)), _scalar(tf.math.count_nonzero(per_unit)),
                _scalar(tf.size(per_unit)))
    absmax = tf.maximum(tf.reduce_max(wide), -tf.reduce_min(wide))
    return _scalar(absmax), tf.constant(-1.0, _ROW), tf.constant(-1.0, _ROW)


def _unmeasured() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    return (tf.constant(math.nan, _ROW), tf.constant(NOT_MEASURED, _ROW),
            tf.constant(-1.0, _ROW))


def activation_row(grad: tf.Tensor, unit_axis: int | None, pre: tf.Tensor | None,
                   full: Any = True) -> tf.Tensor:
    """Columns ``BWD`` to the end of an activation row for ``grad``.

    Args:
        grad: The gradient as it flows on (after any intervention).
        unit_axis: The axis of units (features, channels), or None for no unit axis.
        pre: The gradient before an intervention, or None when none acted.
        full: Measure the extremes too: a bool, or a boolean tensor read in the graph.
    """
    wide = grad if grad.dtype in (tf.float32, tf.float64) else tf.cast(grad, tf.float32)
    if isinstance(full, bool):
        absmax, live, units = _extremes(wide, unit_axis) if full else _unmeasured()
    else:
        absmax, live, units = tf.cond(full, lambda: _extremes(wide, unit_axis), _unmeasured)
    shape = tf.shape(wide, out_type=tf.int64)
    dims = tf.pad(shape[:MAX_DIMS], [[0, MAX_DIMS - tf.minimum(tf.size(shape), MAX_DIMS)]])
    head = tf.stack([
        tf.constant(1.0, _ROW),
        _scalar(square_sum(grad)),
        _scalar(tf.reduce_sum(wide)),
        absmax,
        live,
        units,
        _scalar(square_sum(pre)) if pre is not None else tf.constant(-1.0, _ROW),
        _scalar(tf.size(wide, out_type=tf.int64)),
        _scalar(tf.size(shape)),
    ])
    return tf.concat([head, _scalar(dims)], 0)


def unscale_row(row: tf.Tensor, scale: Any) -> tf.Tensor:
    """Divide the loss scale out of the statistics of a row from :func:`activation_row`:
    sums of squares by ``scale**2``, the sum and ``absmax`` by ``scale``."""
    s = tf.cast(tf.convert_to_tensor(scale), _ROW)
    one = tf.constant(1.0, _ROW)
    by_column = {Col.SQ: s * s, Col.SUM: s, Col.ABSMAX: s, Col.PRE_SQ: s * s}
    divisors = tf.stack([by_column.get(c, one) for c in range(Col.BWD, ACT_WIDTH)])
    unscaled = row / divisors
    # PRE_SQ is -1 where no intervention acted: keep the marker.
    return tf.where(tf.range(ACT_WIDTH - Col.BWD) == Col.PRE_SQ - Col.BWD,
                    tf.where(row < 0, row, unscaled), unscaled)


def unscale_param_rows(rows: tf.Tensor, scale: Any) -> tf.Tensor:
    """Divide the loss scale out of rows from :func:`param_row`: the sum of squares by
    ``scale**2``, the sum and ``absmax`` by ``scale``. Cheaper than unscaling the gradients
    themselves, which would take a gradient-sized temporary each."""
    s = tf.cast(tf.convert_to_tensor(scale), _ROW)
    one = tf.constant(1.0, _ROW)
    return rows / tf.stack([one, s * s, s, s, one])


def param_row(grad: Any, full: bool) -> tf.Tensor:
    """``[1, sum of squares, sum, absmax, zero fraction]`` of a parameter gradient (sum and
    absmax NaN unless ``full``; the share of exactly-zero entries for a 1-D gradient, a bias
    whose zeros are the units that got no gradient from the batch, NaN for the others).
    ``tf.IndexedSlices`` are measured on their stored rows."""
    nan = tf.constant(float("nan"), _ROW)
    if isinstance(grad, tf.IndexedSlices):
        grad = grad.values
        zero = nan
    elif grad.shape.rank == 1 and grad.shape[0] != 0:
        zero = _scalar(tf.reduce_mean(tf.cast(tf.equal(grad, 0), _ROW)))
    else:
        zero = nan
    if full:
        wide = grad if grad.dtype in (tf.float32, tf.float64) else tf.cast(grad, tf.float32)
        total = _scalar(tf.reduce_sum(wide))
        absmax = _scalar(tf.maximum(tf.reduce_max(wide), -tf.reduce_min(wide)))
    else:
        total = absmax = nan
    return tf.stack([tf.constant(1.0, _ROW), _scalar(square_sum(grad)), total, absmax, zero])


def apply_intervention(grad: tf.Tensor, spec: Intervention) -> tf.Tensor:
    """Apply mask, scale, clip-by-value and clip-by-norm, in that order."""
    out = grad
    if spec.mask is not None:
        if spec.mask_is_callable:
            out = spec.mask(out)
        else:
            mask = tf.cast(spec.mask, tf.bool)
            out = tf.where(mask, out, tf.zeros_like(out))
    if spec.scale is not None:
        out = out * tf.cast(spec.scale, out.dtype)
    if spec.clip_value is not None:
        out = tf.clip_by_value(out, -spec.clip_value, spec.clip_value)
    if spec.clip_norm is not None:
        # g * min(1, c / ||g||), as the core documents: no epsilon, exactly g below c.
        norm = tf.sqrt(square_sum(out))
        factor = tf.minimum(tf.constant(1.0, norm.dtype), spec.clip_norm / norm)
        out = out * tf.cast(factor, out.dtype)
    return out


def write_forward(var: tf.Variable, row: Any, output: tf.Tensor, check: bool = True) -> None:
    """Write the forward flag and finiteness sum of ``output`` (without ``check``: 0) into row
    ``row`` of ``var``."""
    var[row, Col.FWD : Col.BWD].assign(forward_row(output, check))


def write_activation(var: tf.Variable, row: Any, grad: tf.Tensor, pre: tf.Tensor | None,
                     unit_axis: int | None, scale: Any, full: Any = True) -> None:
    """Write the statistics of ``grad`` into row ``row`` of ``var``, dividing out the loss
    ``scale`` when one is given; the extremes only where ``full`` (see
    :func:`activation_row`)."""
    values = activation_row(grad, unit_axis, pre, full)
    if scale is not None:
        values = unscale_row(values, scale)
    var[row, Col.BWD :].assign(values)


def compiled(function: Any) -> Any:
    """``function`` as one ``tf.function`` call: in eager mode that is one dispatch instead of
    a dozen ops per gradient, and the faster. Named ``graddebug_*`` so that TF's warning about
    frequent retracing, which a new model's shapes cause, is not shown for it."""
    @functools.wraps(function)
    def run(*args: Any) -> Any:
        return function(*args)

    run.__name__ = run.__qualname__ = f"graddebug_{function.__name__}"
    return tf.function(run, reduce_retracing=True, autograph=False)


def flat_entry(traced: Any) -> Callable[[list[Any]], Any] | None:
    """Call a concrete function with its flat inputs (every tensor argument, in order),
    without matching the arguments to a trace again: a few hundred microseconds less per call
    than calling the ``tf.function``. None where this TF lacks the private entry point."""
    call_flat = getattr(traced, "_call_flat", None)
    if call_flat is None:
        return None
    return lambda inputs: call_flat(inputs, traced.captured_inputs)


try:  # the class of plain variables, which FlatWriter passes by their handle
    from tensorflow.python.ops.resource_variable_ops import (
        ResourceVariable as _RESOURCE_VARIABLE,  # type: ignore[attr-defined,unused-ignore]
    )
except ImportError:  # pragma: no cover - a TF that moved it: every call goes the slow way
    _RESOURCE_VARIABLE = None

EAGER_TENSOR = type(tf.constant(0.0))
"""The class of eager tensors, whose ``_shape_tuple()`` reads the shape without a TensorShape."""


class FlatWriter:
    """A row writer (:func:`write_forward`, :func:`write_activation`) for eager code, called
    through the flat entry point of its trace.

    Called as a ``tf.function``, each call matches its arguments to a trace again, which costs
    several times the write itself (the Performance page has the timings), so that an eager step
    of many layer outputs spent most of graddebug's time there. A call whose arguments after the
    variable, the row and the tensor are all Python values (None, bools, ints: they pick the
    trace), with an eager tensor and a plain resource variable, goes through the trace kept for
    them, the tensor's shape and dtype and the variable's; any other call (a loss scale among
    the arguments, a symbolic tensor, a distributed variable rather than one of its components)
    goes through the ``tf.function``.

    Args:
        function: The writer as one ``tf.function`` (:func:`compiled`), shared by every
            FlatWriter of it: a trace is made once per process.
    """

    __slots__ = ("_entries", "_function")

    def __init__(self, function: Any) -> None:
        self._function = function
        self._entries: dict[tuple[Any, ...], Callable[[list[Any]], Any] | None] = {}

    @property
    def function(self) -> Any:
        """The ``tf.function`` it calls."""
        return self._function

    def __call__(self, var: Any, row: tf.Tensor, tensor: tf.Tensor, *rest: Any) -> None:
        """Write the row, as ``function(var, row, tensor, *rest)`` would."""
        if (type(tensor) is not EAGER_TENSOR or type(var) is not _RESOURCE_VARIABLE
                or not all(r is None or type(r) is bool or type(r) is int for r in rest)):
            self._function(var, row, tensor, *rest)
            return
        key = (tensor._shape_tuple(), tensor.dtype, var.shape, var.dtype, rest)
        try:
            entry = self._entries[key]
        except KeyError:
            entry = self._entries[key] = flat_entry(
                self._function.get_concrete_function(var, row, tensor, *rest))
        if entry is None:  # a TF without the flat entry point
            self._function(var, row, tensor, *rest)
        else:
            entry([var.handle, row, tensor])


class _OwnRetracing(logging.Filter):
    """Drops TF's frequent-retracing warning when it is about graddebug's own functions."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "triggered tf.function retracing" not in message or "graddebug_" not in message


logging.getLogger("tensorflow").addFilter(_OwnRetracing())
