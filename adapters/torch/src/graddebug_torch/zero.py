"""DeepSpeed ZeRO's gradient partitions: each rank's piece of every parameter's gradient, read
where DeepSpeed keeps it between the accumulation boundary's reduction and the optimizer's
update, and the rows it makes.

DeepSpeed leaves no gradient on the parameters under ZeRO (``p.grad`` is None once a backward
pass ends): each rank keeps the averaged, reduced gradient of its own partition of the flat
parameters, and only that rank's optimizer applies it. One rank's rows of those pieces are a
wrong number that looks right (each rank printed its own norm, none the global one), so each
piece is recorded with a :class:`~graddebug.adapter.ranks.Share` that says it is a piece of the
parameter's logical gradient, and the core adds the pieces' sums of squares over the ranks
(:mod:`graddebug.adapter.ranks`), in the one collective of the step. The pieces are read
through DeepSpeed's local accessors, never ``safe_get_full_grad`` (which all-gathers a full
fp32 copy of every parameter):

- ZeRO-3 (a parameter with ``ds_id``): ``optimizer.get_local_fp32_grad_for_param(p)``, this
  rank's slice of the flat parameter, whose padding past ``p.ds_numel`` is cut off;
- ZeRO-1 and -2 (a parameter with ``_hp_mapping``): the fragment
  ``p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group)`` of the averaged gradients
  (narrowed to the fragment's address where the optimizer keeps the whole parameter's
  buffer); a parameter whose mapping is None has no piece on this rank.

A parameter with neither mark is not held by the ZeRO optimizer (left out of its parameter
groups): its ``p.grad`` is this rank's unreduced gradient, and it gets no row (the engine's
adapter warns once, naming it).

The loss scale (fp16) is divided out. Sums of squares and sums are taken in fp32 for bf16 and
fp16 pieces (:func:`graddebug_torch.stats.acc_dtype`). A parameter whose post-accumulate hook
did not run in any micro-batch of the update got no gradient (its partition holds zeros): it
gets the ``no_grad`` event of one process, not a row of zeros.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from graddebug.adapter import StepResult
from graddebug.adapter.ranks import WHOLE, Share
from graddebug.records import Event, EventKind, Kind, Record, sums_record
from graddebug_torch.params import ParamRow, TorchParam
from graddebug_torch.sharding import RankRows
from graddebug_torch.stats import acc_dtype, square_sum, whole_absmax

__all__ = ["ZeroGrads", "ZeroRows", "local_piece", "logical_shape", "partitioned"]

_PARAMETER = Kind.PARAMETER.value
_NO_GRAD = EventKind.NO_GRAD.value

Key = tuple[str, str]


def logical_shape(param: Tensor) -> tuple[int, ...]:
    """A parameter's own shape (ZeRO-3 empties ``param.shape`` outside the forward pass and
    keeps the shape in ``ds_shape``)."""
    shape = getattr(param, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(param.shape)


def partitioned(param: Any) -> bool:
    """Whether a ZeRO optimizer keeps ``param``'s gradient in its partitions (a parameter it
    does not hold keeps an unreduced gradient on ``p.grad``, which no row may show)."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def local_piece(param: Any, optimizer: Any) -> Tensor | None:
    """This rank's piece of a :func:`partitioned` parameter's averaged gradient, flat; None
    where this rank holds no piece.

    Args:
        param: A parameter of the engine's module.
        optimizer: The engine's optimizer (``engine.optimizer``).
    """
    if hasattr(param, "ds_id"):  # ZeRO-3
        grad: Tensor | None = optimizer.get_local_fp32_grad_for_param(param)
        if grad is None:
            return None
        flat = grad.reshape(-1)
        import torch.distributed as dist

        start = dist.get_rank(group=param.ds_process_group) * flat.numel()
        size = max(0, min(flat.numel(), int(param.ds_numel) - start))  # padding cut off
        return flat.narrow(0, 0, size)
    mapping: Any = getattr(param, "_hp_mapping", None)  # ZeRO-1/2
    if mapping is None:  # no fragment on this rank
        return None
    fragment: Tensor = mapping.get_lp_grad_fragment(param._index_in_param_group)
    flat = fragment.reshape(-1)
    address = mapping.lp_fragment_address
    if flat.numel() == param.numel() and int(address.numel) < param.numel():
        flat = flat.narrow(0, int(address.start), int(address.numel))
    return flat


@dataclass(slots=True)
class _Reading:
    """The pieces of one update, reduced on the device before the optimizer's step."""

    held: list[tuple[int, int]]  # (index in params, piece numel)
    stats: Tensor | None  # [held, 3] float64: sum of squares, sum, absmax
    seen: frozenset[int]  # params that got a gradient in some micro-batch
    scale: float  # the loss scale, divided out
    clip: float = math.nan  # what the optimizer's clip multiplied the gradients by


