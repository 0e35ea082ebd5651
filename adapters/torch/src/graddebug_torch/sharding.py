"""How each rank's rows relate to the global tensors: the :class:`~graddebug.adapter.ranks.Share`
of every parameter and layer-output row, and the collective that combines them.

The rule is written once, in :mod:`graddebug.adapter.ranks`; this module only says, for each
row of this rank, what its local piece is:

- a parameter whose gradient is a plain tensor holds the global gradient (data parallelism
  averaged it, or every rank computed the same one): ``whole``;
- a parameter whose gradient is a ``DTensor`` (FSDP2, tensor parallelism, both, HSDP) holds a
  slice of it: a piece, not counted on a replicated mesh coordinate other than 0, and one of
  ``world / mesh size`` copies where its mesh spans part of the world;
- a layer output's gradient has a *layout*, learned in the forward pass (:class:`Layouts`):
  a ``DTensor`` output has its own; a plain output that tensor parallelism made local
  (``ColwiseParallel``, ``RowwiseParallel`` with ``use_local_output=True``) has the layout it
  had before (its ``grad_fn`` keeps it); a parameter-free module (an activation, dropout) fed
  such a piece gives a piece of the same layout when its output keeps the input's shape; any
  other output derives from the batch alone, and is the same on every rank of the
  tensor-parallel mesh. On top of that, the ranks that are not in one tensor-parallel mesh
  hold other slices of the batch (data parallelism), whose losses the optimizer averages: a
  layer output's gradient for the global loss is the local one divided by their number.

A layout this module cannot place (a placement it does not know, a sharded input reshaped by a
module without parameters) gives no row and one warning naming the layer: never a wrong number.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from graddebug.adapter import StepResult
from graddebug.adapter.ranks import WHOLE, Partial, RankCombiner, Share
from graddebug.capture.layers import LayerSpec
from graddebug.records import Kind, Record
from graddebug_torch.distributed import distribution, is_sharded, summed_by_ranks
from graddebug_torch.outputs import unit_dim
from graddebug_torch.params import ParamRow, TorchParam

__all__ = ["UNPLACED_WARNING", "Layout", "Layouts", "RankRows", "TorchCollective", "param_share",
           "rank_rows"]

_PARAMETER = Kind.PARAMETER.value

UNPLACED_WARNING = (
    "graddebug: the gradient at {where} cannot be placed among the ranks ({why}); its rows are "
    "left out rather than be a wrong number. Watch the modules around it, or record it with "
    "a tap on a tensor whose layout graddebug knows.")


@dataclass(frozen=True, slots=True)
class Layout:
    """How a tensor is spread over a device mesh: its mesh, placements and global shape."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]


_BATCH = None  # the layout of an output that derives from the batch alone


def layout_of(tensor: Any) -> Layout | None:
    """The layout of a ``DTensor``, or of a plain tensor that ``to_local()`` made from one;
    None for any other tensor."""
    if is_sharded(tensor):
        return Layout(tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape))
    spec = getattr(tensor.grad_fn, "dtensor_spec", None)  # kept by to_local()'s backward
    if spec is None:
        return None
    return Layout(spec.mesh, tuple(spec.placements), tuple(spec.shape))


