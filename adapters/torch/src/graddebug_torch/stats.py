"""Gradient statistics computed on the device, without host syncs or gradient-sized temporaries.

An activation gradient costs four reductions: its L2 norm, its sum, and the per-unit max and
min (one ``aminmax`` when the unit axis is last). The per-unit extremes give both ``absmax``
and the count of dead units, which the ``dead`` detector needs. NaN propagates through
``amax``/``amin``, so a NaN ``absmax`` marks a NaN gradient without counting entries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graddebug.interventions import Intervention

__all__ = ["acc_dtype", "activation_stats", "apply_intervention", "unit_absmax"]

_F32 = torch.float32


def acc_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype statistics of ``tensor`` are accumulated in: float64 for float64, else float32
    (half precision is upcast inside the reduction, with no copy of the tensor)."""
    return torch.float64 if tensor.dtype == torch.float64 else _F32


def unit_absmax(grad: Tensor, unit_dim: int | None) -> Tensor | None:
    """Per-unit max |g| over every axis but ``unit_dim``; None when there is no unit axis."""
    if unit_dim is None or grad.dim() < 2:
        return None
    if unit_dim == grad.dim() - 1 and grad.is_contiguous():
        low, high = torch.aminmax(grad.reshape(-1, grad.shape[-1]), dim=0)
    else:
        dims = [d for d in range(grad.dim()) if d != unit_dim]
        high, low = torch.amax(grad, dim=dims), torch.amin(grad, dim=dims)
    return torch.maximum(high, low.neg())


def activation_stats(grad: Tensor, units: Tensor | None
                     ) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor | None]:
    """Return ``(norm, sum, absmax)`` as 0-d device tensors in :func:`acc_dtype`, and the
    live-unit count.

    Nothing is stacked here: the step's scalars are stacked once when it closes.

    Args:
        grad: The gradient (dense).
        units: Its :func:`unit_absmax`, or None; then the live-unit count is None.
    """
    dtype = acc_dtype(grad)
    norm = torch.linalg.vector_norm(grad, dtype=dtype)
    total = grad.sum(dtype=dtype)
    if units is None:
        low, high = torch.aminmax(grad)
        absmax = torch.maximum(high, low.neg())
        alive = None
    else:
        absmax = units.max()
        alive = torch.count_nonzero(units)
    if absmax.dtype != dtype:
        absmax = absmax.to(dtype)
    return (norm, total, absmax), alive


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
