"""Capture and intervention for PyTorch: forward hooks attach tensor hooks to layer outputs."""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import StepResult, WatchContext, WatchOptions
from graddebug.errors import (
    ConfigError,
    GradDebugError,
    GradientCountError,
    MaskShapeError,
    UnknownNameError,
    close_matches,
)
from graddebug.interventions import Intervention
from graddebug.records import Event, EventKind, Record
from graddebug_torch.stats import acc_dtype, activation_stats, apply_intervention, unit_absmax

__all__ = ["TorchAdapter"]

Key = tuple[str, str]

# Modules whose 3-D outputs are (batch, channels, length); other 3-D outputs are
# (batch, sequence, features) and their units lie on the last axis.
_CHANNELS_FIRST: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.GroupNorm,
)


def _unit_dim(ndim: int, channels_first: bool) -> int | None:
    if ndim < 2:
        return None
    if ndim == 2:
        return 1
    if ndim >= 4 or channels_first:
        return 1
    return ndim - 1


def _flatten(value: Any, path: str = "output") -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in a (nested) tuple, list or dict output."""
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{path}.{i}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _flatten(item, f"{path}.{key}")


def _any_requires_grad(value: Any) -> bool:
    return any(t.requires_grad for _, t in _flatten(value))


@dataclass
class _Layer:
    """A watched module (or tap) and what is known of it."""

    name: str
    channels_first: bool = False
    depth: int = -1
    keep: bool = False
    intervention: Intervention | None = None
    mask_checked: bool = False


@dataclass
class _Param:
    layer: str
    tensor: str
    param: Tensor
    owner_chain: tuple[str, ...]  # owner module name, then its ancestors
    keep: bool = False


@dataclass
class _Capture:
    stats: tuple[Tensor, Tensor, Tensor]  # norm, sum, absmax
    alive: Tensor | None  # count of units with a non-zero gradient
    units: Tensor | None
    shape: tuple[int, ...]
    pre_norm: Tensor | None

    @property
    def n_units(self) -> int:
        return 0 if self.units is None else self.units.numel()


@dataclass
class _StepState:
    """Everything captured in the open step; dropped when it closes."""

    captures: dict[Key, list[_Capture]] = field(default_factory=dict)
    expected: dict[Key, int] = field(default_factory=dict)
    forward_sums: list[tuple[Key, int, Tensor]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    kept: dict[str, np.ndarray] = field(default_factory=dict)
    handles: list[RemovableHandle] = field(default_factory=list)
    received: dict[int, Tensor] = field(default_factory=dict)
    taps: int = 0
    tap_requires_grad: bool = False


class TorchAdapter:
    """Watches a ``torch.nn.Module``, named tensors (``params=``), and taps.

    Activation gradients come from tensor hooks that forward hooks attach to each watched
    module's outputs; parameter gradients are read from ``p.grad`` when the step closes. All
    statistics stay on the device until ``close_step`` moves them to the host in one transfer.
    """

    name = "torch"

    def __init__(
        self,
        context: WatchContext,
        model: Any,
        params: Mapping[str, Any] | None,
        options: WatchOptions,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ConfigError(
                f"the torch adapter watches torch.nn.Module models, not {type(model).__name__}; "
                "pass tensors as params={'name': tensor} or use tap()."
            )
        self._ctx = context
        self._model: nn.Module | None = model
        self._options = options
        self._layers: dict[str, _Layer] = {}
        self._modules: dict[str, nn.Module] = {}
        self._params: list[_Param] = []
        self._module_handles: list[RemovableHandle] = []
        self._state = _StepState()
        self._matched: set[str] = set()
        self._next_depth = 0
        self._closed_any = False
        self._was_training: bool | None = None
        self._resolve(params)

    # -- set-up ----------------------------------------------------------------------------

    def _resolve(self, params: Mapping[str, Any] | None) -> None:
        options = self._options
        wanted = set(options.keep) | set(options.intervene)
        if self._model is not None:
            named = {self._name(n): m for n, m in self._model.named_modules()}
            selected = self._select(named, options.layers)
            for extra in wanted & named.keys():
                selected.setdefault(extra, named[extra])
            for name, module in selected.items():
                self._modules[name] = module
                self._layers[name] = _Layer(
                    name=name,
                    channels_first=isinstance(module, _CHANNELS_FIRST),
                    keep=name in options.keep,
                    intervention=options.intervene.get(name),
                )
            self._matched |= wanted & named.keys()
            chosen = None if options.layers is None else set(selected)
            for pname, param in self._model.named_parameters():
                owner, _, short = pname.rpartition(".")
                chain = tuple(_ancestors(owner))
                if chosen is not None and not chosen.intersection(chain):
                    continue
                layer = self._name(owner)
                self._params.append(
                    _Param(layer, short, param, chain, keep=layer in options.keep)
                )
        for key, value in (params or {}).items():
            if not isinstance(value, Tensor):
                raise ConfigError(
                    f"params[{key!r}] is a {type(value).__name__}, not a torch.Tensor."
                )
            if not value.is_leaf or not value.requires_grad:
                raise ConfigError(
                    f"params[{key!r}] must be a leaf tensor with requires_grad=True, so that "
                    f"its .grad is filled; for an intermediate tensor use tap(t, {key!r})."
                )
            self._params.append(_Param(key, key, value, (key,), keep=key in options.keep))
            self._layers.setdefault(key, _Layer(name=key, depth=self._take_depth()))
            if key in wanted:
                self._matched.add(key)

    def _name(self, qualified: str) -> str:
        if qualified:
            return qualified
        return type(self._model).__name__

    def _select(self, named: dict[str, nn.Module], layers: Sequence[Any] | None
                ) -> dict[str, nn.Module]:
        if layers is None:
            # Leaf modules, plus modules that hold parameters of their own (such as
            # MultiheadAttention, whose out_proj is used functionally and never runs forward).
            return {
                n: m
                for n, m in named.items()
                if _owns_params(m) or not any(True for _ in m.children())
            }
        selected: dict[str, nn.Module] = {}
        for spec in layers:
            if isinstance(spec, type):
                hits = {n: m for n, m in named.items() if isinstance(m, spec)}
                what = f"layers= type {spec.__name__}"
            elif isinstance(spec, str) and any(c in spec for c in "*?["):
                hits = {n: m for n, m in named.items() if fnmatch.fnmatchcase(n, spec)}
                what = f"layers= pattern {spec!r}"
            elif isinstance(spec, str):
                hits = {spec: named[spec]} if spec in named else {}
                what = f"layers= name {spec!r}"
            else:
                raise ConfigError(
                    f"layers= entry {spec!r} must be a module name, a glob or a module type."
                )
            if not hits:
                hint = close_matches(spec, named) if isinstance(spec, str) else ""
                raise UnknownNameError(
                    f"{what} matches no module of {type(self._model).__name__}.{hint} "
                    f"Modules: {', '.join(list(named)[:20])}."
                )
            selected.update(hits)
        return selected

    def _take_depth(self) -> int:
        depth = self._next_depth
        self._next_depth += 1
        return depth

    # -- Adapter protocol ---------------------------------------------------------------

    def attach(self) -> None:
        """Register one forward hook per watched module."""
        if self._model is not None:
            self._was_training = self._model.training
        for name, module in self._modules.items():
            hook = functools.partial(self._on_forward, self._layers[name])
            self._module_handles.append(module.register_forward_hook(hook))
        for index, param in enumerate(self._params):
            if param.param.requires_grad:
                self._module_handles.append(param.param.register_post_accumulate_grad_hook(
                    functools.partial(self._on_param_grad, index)))

    def _on_param_grad(self, index: int, param: Tensor) -> None:
        # Holding the reference lets step() come after zero_grad(set_to_none=True).
        if self._ctx.recording and param.grad is not None:
            self._state.received[index] = param.grad

    def detach(self) -> None:
        """Remove every module and tensor hook; restore ``model.training``."""
        for handle in self._module_handles:
            handle.remove()
        self._module_handles.clear()
        self._drop_step()
        if self._model is not None and self._was_training is not None:
            self._model.train(self._was_training)

    def has_pending(self) -> bool:
        """Whether the open step captured anything, or holds gradients nobody recorded."""
        state = self._state
        if state.captures or state.expected:
            return True
        return not self._closed_any and any(p.param.grad is not None for p in self._params)

    def matched_names(self) -> set[str]:
        """Names from ``keep=``/``intervene=`` that matched a module, a param key or a tap."""
        return set(self._matched)

    def known_names(self) -> list[str]:
        """Every watched layer, module and tap name."""
        names = list(self._layers)
        if self._model is not None:
            names += [self._name(n) for n, _ in self._model.named_modules()]
        return list(dict.fromkeys(names))

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Hook ``tensor`` so that its gradient is recorded (and altered) under ``name``."""
        if not isinstance(tensor, Tensor):
            raise ConfigError(
                f"tap({type(tensor).__name__}, {name!r}): the torch adapter taps torch.Tensor "
                "objects only."
            )
        if not self._ctx.recording or not torch.is_grad_enabled():
            if intervention is not None and intervention.active and tensor.requires_grad:
                # Interventions act on every step, recorded or not.
                self._state.handles.append(
                    tensor.register_hook(functools.partial(self._intervene, intervention, name))
                )
            return tensor
        layer = self._layers.get(name)
        if layer is None:
            layer = self._layers[name] = _Layer(name=name, keep=name in self._options.keep)
        if name in self._options.keep or name in self._options.intervene:
            self._matched.add(name)
        layer.intervention = intervention
        if layer.depth < 0:
            layer.depth = self._take_depth()
        state = self._state
        state.taps += 1
        if not tensor.requires_grad:
            if state.tap_requires_grad:
                state.events.append(
                    Event(self._ctx.step_index, name, "output", layer.depth,
                          EventKind.DETACHED_OUTPUT.value,
                          "the tapped tensor does not require a gradient although an earlier "
                          "tap did, so the graph was cut between them")
                )
            return tensor
        state.tap_requires_grad = True
        self._watch_tensor(layer, "output", tensor)
        return tensor

    # -- hooks ------------------------------------------------------------------------------

    def _on_forward(self, layer: _Layer, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self._ctx
        if not ctx.recording or not torch.is_grad_enabled():
            if layer.intervention is not None and layer.intervention.active:
                for _, t in _flatten(output):
                    if t.requires_grad:
                        self._state.handles.append(t.register_hook(functools.partial(
                            self._intervene, layer.intervention, layer.name)))
            return
        try:
            if layer.depth < 0:
                layer.depth = self._take_depth()
            for tname, tensor in _flatten(output):
                if not tensor.is_floating_point():
                    continue
                if self._options.outputs or layer.keep or layer.intervention is not None:
                    self._watch_tensor(layer, tname, tensor)
                if tensor.requires_grad:
                    continue
                if _any_requires_grad(args):
                    self._state.events.append(
                        Event(ctx.step_index, layer.name, tname, layer.depth,
                              EventKind.DETACHED_OUTPUT.value,
                              "its input requires a gradient but its output does not")
                    )
        except GradDebugError:
            raise
        except Exception as exc:  # fail-open: a graddebug bug must not stop training
            ctx.internal_error(exc, layer.name)

    def _watch_tensor(self, layer: _Layer, tname: str, tensor: Tensor) -> None:
        key = (layer.name, tname)
        state = self._state
        spec = layer.intervention
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            self._check_mask(layer, tensor, spec.mask)
        if self._options.outputs or layer.keep:
            # Forward finiteness check: one reduction, read at the step's single sync.
            state.forward_sums.append(
                (key, layer.depth, tensor.detach().sum(dtype=acc_dtype(tensor)))
            )
        if not tensor.requires_grad:
            return
        state.expected.setdefault(key, layer.depth)
        hook = functools.partial(self._on_grad, layer, tname)
        state.handles.append(tensor.register_hook(hook))

    def _check_mask(self, layer: _Layer, tensor: Tensor, mask: Any) -> None:
        if layer.mask_checked:
            return
        shape = tuple(getattr(mask, "shape", ()))
        try:
            fits = torch.broadcast_shapes(shape, tensor.shape) == tensor.shape
        except RuntimeError:
            fits = False
        if not isinstance(mask, Tensor) or not fits:
            raise MaskShapeError(
                f"the mask for {layer.name!r} has shape {shape} but the gradient there has "
                f"shape {tuple(tensor.shape)}; give a tensor that broadcasts to it "
                "(e.g. shape (1, features)) or a callable grad -> grad."
            )
        layer.mask_checked = True

    def _intervene(self, spec: Intervention, name: str, grad: Tensor) -> Tensor:
        try:
            out = apply_intervention(grad, spec)
        except GradDebugError:
            raise
        except Exception as exc:
            if spec.mask_is_callable:
                raise  # the user's own mask function failed: theirs to see
            self._ctx.internal_error(exc, name)  # fail-open: the gradient flows on unaltered
            return grad
        if not isinstance(out, Tensor) or out.shape != grad.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise MaskShapeError(
                f"the mask callable for {name!r} returned {got} for a gradient of shape "
                f"{tuple(grad.shape)}; it must return a tensor of the same shape."
            )
        return out

    def _on_grad(self, layer: _Layer, tname: str, grad: Tensor) -> Tensor | None:
        spec = layer.intervention
        new = None
        if spec is not None and spec.active:
            new = self._intervene(spec, layer.name, grad)
        try:
            self._record_grad(layer, tname, grad, new)
        except GradDebugError:
            raise
        except Exception as exc:  # fail-open
            self._ctx.internal_error(exc, layer.name)
        return new

    def _record_grad(self, layer: _Layer, tname: str, grad: Tensor, new: Tensor | None) -> None:
        seen = new if new is not None else grad
        key = (layer.name, tname)
        if seen.is_sparse:
            seen = seen.coalesce().values()
        units = unit_absmax(seen, _unit_dim(seen.dim(), layer.channels_first))
        stats, alive = activation_stats(seen, units)
        capture = _Capture(
            stats=stats,
            alive=alive,
            units=units,
            shape=tuple(seen.shape),
            pre_norm=(
                torch.linalg.vector_norm(grad, dtype=acc_dtype(grad)) if new is not None else None
            ),
        )
        calls = self._state.captures.setdefault(key, [])
        calls.append(capture)
        if layer.keep:
            label = layer.name if tname == "output" else f"{layer.name}.{tname}"
            if len(calls) > 1:
                label = f"{label}#{len(calls) - 1}"
            self._state.kept[label] = seen.detach().cpu().numpy().copy()

    # -- closing a step ---------------------------------------------------------------------

    def _drop_step(self) -> None:
        for handle in self._state.handles:
            handle.remove()
        self._state = _StepState()

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Turn the step's captures into records with one host transfer, then reset."""
        try:
            if not record:
                return StepResult()
            return self._gather(step, grads)
        finally:
            self._closed_any = True
            self._drop_step()

    def _param_grads(self, grads: Sequence[Any] | None) -> list[tuple[_Param, Tensor | None]]:
        live = [(i, p) for i, p in enumerate(self._params) if p.param.requires_grad]
        if grads is None:
            received = self._state.received
            return [
                (p, p.param.grad if p.param.grad is not None else received.get(i))
                for i, p in live
            ]
        grads = list(grads)
        if len(grads) != len(live):
            raise GradientCountError(
                f"step() got {len(grads)} gradients but {len(live)} parameters are watched "
                "(those with requires_grad=True, in named_parameters() order)."
            )
        return list(zip((p for _, p in live), grads, strict=True))

    def _gather(self, step: int, grads: Sequence[Any] | None) -> StepResult:
        state = self._state
        pairs = self._param_grads(grads)
        present: list[tuple[_Param, Tensor]] = [(p, g) for p, g in pairs if g is not None]
        if not state.captures and not present:
            return StepResult()  # no backward ran in this step
        result = StepResult(events=list(state.events), kept=dict(state.kept))
        dense = [g.coalesce().values() if g.is_sparse else g for _, g in present]
        full = self._options.param_stats == "full"
        pooled = [
            key for key, calls in state.captures.items()
            if len(calls) > 1 and len({c.n_units for c in calls}) == 1 and calls[0].n_units
        ]

        # Everything goes into one flat device tensor, read in the same order below: a single
        # host sync for the whole step.
        floats: list[Tensor] = []
        alive: list[Tensor] = []
        for calls in state.captures.values():
            for c in calls:
                floats.extend(c.stats)
                if c.pre_norm is not None:
                    floats.append(c.pre_norm)
                if c.alive is not None:
                    alive.append(c.alive)
        parts: list[Tensor] = []
        if floats:
            parts.append(_stack(floats))
        if alive:
            parts.append(torch.stack(alive))
        for key in pooled:
            units = torch.stack([c.units for c in state.captures[key] if c.units is not None])
            parts.append(torch.count_nonzero(units.amax(0)))
        if dense:
            parts.append(_stack(torch._foreach_norm(dense)))
        if full:
            for g in dense:
                low, high = torch.aminmax(g)
                parts.append(_stack([g.sum(dtype=acc_dtype(g)), torch.maximum(high, low.neg())]))
        parts.extend(s for _, _, s in state.forward_sums)
        flat = _Cursor(_to_host(parts))

        stats = {key: [(flat.take(3), flat.take(1)[0] if c.pre_norm is not None else None)
                       for c in calls]
                 for key, calls in state.captures.items()}
        live = {key: [flat.take(1)[0] if c.alive is not None else None for c in calls]
                for key, calls in state.captures.items()}
        pooled_alive = {key: flat.take(1)[0] for key in pooled}
        for key, calls in state.captures.items():
            count = live[key][0] if len(calls) == 1 else pooled_alive.get(key)
            result.records.append(
                self._activation_record(step, key, calls, stats[key], count)
            )
        norms = flat.take(len(dense))
        for (param, _), g, norm in zip(present, dense, norms, strict=True):
            extra = flat.take(2) if full else None
            result.records.append(self._param_record(step, param, g, norm, extra))
        for key, depth, _ in state.forward_sums:
            value = flat.take(1)[0]
            if not math.isfinite(value):
                detail = "NaN" if math.isnan(value) else "Inf"
                result.events.append(Event(step, key[0], key[1], depth,
                                           EventKind.FORWARD_NONFINITE.value, detail))
        for (layer, tname), depth in state.expected.items():
            if (layer, tname) not in state.captures:
                result.events.append(Event(step, layer, tname, depth, EventKind.UNREACHED.value))
        for param, maybe in pairs:
            if maybe is None:
                result.events.append(Event(step, param.layer, param.tensor, self._depth(param),
                                           EventKind.NO_GRAD.value))
            elif param.keep:
                result.kept[f"{param.layer}.{param.tensor}"] = (
                    maybe.detach().cpu().numpy().copy()
                )
        return result

    def _activation_record(self, step: int, key: Key, calls: list[_Capture],
                           stats: list[tuple[list[float], float | None]],
                           alive: float | None) -> Record:
        first = calls[0]
        absmax = _nanmax(values[2] for values, _ in stats)
        pres = [pre for _, pre in stats if pre is not None]
        units = first.n_units
        return _record(
            step, key[0], key[1], "activation", self._layers[key[0]].depth, first.shape,
            numel=sum(math.prod(c.shape) for c in calls),
            norm=math.sqrt(sum(values[0] ** 2 for values, _ in stats)),
            total=sum(values[1] for values, _ in stats),
            absmax=absmax,
            zero_frac=(units - alive) / units if alive is not None and units else math.nan,
            nan=math.isnan(absmax),
            inf=math.isinf(absmax),
            pre_norm=math.sqrt(sum(p ** 2 for p in pres)) if pres else math.nan,
        )

    def _depth(self, param: _Param) -> int:
        for name in param.owner_chain:
            layer = self._layers.get(self._name(name))
            if layer is not None and layer.depth >= 0:
                return layer.depth
        return -1

    def _param_record(self, step: int, param: _Param, grad: Tensor, norm: float,
                      extra: list[float] | None) -> Record:
        nan = inf = False
        if not math.isfinite(norm):
            # Rare: a second sync, only for a gradient already known to be broken.
            nan = bool(torch.isnan(grad).any())
            inf = bool(torch.isinf(grad).any())
        total, absmax = (extra[0], extra[1]) if extra is not None else (math.nan, math.nan)
        return _record(step, param.layer, param.tensor, "parameter", self._depth(param),
                       tuple(grad.shape), grad.numel(), norm, total, absmax, math.nan, nan, inf)


class _Cursor:
    """Reads consecutive slices of the step's host values."""

    def __init__(self, values: list[float]) -> None:
        self._values = values
        self._at = 0

    def take(self, n: int) -> list[float]:
        out = self._values[self._at:self._at + n]
        self._at += n
        return out


def _record(step: int, layer: str, tensor: str, kind: str, depth: int, shape: tuple[int, ...],
            numel: int, norm: float, total: float, absmax: float, zero_frac: float,
            nan: bool, inf: bool, pre_norm: float = math.nan) -> Record:
    mean = total / numel if numel else math.nan
    var = norm * norm / numel - mean * mean if numel else math.nan
    std = math.sqrt(max(var, 0.0)) if math.isfinite(var) else math.nan
    return Record(step, layer, tensor, kind, depth, str(shape), numel, norm, mean, std,
                  absmax, zero_frac, nan, inf and not nan, pre_norm)


def _nanmax(values: Any) -> float:
    out = -math.inf
    for v in values:
        if math.isnan(v):
            return math.nan
        out = max(out, v)
    return out


def _ancestors(qualified: str) -> Iterator[str]:
    parts = qualified.split(".") if qualified else []
    for i in range(len(parts), -1, -1):
        yield ".".join(parts[:i])


def _owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _stack(scalars: Sequence[Tensor]) -> Tensor:
    """Stack 0-d tensors; mixed dtypes (a float64 tensor among float32 ones) go to float64."""
    first = scalars[0].dtype
    if any(s.dtype != first for s in scalars):
        return torch.stack([s.to(torch.float64) for s in scalars])
    return torch.stack(list(scalars))


def _to_host(parts: list[Tensor]) -> list[float]:
    if not parts:
        return []
    wide = any(p.dtype == torch.float64 for p in parts)
    dtype = torch.float64 if wide else torch.float32
    flat = [p.reshape(-1).to(dtype) for p in parts]
    by_device: dict[torch.device, list[Tensor]] = {}
    for p in flat:
        by_device.setdefault(p.device, []).append(p)
    if len(by_device) == 1:
        values: list[float] = torch.cat(flat).tolist()
        return values
    # Several devices: one transfer each, then restore the original order.
    moved = {dev: torch.cat(ts).cpu() for dev, ts in by_device.items()}
    offsets = dict.fromkeys(moved, 0)
    out: list[float] = []
    for p in flat:
        dev = p.device
        n = p.numel()
        out.extend(moved[dev][offsets[dev]:offsets[dev] + n].tolist())
        offsets[dev] += n
    return out

