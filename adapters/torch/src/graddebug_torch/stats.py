"""Gradient statistics computed on the device, without host syncs or gradient-sized temporaries.

A captured gradient costs four reductions in its hook: the sum of squares (a BLAS ``dot`` on the
flat view, faster than ``vector_norm`` on CPU), the sum (on CPU, for some sizes, a ``dot`` with a
ones vector: see :class:`DotSums`), and the per-unit max and min (``amax``/``amin``; the fused
per-axis ``aminmax`` is slower on CPU); a sentinel step measures the first two only. The
measurements behind these choices are on the Performance page (``docs/performance.md``).
The per-unit extremes give ``absmax`` and the count of dead units; they are combined for all
captures of a step at once, in :func:`unit_summary`. NaN propagates through ``dot``, ``amax``
and ``amin``, so a NaN ``absmax`` marks a NaN gradient without counting entries. Parameter
gradients are measured when the step closes, their norms in one fused pass
(:func:`param_norms`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from graddebug.capture.layers import Intervention
from graddebug_torch.distributed import is_sharded, replicated_like

__all__ = [
    "DOT_SUM_LIMIT",
    "PARALLEL_GRAIN",
    "DotSums",
    "acc_dtype",
    "apply_intervention",
    "finiteness",
    "nonzero_counts",
    "param_norms",
    "square_sum",
    "stack_scalars",
    "sum_and_absmax",
    "unit_extremes",
    "unit_summary",
    "whole_absmax",
]

_BLAS = (torch.float32, torch.float64)


def acc_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype statistics of ``tensor`` are accumulated in: float64 for float64, else float32
    (half precision is upcast inside the reduction, with no copy of the tensor)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def finiteness(tensor: Tensor, sums: DotSums | None = None) -> Tensor:
    """One number that is finite exactly when ``tensor`` is, for the forward check.

    An activation costs one sum (the cheapest reduction here, in the tensor's own precision: a
    float64 sum of a large float32 output is many times slower). A tensor that needs no
    gradient (attention masks, position tables) may be full of ``finfo.min``, whose float32 sum
    overflows to -inf: its largest magnitude, from ``amax`` and ``amin``, cannot overflow. Such
    tensors are few and small. ``sums``, where given, takes the sum.
    """
    data = tensor.detach()
    if tensor.requires_grad or data.numel() == 0:
        return data.sum(dtype=acc_dtype(tensor)) if sums is None else sums.total(data)
    return torch.maximum(data.amax(), data.amin().neg()).to(acc_dtype(tensor))


def stack_scalars(scalars: Sequence[Tensor]) -> Tensor:
    """Stack 0-d tensors; mixed dtypes (a float64 tensor among float32 ones) go to float64."""
    first = scalars[0].dtype
    if any(s.dtype != first for s in scalars):
        return torch.stack([s.to(torch.float64) for s in scalars])
    return torch.stack(list(scalars))


def square_sum(grad: Tensor) -> Tensor:
    """Sum of squares of ``grad`` as a 0-d tensor in :func:`acc_dtype`."""
    if grad.dtype in _BLAS and grad.is_contiguous():
        flat = grad.view(-1)
        out: Tensor = torch.dot(flat, flat)
    else:
        out = torch.linalg.vector_norm(grad, dtype=acc_dtype(grad)).square()
    return out


PARALLEL_GRAIN = 32768
"""ATen's grain size: a CPU reduction of more entries than this is split over threads."""

DOT_SUM_LIMIT = 1 << 17
"""CPU tensors of more than :data:`PARALLEL_GRAIN` and at most this many entries are summed by a
``dot`` with ones (:class:`DotSums`)."""