class ZeroGrads:
    """The watched parameters' local gradient pieces, read once per optimizer update.

    Args:
        optimizer: The engine's optimizer.
        params: The watched parameters of the engine's module.
        full: Record the mean and ``absmax`` too (``param_stats="full"``).
    """

    def __init__(self, optimizer: Any, params: Sequence[TorchParam], full: bool) -> None:
        self._optimizer = optimizer
        self.params = list(params)
        self._full = full
        self._seen: set[int] = set()
        self._handles: list[Any] = []
        self._reading: _Reading | None = None
        self.shares: dict[Key, Share] = {}
        """The shares of the rows :meth:`add_to` added last, by ``(layer, tensor)``."""

    def attach(self) -> None:
        """Note each parameter that gets a gradient (a post-accumulate hook each)."""
        for index, p in enumerate(self.params):
            if p.param.requires_grad:
                self._handles.append(p.param.register_post_accumulate_grad_hook(
                    functools.partial(self._got, index)))

    def _got(self, index: int, param: Tensor) -> None:
        self._seen.add(index)

    def detach(self) -> None:
        """Remove the hooks; forget the open update."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()

    def clear(self) -> None:
        """Start the next update."""
        self._seen.clear()
        self._reading = None

    def read(self) -> None:
        """Reduce every local piece on the device (called right before the optimizer's step,
        which consumes the partitions)."""
        held: list[tuple[int, int]] = []
        parts: list[Tensor] = []
        for index in sorted(self._seen):
            piece = local_piece(self.params[index].param, self._optimizer)
            if piece is None or piece.numel() == 0:
                continue
            acc = acc_dtype(piece)
            parts.append(torch.stack([square_sum(piece).to(acc), piece.sum(dtype=acc),
                                      whole_absmax(piece).to(acc)]).double())
            held.append((index, piece.numel()))
        scale = float(getattr(self._optimizer, "loss_scale", 1.0) or 1.0)
        self._reading = _Reading(held, torch.stack(parts) if parts else None,
                                 frozenset(self._seen), scale)

    def clipped(self) -> None:
        """Learn the factor the optimizer's update clipped the gradients by (called right
        after the update): DeepSpeed's ``gradient_clipping`` (1.0 unless configured) scales
        every gradient by ``1 / max(1, (norm + 1e-6) / clip)``, ``norm`` the global one it
        computed, so that ``clipped_norm`` is the gradient the optimizer applied."""
        reading, optimizer = self._reading, self._optimizer
        limit = float(getattr(optimizer, "clip_grad", 0.0) or 0.0)
        norm = getattr(optimizer, "_global_grad_norm", None)
        if reading is None or limit <= 0.0 or norm is None:
            return
        total = float(norm)
        if math.isfinite(total):
            reading.clip = 1.0 / max(1.0, (total + 1e-6) / limit)

    def add_to(self, step: int, result: StepResult,
               depth_of: Callable[[TorchParam], int]) -> StepResult:
        """``result`` with this rank's piece rows and the ``no_grad`` events of the update
        (one host transfer); their shares in :attr:`shares`.

        Args:
            step: The step being closed.
            result: The torch adapter's rows of the step (layer outputs, taps).
            depth_of: A parameter's depth.
        """
        reading, self._reading = self._reading, None
        self.shares = {}
        if reading is None:
            return result
        values = reading.stats.tolist() if reading.stats is not None else []
        records = list(result.records)
        events = list(result.events)
        for (index, numel), (sq, total, absmax) in zip(reading.held, values, strict=True):
            p = self.params[index]
            records.append(self._record(step, p, depth_of(p), numel, (sq, total, absmax),
                                        reading.scale, reading.clip))
        for index, p in enumerate(self.params):
            if p.param.requires_grad and index not in reading.seen:
                events.append(Event(step, p.layer, p.tensor, depth_of(p), _NO_GRAD))
        return replace(result, records=records, events=events)

    def _record(self, step: int, p: TorchParam, depth: int, numel: int,
                sums: tuple[float, float, float], scale: float, clip: float) -> Record:
        """The row of one piece, and its share (a piece that is the whole tensor is whole)."""
        sq, total, absmax = sums[0] / (scale * scale), sums[1] / scale, sums[2] / scale
        shape = logical_shape(p.param)
        whole = numel == math.prod(shape)
        self.shares[(p.layer, p.tensor)] = WHOLE if whole else Share(shape=str(shape))
        nan, inf = math.isnan(absmax), math.isinf(absmax)
        norm = math.sqrt(sq) if sq >= 0 else math.nan
        full = self._full
        return sums_record(step, p.layer, p.tensor, _PARAMETER, depth,
                           str(shape) if whole else str((numel,)), numel, norm,
                           total if full else math.nan, absmax if full else math.nan,
                           math.nan, nan, inf, math.nan, 0, math.nan, math.nan, norm * clip)


class ZeroRows(RankRows):
    """:class:`~graddebug_torch.sharding.RankRows` with the ZeRO pieces' rows added to each
    step before the ranks combine them, each with its own share.

    Args:
        world: The number of ranks.
        channels_first: Whether a layer's outputs hold their units on axis 1 (by name).
        warn: Warns once per key.
        zero: The pieces.
        depth_of: A parameter's depth.
    """

    def __init__(self, world: int, channels_first: Callable[[str], bool],
                 warn: Callable[[str, str], None], zero: ZeroGrads,
                 depth_of: Callable[[TorchParam], int]) -> None:
        super().__init__(world, channels_first, warn)
        self._zero = zero
        self._depth_of = depth_of

    def combine(self, step: int, result: StepResult | None, params: Sequence[ParamRow]
                ) -> StepResult:
        """The pieces' rows added to ``result``, then every rank's rows combined (one
        collective, made even where adding them failed)."""
        failure: Exception | None = None
        if result is not None:
            try:
                result = self._zero.add_to(step, result, self._depth_of)
            except Exception as exc:  # the collective must still run on every rank
                failure, result = exc, None
        combined = super().combine(step, result, params)
        if failure is not None:
            raise failure
        return combined

    def _shares(self, records: Sequence[Record], params: Sequence[ParamRow]
                ) -> list[Share | None]:
        """The torch adapter's shares, the pieces' own for the ZeRO parameters' rows."""
        found = super()._shares(records, params)
        mine = self._zero.shares
        return [mine.get((r.layer, r.tensor), s) if r.kind == _PARAMETER else s
                for r, s in zip(records, found, strict=True)]
