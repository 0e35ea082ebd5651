"""Gradient statistics computed on the device, without host syncs or gradient-sized temporaries.

A captured gradient costs four reductions in its hook: the sum of squares (a BLAS ``dot`` on the
flat view, 2-4x faster than ``vector_norm`` on CPU), the sum, and the per-unit max and min
(``amax``/``amin``; the fused per-axis ``aminmax`` is 5-11x slower on CPU). The per-unit
extremes give ``absmax`` and the count of dead units; they are combined for all captures of a
step at once, in :func:`unit_summary`. NaN propagates through ``dot``, ``amax`` and ``amin``, so
a NaN ``absmax`` marks a NaN gradient without counting entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from graddebug.capture.layers import Intervention

__all__ = [
    "acc_dtype",
    "apply_intervention",
    "finiteness",
    "square_sum",
    "unit_extremes",
    "unit_summary",
    "whole_absmax",
]

_BLAS = (torch.float32, torch.float64)


def acc_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype statistics of ``tensor`` are accumulated in: float64 for float64, else float32
    (half precision is upcast inside the reduction, with no copy of the tensor)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def finiteness(tensor: Tensor) -> Tensor:
    """One number that is finite exactly when ``tensor`` is, for the forward check.

    An activation costs one sum (the cheapest reduction here; a float64 sum is 36x slower on
    an 8 MB output). A tensor that needs no gradient (attention masks, position tables) may be
    full of ``finfo.min``, whose float32 sum overflows to -inf: its largest magnitude, from
    ``amax`` and ``amin``, cannot overflow. Such tensors are few and small.
    """
    data = tensor.detach()
    if tensor.requires_grad or data.numel() == 0:
        return data.sum(dtype=acc_dtype(tensor))
    return torch.maximum(data.amax(), data.amin().neg()).to(acc_dtype(tensor))


def square_sum(grad: Tensor) -> Tensor:
    """Sum of squares of ``grad`` as a 0-d tensor in :func:`acc_dtype`."""
    if grad.dtype in _BLAS and grad.is_contiguous():
        flat = grad.view(-1)
        out: Tensor = torch.dot(flat, flat)
    else:
        out = torch.linalg.vector_norm(grad, dtype=acc_dtype(grad)).square()
    return out


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
            mask = spec.mask
            out = torch.where(mask.to(dtype=torch.bool, device=out.device), out, 0)
    if spec.scale is not None:
        out = out * spec.scale
    if spec.clip_value is not None:
        out = out.clamp(-spec.clip_value, spec.clip_value)
    if spec.clip_norm is not None:
        norm = torch.linalg.vector_norm(out, dtype=acc_dtype(out))
        factor = (spec.clip_norm / norm).clamp(max=1.0).to(out.dtype)
        out = out * factor
    return out