class Layouts:
    """The layouts of one step's layer outputs, learned as the forward pass runs.

    Args:
        world: The number of ranks.
        data_parallel: Whether the ranks outside one tensor-parallel mesh hold other slices
            of the batch, whose losses the optimizer averages (DDP, FSDP, ZeRO); False where
            every rank's outputs are its own (pipeline stages).
    """

    def __init__(self, world: int, data_parallel: bool = True) -> None:
        self.world = world
        self.data_parallel = data_parallel
        self.mesh: Any = None
        """The tensor-parallel mesh, from the first ``DTensor`` layout seen."""
        self._of: dict[tuple[str, str], Layout | str | None] = {}
        self._pieces: dict[int, tuple[weakref.ref[Tensor], Layout]] = {}

    def clear(self) -> None:
        """Forget the step's layouts (the mesh stays): when each step closes, recorded or
        not."""
        self._of.clear()
        self._pieces.clear()

    def learn(self, key: tuple[str, str], tensor: Tensor, args: Iterable[Any]) -> None:
        """Learn the layout of output ``key`` of a module called on ``args``."""
        found: Layout | str | None = layout_of(tensor)
        if found is None:
            found = self._inherited(tensor, args)
        if isinstance(found, Layout):
            if self.mesh is None:
                self.mesh = found.mesh
            self._pieces[id(tensor)] = (weakref.ref(tensor), found)
        self._of.setdefault(key, found)

    def learn_grad(self, key: tuple[str, str], grad: Any) -> None:
        """Learn the layout of output ``key`` from its gradient, a ``DTensor`` (whose
        placements are those of the gradient itself)."""
        found = layout_of(grad)
        if found is not None:
            if self.mesh is None:
                self.mesh = found.mesh
            self._of[key] = found

    def _inherited(self, tensor: Tensor, args: Iterable[Any]) -> Layout | str | None:
        """The layout a parameter-free module passes on from a piece among its inputs."""
        for arg in args:
            if not isinstance(arg, Tensor):
                continue
            entry = self._pieces.get(id(arg))
            if entry is None or entry[0]() is not arg:
                continue
            if tuple(arg.shape) == tuple(tensor.shape):
                return entry[1]
            if any(not p.is_replicate() for p in entry[1].placements):
                return ("a module changed the shape of a slice it was given, so where its "
                        "output's pieces lie is unknown")
        return _BATCH

    def shape(self, key: tuple[str, str], tensor: Tensor) -> tuple[int, ...]:
        """The whole shape of output ``key``, ``tensor`` on this rank."""
        found = self._of.get(key)
        return found.shape if isinstance(found, Layout) else tuple(tensor.shape)

    def logical(self, key: tuple[str, str], grad: Tensor) -> Tensor:
        """``grad`` as the ``DTensor`` of the whole output ``key`` where it is this rank's
        piece of one split over the ranks; else ``grad`` itself."""
        found = self._of.get(key)
        if (not isinstance(found, Layout) or is_sharded(grad)
                or all(p.is_replicate() for p in found.placements)):
            return grad
        from torch.distributed.tensor import DTensor

        shape = torch.Size(found.shape)
        stride = torch.empty(shape, device="meta").stride()
        out: Tensor = DTensor.from_local(grad, found.mesh, found.placements, run_check=False,
                                         shape=shape, stride=stride)
        return out

    def share(self, key: tuple[str, str], unit_dim: int | None) -> Share | str:
        """The share of output ``key``'s row, or why it has none."""
        found = self._of.get(key, _BATCH)
        if isinstance(found, str):
            return found
        replicas = self._replicas()
        scale = 1.0 / replicas if self.data_parallel else 1.0
        if found is None:  # from the batch: the same on every rank of the model mesh
            counted = self.mesh is None or _coordinate_zero(self.mesh, range(self.mesh.ndim))
            return Share(counted=counted, scale=scale, split_dim=0 if replicas > 1 else None)
        return _piece_share(found, scale, unit_dim, replicas > 1)

    def _replicas(self) -> int:
        """How many copies of the tensor-parallel mesh the world holds."""
        size = 1 if self.mesh is None else self.mesh.size()
        return max(1, self.world // size)


def _coordinate_zero(mesh: Any, dims: Iterable[int]) -> bool:
    """Whether this rank's coordinate on mesh dimensions ``dims`` is 0."""
    coordinate = mesh.get_coordinate()
    return coordinate is not None and all(coordinate[d] == 0 for d in dims)


def _piece_share(layout: Layout, scale: float, unit_dim: int | None,
                 batch_split: bool, partial_copies: bool = True) -> Share | str:
    """The share of a slice of a tensor of ``layout``: replicated mesh dimensions (and
    reduced ``Partial`` ones, unless ``partial_copies`` is False) hold copies."""
    ndim = len(layout.shape)
    copies: list[int] = []
    units_split = False
    for dim, placement in enumerate(layout.placements):
        if placement.is_partial() and not partial_copies:
            continue
        if placement.is_replicate() or placement.is_partial():
            copies.append(dim)
        elif placement.is_shard() or type(placement).__name__ == "_StridedShard":
            # FSDP's strided split of a tensor-parallel slice: disjoint pieces all the same
            units_split |= unit_dim is not None and placement.dim % ndim == unit_dim % ndim
        else:
            return f"placement {placement!r} of a gradient is not supported"
    counted = _coordinate_zero(layout.mesh, copies)
    return Share(counted=counted, scale=scale, units_split=units_split,
                 shape=str(layout.shape), split_dim=0 if batch_split else None)


def param_share(grad: Any, world: int, data_parallel: bool = True) -> Share | str:
    """The share of a parameter's row, or why it has none.

    ``whole`` for a plain gradient; for a ``DTensor``'s, its slice, counted once over the
    replicated mesh dimensions and, where its mesh spans part of the world and the other
    ranks are data-parallel copies of it (tensor parallelism under DDP), only in the copy
    that holds rank 0.
    """
    if not is_sharded(grad):
        return WHOLE
    layout = Layout(grad.device_mesh, tuple(grad.placements), tuple(grad.shape))
    addend = summed_by_ranks(grad)
    share = _piece_share(layout, 1.0, None, batch_split=False, partial_copies=not addend)
    if isinstance(share, str) or not share.counted:
        return share
    if addend:
        share = replace(share, partial=_addend(grad, layout))
    mesh = layout.mesh
    if data_parallel and mesh.size() < world and 0 not in mesh.mesh.flatten().tolist():
        return Share(counted=False, shape=share.shape)
    return share


def _addend(grad: Any, layout: Layout) -> Partial:
    """This rank's addend of a ``Partial`` gradient, and its group: the ranks that share
    its coordinates on every mesh dimension that is not ``Partial``."""
    mesh = layout.mesh
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if p.is_partial() else coordinate[d]
                  for d, p in enumerate(layout.placements))
    group = int(mesh.mesh[index].min())
    local = grad.to_local().detach()
    values = local.to("cpu", torch.float64).numpy().ravel()
    return Partial(group, values, None if local.dtype in _EXACT else functools.partial(
        _rounded, dtype=local.dtype))