class DotSums:
    """Sums of CPU tensors as a BLAS ``dot`` with a ones vector where that is cheaper, for the
    per-step statistics.

    ATen splits a reduction of more than :data:`PARALLEL_GRAIN` entries over its intra-op
    threads. Inside a training step, for a tensor that fits in cache, the split costs more than
    it saves, and ``dot`` with ones, which does not split, is the faster. Larger tensors stream
    from memory, where ``dot`` reads twice the bytes of ``sum`` and loses, and on one thread
    ``sum`` never splits and wins too (the profiles are on the Performance page). So
    a contiguous float32 or float64 CPU tensor of more than :data:`PARALLEL_GRAIN` and at most
    :data:`DOT_SUM_LIMIT` entries is summed as its ``dot`` with ones when torch runs more than
    one thread; other tensors use ``sum``. One ones buffer per dtype is kept, as long as the
    longest tensor summed so (a power of two, at most 512 KB in float32), with a view of it per
    length. The sum is NaN when an entry is, and stays finite when only the squares of finite
    entries overflow.
    """

    __slots__ = ("_buffers", "_views")

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, Tensor] = {}
        self._views: dict[tuple[torch.dtype, int], Tensor] = {}

    def sentinel(self, grad: Tensor) -> tuple[Tensor, Tensor]:
        """``(sum of squares, sum)`` of ``grad`` as 0-d tensors in :func:`acc_dtype`: what
        every recorded step measures of a layer-output gradient."""
        if grad.dtype in _BLAS and grad.is_contiguous():
            flat = grad.view(-1)
            return torch.dot(flat, flat), self._flat_total(flat)
        return square_sum(grad), grad.sum(dtype=acc_dtype(grad))

    def total(self, tensor: Tensor) -> Tensor:
        """The sum of ``tensor`` as a 0-d tensor in :func:`acc_dtype`."""
        if tensor.dtype in _BLAS and tensor.is_contiguous():
            return self._flat_total(tensor.view(-1))
        return tensor.sum(dtype=acc_dtype(tensor))

    def _flat_total(self, flat: Tensor) -> Tensor:
        n = flat.numel()
        if PARALLEL_GRAIN < n <= DOT_SUM_LIMIT and flat.is_cpu and torch.get_num_threads() > 1:
            ones = self._views.get((flat.dtype, n))
            return torch.dot(flat, ones if ones is not None else self._ones(flat))
        return flat.sum()

    def _ones(self, flat: Tensor) -> Tensor:
        """A ones vector as long as ``flat``, a view of the dtype's buffer (grown as needed)."""
        dtype, n = flat.dtype, flat.numel()
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < n:
            size = min(1 << (n - 1).bit_length(), DOT_SUM_LIMIT)  # n > PARALLEL_GRAIN
            buffer = self._buffers[dtype] = torch.ones(size, dtype=dtype)
            for key in [k for k in self._views if k[0] == dtype]:
                del self._views[key]  # views of the old buffer would keep it alive
        view = self._views[dtype, n] = buffer[:n]
        return view


def unit_extremes(grad: Tensor, unit_dim: int | None) -> tuple[Tensor, Tensor] | None:
    """Per-unit ``(max, min)`` over every axis but ``unit_dim``; None without a unit axis."""
    if unit_dim is None or grad.dim() < 2:
        return None
    if unit_dim == grad.dim() - 1 and grad.is_contiguous():
        rows = grad.view(-1, grad.shape[-1])
        return rows.amax(0), rows.amin(0)
    dims = [d for d in range(grad.dim()) if d != unit_dim]
    return grad.amax(dims), grad.amin(dims)


def whole_absmax(grad: Tensor) -> Tensor:
    """``max |g|`` of a gradient with no unit axis, without a gradient-sized temporary."""
    low, high = torch.aminmax(grad)
    return torch.maximum(high, low.neg())


