"""The statistics, computed inside the traced computation: one row of float32 numbers per
gradient, stacked into one array per batch, so that a step's numbers cross to the host together.

A layer-output row (:data:`ACT_COLUMNS`) holds the sum of squares and the sum (norm, mean and
std follow on the host, :func:`graddebug.records.sums_record`), the largest absolute entry, the
fraction of dead units (the last axis is the unit axis, as in Flax's channels-last layouts), the
sum of squares before an intervention, and flags. NaN and Inf are read from the sum of squares
and the absolute maximum (a NaN entry makes both NaN, an Inf entry makes the maximum Inf), so
they cost no pass of their own.

A parameter row (:data:`PARAM_COLUMNS`) holds the gradient's sum of squares (plus its sum and
absolute maximum with ``param_stats="full"``), the sums of squares of the weight and of the
update the optimizer applied, and for a 1-D gradient (a bias, a normalisation's scale) the
fraction of its entries that are exactly 0: the units that got no gradient from the batch. The
gradient's are exact. The weight's and the update's are read from the fixed strided samples of
the plan every adapter shares (:func:`graddebug.sampling.plan`): reading every entry of both
tripled the bytes the statistics read, and on the benchmark's MLP doubled what the statistics
cost inside the step (the Performance page has the numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from graddebug.sampling import plan

__all__ = [
    "ACT_COLUMNS",
    "FORWARD_INF",
    "FORWARD_NAN",
    "PARAM_COLUMNS",
    "activation_row",
    "forward_code",
    "param_rows",
    "sampled_sumsq",
    "units_of",
]

ACT_COLUMNS = ("sumsq", "total", "absmax", "zero_frac", "pre_sumsq", "present", "forward_bad")
"""The columns of a layer-output row: ``present`` is 0 where no cotangent reached the output
(a symbolic zero: the graph is cut above it), ``forward_bad`` the output's :func:`forward_code`
in the forward pass."""

PARAM_COLUMNS = ("sumsq", "total", "absmax", "weight_sumsq", "update_sumsq", "zero_frac")
"""The columns of a parameter row (NaN where not measured)."""

def _nan() -> jax.Array:
    """A float32 NaN made where it is used: a module-level jax array would be a constant that
    every trace closes over, which jax 0.10's dispatch once fed one argument short."""
    return jnp.full((), math.nan, jnp.float32)


def units_of(shape: Sequence[int]) -> int:
    """Number of units (last-axis entries) of a gradient with at least two axes, else 0."""
    return int(shape[-1]) if len(shape) >= 2 else 0


FORWARD_NAN, FORWARD_INF = 1.0, 2.0
"""The codes of :func:`forward_code` for an output that held NaN, or Inf and no NaN."""


def forward_code(x: Any) -> jax.Array:
    """0.0 where every entry of ``x`` is finite, ``FORWARD_NAN`` where one is NaN, else
    ``FORWARD_INF`` where one is infinite (a float32 scalar, computed on the device).

    One reduction, the largest absolute entry, which is NaN where an entry is (XLA's maximum
    propagates NaN) and else infinite where one is: several times faster, measured, than
    ``any(isnan)`` and ``any(isinf)``, two passes with a boolean temporary each (the
    Performance page has the timings).
    """
    if not jnp.size(x):
        return jnp.zeros((), jnp.float32)
    top = jnp.max(jnp.abs(x))
    return jnp.where(jnp.isnan(top), FORWARD_NAN,
                     jnp.where(jnp.isinf(top), FORWARD_INF, 0.0)).astype(jnp.float32)


def activation_row(grad: Any, pre: Any, forward_bad: Any) -> jax.Array:
    """The row of one layer-output cotangent.

    Args:
        grad: The cotangent that flows on (after any intervention), or None where no
            cotangent reached the output.
        pre: The cotangent before an intervention, or None where none acted.
        forward_bad: The output's :func:`forward_code` in the forward pass.
    """
    bad = jnp.asarray(forward_bad, jnp.float32)
    if grad is None:
        zero = jnp.float32(0.0)
        return jnp.stack([zero, zero, zero, _nan(), _nan(), zero, bad])
    g = grad.astype(jnp.float32)
    sumsq = jnp.sum(g * g)
    total = jnp.sum(g)
    if g.ndim >= 3 and g.size:
        # A unit is dead where its largest |g| over the batch axes is 0; that per-unit maximum
        # also gives the absolute maximum, one pass for both, without a boolean temporary of
        # the gradient's size. Measured on the shared 2-core CPU (eight gradients in one
        # jitted call, three runs): (8, 32, 256) 230 us against 490-700 us for two passes;
        # (8, 32, 64) 90-105 us against 140-220 us. On 2-D gradients (64, 256) it was slower
        # in two runs of three (190-204 us against 145-158 us), so they keep two passes.
        per_unit = jnp.max(jnp.abs(g), axis=tuple(range(g.ndim - 1)))
        absmax = jnp.max(per_unit)
        zero_frac = jnp.mean((per_unit == 0).astype(jnp.float32))
    elif g.ndim == 2 and g.size:
        absmax = jnp.max(jnp.abs(g))
        zero_frac = jnp.mean(jnp.all(g == 0, axis=0).astype(jnp.float32))
    else:
        absmax = jnp.max(jnp.abs(g)) if g.size else jnp.float32(0.0)
        zero_frac = _nan()
    if pre is None:
        pre_sumsq = _nan()
    else:
        p = pre.astype(jnp.float32)
        pre_sumsq = jnp.sum(p * p)
    return jnp.stack([sumsq, total, absmax, zero_frac, pre_sumsq, jnp.float32(1.0), bad])


def sampled_sumsq(leaf: Any, stride: int) -> jax.Array:
    """The sum of squares of ``leaf``: exact where ``stride`` is 1, else that of every
    ``stride``-th entry (:func:`graddebug.sampling.plan`) times ``numel / taken``."""
    x = jnp.asarray(leaf)
    numel = int(x.size)
    part = (jnp.ravel(x)[::stride] if stride > 1 else x).astype(jnp.float32)
    total = jnp.sum(part * part)
    return total * (numel / int(part.size)) if stride > 1 else total


def param_rows(grads: Sequence[Any], updates: Sequence[Any] | None,
               weights: Sequence[Any] | None, full: bool) -> jax.Array:
    """The rows of the parameter gradients, as one ``(len(grads), 6)`` float32 array
    (:data:`PARAM_COLUMNS`).

    Args:
        grads: The gradient leaves.
        updates: The updates the optimizer applies, aligned with ``grads``; None if unknown.
        weights: The parameters the gradients were taken at, aligned; None if unknown.
        full: Also measure each gradient's sum and absolute maximum.

    The weights' and updates' sums of squares are :func:`sampled_sumsq`'s.
    """
    rows = []
    strides = [s.stride for s in plan([jnp.shape(g) for g in grads])]
    for i, grad in enumerate(grads):
        g = jnp.asarray(grad).astype(jnp.float32)
        total = jnp.sum(g) if full else _nan()
        absmax = (jnp.max(jnp.abs(g)) if g.size else jnp.float32(0.0)) if full else _nan()
        weight = sampled_sumsq(weights[i], strides[i]) if weights is not None else _nan()
        update = sampled_sumsq(updates[i], strides[i]) if updates is not None else _nan()
        zero = jnp.mean((g == 0).astype(jnp.float32)) if g.ndim == 1 and g.size else _nan()
        rows.append(jnp.stack([jnp.sum(g * g), total, absmax, weight, update, zero]))
    if not rows:
        return jnp.zeros((0, len(PARAM_COLUMNS)), jnp.float32)
    return jnp.stack(rows)