_EXACT = (torch.float32, torch.float64)


def _rounded(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``values`` rounded to ``dtype`` (bfloat16, float16) and back to float64."""
    out: np.ndarray = torch.from_numpy(values).to(dtype).double().numpy()
    return out


class TorchCollective:
    """The collectives of ``torch.distributed``'s default process group, on the device its
    backend takes (CUDA for NCCL, else the CPU)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        backend = str(dist.get_backend()).lower()
        self._device = (torch.device("cuda", torch.cuda.current_device())
                        if "nccl" in backend and torch.cuda.is_available()
                        else torch.device("cpu"))
        self._world = dist.get_world_size()

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's float64 vector as ``[world, n]``: one ``all_gather_into_tensor``."""
        local = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)).to(self._device)
        out = torch.empty(self._world * local.numel(), dtype=torch.float64, device=self._device)
        # all_gather_single is all_gather_into_tensor's new name (torch 2.13).
        gather_into = (getattr(self._dist, "all_gather_single", None)
                       or self._dist.all_gather_into_tensor)
        gather_into(out, local)
        result: np.ndarray = out.view(self._world, -1).cpu().numpy()
        return result

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's picklable ``value``, in rank order."""
        out: list[Any] = [None] * self._world
        self._dist.all_gather_object(out, value)
        return out