def unit_summary(highs: Sequence[Tensor], lows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Per capture, ``absmax`` and the number of live units, for same-width captures at once.

    Args:
        highs: Per-unit maxima, one 1-D tensor of equal length per capture.
        lows: The matching per-unit minima.

    Returns:
        ``(absmax, live)``: 1-D tensors with one entry per capture.
    """
    per_unit = torch.maximum(torch.stack(list(highs)), torch.stack(list(lows)).neg())
    return per_unit.amax(1), torch.count_nonzero(per_unit, dim=1)


def apply_intervention(grad: Tensor, spec: Intervention) -> Tensor:
    """Apply mask, scale, clip-by-value and clip-by-norm, in that order, out of place."""
    out = grad
    if spec.mask is not None:
        if spec.mask_is_callable:
            out = spec.mask(out)
        else:
            mask = spec.mask.to(dtype=torch.bool, device=out.device)
            if is_sharded(out) and not is_sharded(mask):  # the whole output's mask
                mask = replicated_like(mask, out)
            out = torch.where(mask, out, 0)
    if spec.scale is not None:
        out = out * spec.scale
    if spec.clip_value is not None:
        out = out.clamp(-spec.clip_value, spec.clip_value)
    if spec.clip_norm is not None:
        norm = torch.linalg.vector_norm(out, dtype=acc_dtype(out))
        factor = (spec.clip_norm / norm).clamp(max=1.0).to(out.dtype)
        out = out * factor
    return out


_NATIVE = (torch.float32, torch.float64)
"""Dtypes whose norms ``_foreach_norm`` accumulates in their own precision without loss."""


def param_norms(grads: Sequence[Tensor], groups: Sequence[int]) -> list[tuple[list[int], Tensor]]:
    """L2 norms of ``grads``, as ``(positions, norms)`` parts.

    On CPU ``_foreach_norm`` is a loop of one kernel per tensor; the gradients of one group
    (``groups``, from :attr:`~graddebug_torch.params.ParamRow.group`: small parameters of one
    shape, dtype and device; -1 for none) are stacked instead, one kernel per group, which on
    a model of many small layers is an order of magnitude faster. A group that no longer
    stacks (a parameter moved since) is measured one gradient at a time.

    Args:
        grads: The gradients (dense).
        groups: Each gradient's group number, -1 for none.

    Returns:
        ``(positions in grads, 1-D norms)`` parts, together covering every gradient.
    """
    small: dict[int, list[int]] = {}
    large: list[int] = []
    for i, group in enumerate(groups):
        if group < 0:
            large.append(i)
        else:
            small.setdefault(group, []).append(i)
    parts = []
    for order in small.values():
        if len(order) > 1:
            try:
                stacked = torch.stack([grads[i] for i in order])
            except RuntimeError:
                large += order
                continue
            acc = torch.float64 if stacked.dtype == torch.float64 else torch.float32
            parts.append((order, torch.linalg.vector_norm(stacked.reshape(len(order), -1),
                                                          dim=1, dtype=acc)))
        else:
            large += order
    # _foreach_norm returns a half gradient's norm in half precision, which overflows past
    # 65504: half gradients are reduced in float32, the others in their own dtype.
    native = [i for i in large if grads[i].dtype in _NATIVE]
    upcast = [i for i in large if grads[i].dtype not in _NATIVE]
    if native:
        parts.append((native, stack_scalars(torch._foreach_norm([grads[i] for i in native]))))
    if upcast:
        parts.append((upcast, stack_scalars(torch._foreach_norm(
            [grads[i] for i in upcast], 2, dtype=torch.float32))))
    return parts


def sum_and_absmax(grad: Tensor) -> Tensor:
    """``[sum, max |g|]`` of a parameter gradient, for ``param_stats="full"`` (``-inf`` for
    the largest of none: a rank's empty slice of a sharded gradient, which adds nothing)."""
    if grad.numel() == 0:
        return torch.tensor([0.0, -torch.inf], dtype=acc_dtype(grad), device=grad.device)
    low, high = torch.aminmax(grad)
    return stack_scalars([grad.sum(dtype=acc_dtype(grad)), torch.maximum(high, low.neg())])



def nonzero_counts(vectors: Sequence[Tensor]) -> Tensor:
    """How many entries of each of ``vectors`` (1-D gradients on one device) are not 0, as one
    float32 tensor: a bias's zero entries are the units that got no gradient from the whole
    batch. One ``_foreach_norm`` of order 0 (its count of non-zero entries) for them all, in
    float32 (float64 where one is: the norm's dtype may only widen), exact to 2**24 entries."""
    wide = any(v.dtype == torch.float64 for v in vectors)
    dtype = torch.float64 if wide else torch.float32
    return stack_scalars(torch._foreach_norm(list(vectors), 0, dtype=dtype))
