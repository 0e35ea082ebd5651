"""The records of one step's captures, built from their fetched statistics: a layer output's
row and a parameter's (:mod:`graddebug_torch.closing` fetches them)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from graddebug.records import Kind, Record, sums_record
from graddebug_torch.captures import Capture, Key, shape_text
from graddebug_torch.params import ParamRow

__all__ = ["activation_row", "param_record"]

_ACTIVATION, _PARAMETER = Kind.ACTIVATION.value, Kind.PARAMETER.value  # Enum.value is slow


def activation_row(step: int, key: Key, depth: int, first: Capture, numel: int, sq: float,
                    total: float, absmax: float, pre_sq: float | None, live: float | None,
                    sentinel: bool) -> Record:
    """The row of an output from its summed statistics (``first`` gives the shape and the
    units)."""
    if sentinel:
        # Squares are never negative, so the sum of squares is NaN exactly when an entry is;
        # it is Inf for an Inf entry or for finite entries whose squares overflow, which the
        # sum tells apart (it stays finite for the latter).
        nan = math.isnan(sq)
        inf = not nan and math.isinf(sq) and not math.isfinite(total)
        absmax, live = math.nan, None
    else:
        nan, inf = math.isnan(absmax), math.isinf(absmax)
    units = first.n_units
    return sums_record(
        step, key[0], key[1], _ACTIVATION, depth, first.shape, numel,
        math.sqrt(sq) if sq >= 0 else math.nan, total, absmax,
        (units - live) / units if live is not None and units else math.nan, nan, inf,
        math.sqrt(pre_sq) if pre_sq is not None else math.nan)


def param_record(step: int, p: ParamRow, grad: Tensor, norm: float,
                  extra: list[float] | None, weights: tuple[float, float],
                  flags: tuple[bool, bool] | None = None, zero: float = math.nan) -> Record:
    """A parameter's row. ``grad`` gives the shape and size (a sharded gradient's are those
    of the whole parameter); ``weights`` are its ``(weight_norm, update_norm)``; ``flags`` are
    its ``(nan, inf)`` where the caller knows them; ``zero`` is its ``zero_frac`` (a 1-D
    gradient's share of exact zeros; NaN for the others)."""
    nan, inf = flags if flags is not None else (False, False)
    if flags is None and not math.isfinite(norm):
        # Rare: a second sync, only for a gradient already known to be broken.
        nan = bool(torch.isnan(grad).any())
        inf = bool(torch.isinf(grad).any())
    if extra is None:  # param_stats="norm": no mean, std or absmax to derive
        return tuple.__new__(Record, (
            step, p.layer, p.tensor, _PARAMETER, p.depth, shape_text(grad.shape), grad.numel(),
            norm, math.nan, math.nan, math.nan, zero, nan, inf and not nan, math.nan, 0,
            *weights, math.nan))
    return sums_record(step, p.layer, p.tensor, _PARAMETER, p.depth, shape_text(grad.shape),
                       grad.numel(), norm, extra[0], extra[1], zero, nan, inf, math.nan, 0,
                       *weights)