class RankRows:
    """The rows of every rank combined at each recorded step's close.

    Args:
        world: The number of ranks.
        channels_first: Whether a layer's outputs hold their units on axis 1 (by name).
        warn: Warns once per key (``WatchContext.warn_once``).
        data_parallel: See :class:`Layouts`.
        unplaced: Parameters no rule places, by ``(layer, tensor)``, and why: their rows are
            left out, with one warning each.
    """

    def __init__(self, world: int, channels_first: Callable[[str], bool],
                 warn: Callable[[str, str], None], data_parallel: bool = True,
                 unplaced: Mapping[tuple[str, str], str] | None = None) -> None:
        self.layouts = Layouts(world, data_parallel)
        self.combiner = RankCombiner(TorchCollective(), distribution().rank)
        self._world = world
        self._channels_first = channels_first
        self._warn = warn
        self._unplaced = dict(unplaced or {})

    def combine(self, step: int, result: StepResult | None, params: Sequence[ParamRow]
                ) -> StepResult:
        """``result`` with its rows those of the global tensors: one collective, which every
        rank makes even where its own close failed (``result`` None: its rows of the step are
        dropped on every rank).

        Args:
            step: The recorded step.
            result: This rank's rows (each of its local piece), events and kept arrays.
            params: The step's parameter rows, whose gradients say how they are sharded.

        Raises:
            Exception: Whatever failed in this rank's shares, once every rank is past the
                collective.
        """
        records: list[Record] = []
        shares: list[Share] | None = None
        failure: Exception | None = None
        try:
            if result is not None:
                found = self._shares(result.records, params)
                records = [r for r, s in zip(result.records, found, strict=True) if s]
                shares = [s for s in found if s is not None]
        except Exception as exc:  # the collective must still run on every rank
            failure = exc
        events = result.events if result is not None else []
        combiner = self.combiner
        rows = combiner.combine(step, records, shares, events)
        if failure is not None:
            raise failure
        return replace(result or StepResult(), records=rows, shared=True,
                       peer_events=combiner.peer_events)

    def local(self, result: StepResult, params: Sequence[ParamRow]) -> StepResult:
        """``result`` without the rows of pieces (no collective: a rank unwinding an
        exception, whose peers may never reach one): only the rows that are whole stay."""
        shares = self._shares(result.records, params)
        return replace(result, records=[r for r, s in zip(result.records, shares, strict=True)
                                        if s is not None and s.whole])

    def _shares(self, records: Sequence[Record], params: Sequence[ParamRow]
                ) -> list[Share | None]:
        """Each record's share; None (with one warning) where it has none."""
        grads = {(p.layer, p.tensor): p.grad for p in params if p.grad is not None}
        parallel = self.layouts.data_parallel
        out: list[Share | None] = []
        for r in records:
            key = (r.layer, r.tensor)
            if r.kind == _PARAMETER:
                found = self._unplaced.get(key) or param_share(grads.get(key), self._world,
                                                               parallel)
            else:
                ndim = r.shape.count(",") + (0 if r.shape.endswith(",)") else 1)
                found = self.layouts.share(key, unit_dim(ndim, self._channels_first(r.layer)))
            if isinstance(found, str):
                self._warn(f"unplaced:{r.layer}:{r.tensor}", UNPLACED_WARNING.format(
                    where=f"{r.layer!r} ({r.tensor})", why=found))
                out.append(None)
            else:
                out.append(found)
        return out


_FLAT = ("FSDP1 without use_orig_params=True flattens the parameters into one slice per rank; "
         "pass use_orig_params=True or use FSDP2's fully_shard")
_PLAIN_SLICE = ("it is a tensor-parallel slice held as a plain tensor (Megatron's "
                "tensor_model_parallel); graddebug places DTensor slices: torch's "
                "parallelize_module makes them")


def _unplaced(param: Tensor) -> str | None:
    """Why a parameter's slice cannot be placed among the ranks, or None: an engine that
    keeps its slices as plain tensors, which look whole."""
    if type(param).__name__ == "FlatParameter":
        return _FLAT
    if getattr(param, "tensor_model_parallel", False):
        return _PLAIN_SLICE
    return None


def rank_rows(world: int, layers: Mapping[str, LayerSpec], params: Sequence[TorchParam],
              warn: Callable[[str, str], None]) -> RankRows | None:
    """How a run of ``world`` ranks combines its rows; None in one process.

    Args:
        world: The number of ranks.
        layers: The adapter's layers by name (their unit axis).
        params: The watched parameters (FSDP1's flat parameters are refused).
        warn: Warns once per key.
    """
    if world <= 1:
        return None
    unplaced = {(p.layer, p.tensor): reason for p in params
                if (reason := _unplaced(p.param)) is not None}
    return RankRows(world, lambda name: name in layers and layers[name].channels_first, warn,
                    unplaced=unplaced)
