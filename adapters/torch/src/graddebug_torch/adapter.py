"""Capture and intervention for PyTorch: forward hooks attach tensor hooks to layer outputs."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import StepResult, WatchContext, WatchOptions
from graddebug.errors import (
    ConfigError,
    GradDebugError,
    GradientCountError,
    MaskShapeError,
    WatcherStateError,
)
from graddebug.interventions import Intervention, intervene_fail_open
from graddebug.records import Event, EventKind
from graddebug.selection import select_layers
from graddebug_torch.stats import (
    acc_dtype,
    apply_intervention,
    square_sum,
    unit_extremes,
    whole_absmax,
)
from graddebug_torch.step import Capture, ParamGrad, ParamRow, StepState, gather

__all__ = ["TorchAdapter"]

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
    capture: bool = True  # record the gradient at its outputs (False: parameters only)


@dataclass
class _Param:
    layer: str
    tensor: str
    param: Tensor
    owner_chain: tuple[str, ...]  # owner module name, then its ancestors
    keep: bool = False


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
        self._state = StepState()
        self._matched: set[str] = set()
        self._next_depth = 0
        self._closed_any = False
        self._was_training: bool | None = None
        self._resolve(params)
        # optimizer=: each optimizer step closes a graddebug step (see _on_optimizer_step).
        self._optimizer = self._bind_optimizer(options.optimizer)
        self._dirty = False  # gradients arrived, or the optimizer stepped, since the last close
        self._user_closed = False  # a close that the optimizer hook did not make came last
        self._in_hook = False
        self._changed_in_place = False
        self.last_result = StepResult()
        """What the latest recorded step produced (callbacks log it without building a frame)."""

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
                keep = name in options.keep
                intervention = options.intervene.get(name)
                self._layers[name] = _Layer(
                    name=name,
                    channels_first=isinstance(module, _CHANNELS_FIRST),
                    keep=keep,
                    intervention=intervention,
                    capture=options.outputs or keep or intervention is not None,
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
        return select_layers(named, layers, noun="module", owner=type(self._model).__name__)

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
        if self._optimizer is not None:
            self._module_handles.append(
                self._optimizer.register_step_post_hook(self._on_optimizer_step))

    def _on_param_grad(self, index: int, param: Tensor) -> None:
        # Holding the reference lets step() come after zero_grad(set_to_none=True). The sum of
        # squares is taken now, while the gradient is still in cache; a gradient that changes
        # afterwards (accumulation, clipping in place) is measured again when the step closes.
        grad = param.grad
        self._dirty = True
        if not self._ctx.recording or grad is None:
            return
        try:
            received = self._state.received
            dense = not grad.is_sparse and grad.is_contiguous()
            first = index not in received
            sq = square_sum(grad) if first and dense else None
            received[index] = ParamGrad(grad, sq, grad._version)
        except Exception as exc:  # fail-open
            self._ctx.internal_error(exc, self._params[index].layer)

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
        if self._dirty or state.captures or state.expected:
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

    def train_step(
        self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any, optimizer: Any
    ) -> Sequence[Any] | None:
        """Zero the gradients, run ``loss_fn(model(inputs), *loss_args).backward()``, and step
        ``optimizer`` when given. Gradients stay on ``p.grad`` for ``close_step``."""
        model = self._model
        if model is None:
            raise ConfigError("train_step needs a model; watch(model) was given none.")
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), *loss_args)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ConfigError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                f"{tuple(loss.shape) if isinstance(loss, Tensor) else ''}."
            )
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return None

    def callback(self, **options: Any) -> Any:
        """Return a Lightning callback bound to this Watcher (``Trainer(callbacks=[...])``).

        Args:
            **options: ``stop_on=`` and ``log=`` of
                :class:`graddebug_torch.lightning.GradDebugCallback`.

        Raises:
            MissingFrameworkError: Lightning is not installed.
        """
        from graddebug_torch.lightning import GradDebugCallback

        return GradDebugCallback.bound(self._ctx, self, **options)

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Hook ``tensor`` so that its gradient is recorded (and altered) under ``name``."""
        if not isinstance(tensor, Tensor):
            raise ConfigError(
                f"tap({type(tensor).__name__}, {name!r}): the torch adapter taps torch.Tensor "
                "objects only."
            )
        if not self._ctx.recording or not torch.is_grad_enabled():
            self._intervene_unrecorded(tensor, intervention, name)
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

    def grads_changed_in_place(self) -> None:
        """Say that parameter gradients changed in place unseen by autograd's version counter.

        ``GradScaler.unscale_`` divides them by the loss scale that way. The norms taken while
        the gradients accumulated are then stale, and the step measures them again on closing.
        """
        self._changed_in_place = True

    # -- optimizer= -------------------------------------------------------------------------

    def _bind_optimizer(self, optimizer: Any) -> torch.optim.Optimizer | None:
        if optimizer is None:
            return None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer={optimizer!r} is a {type(optimizer).__name__}, not a "
                "torch.optim.Optimizer; pass the optimizer whose step() ends each training step."
            )
        if self._params:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if not any(id(p.param) in held for p in self._params):
                watched = ", ".join(f"{p.layer}.{p.tensor}" for p in self._params[:5])
                raise ConfigError(
                    f"optimizer={type(optimizer).__name__} holds none of the watched parameters "
                    f"({watched}{', ...' if len(self._params) > 5 else ''}); pass the optimizer "
                    "built from this model's parameters, e.g. torch.optim.SGD(model.parameters())."
                )
        return optimizer

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Close the step after ``optimizer.step()``: the gradients are still on ``p.grad``.

        A ``dbg.step()`` between backward and ``optimizer.step()`` closes the step early; then
        this hook does nothing. One after ``optimizer.step()`` finds nothing to close and
        raises (see :meth:`close_step`).
        """
        if self._user_closed and not self._dirty:
            self._user_closed = False
            return
        self._dirty = True  # an optimizer step always ends a step, even one that captured nothing
        self._in_hook = True
        try:
            self._ctx.step()
        except GradDebugError:
            raise
        except Exception as exc:  # fail-open: the user's optimizer step has already happened
            self._ctx.internal_error(exc, f"{type(optimizer).__name__}.step")
        finally:
            self._in_hook = False
            self._user_closed = False

    # -- hooks ------------------------------------------------------------------------------

    def _on_forward(self, layer: _Layer, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self._ctx
        if not ctx.recording or not torch.is_grad_enabled():
            if layer.intervention is not None:  # keep unrecorded steps free of work otherwise
                for _, tensor in _flatten(output):
                    self._intervene_unrecorded(tensor, layer.intervention, layer.name)
            return
        try:
            if layer.depth < 0:
                layer.depth = self._take_depth()
            tensors = (("output", output),) if isinstance(output, Tensor) else _flatten(output)
            for tname, tensor in tensors:
                if not tensor.is_floating_point():
                    continue
                if layer.capture:
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
        if layer.capture:
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

    def _intervene_unrecorded(self, tensor: Tensor, spec: Intervention | None,
                              name: str) -> None:
        """Interventions act on every step: on steps ``every=`` skips, alter without recording."""
        if spec is not None and spec.active and tensor.requires_grad:
            hook = functools.partial(self._intervene, spec, name)
            self._state.handles.append(tensor.register_hook(hook))

    def _intervene(self, spec: Intervention, name: str, grad: Tensor) -> Tensor:
        return intervene_fail_open(
            spec, name, grad, apply_intervention,
            lambda out, g: isinstance(out, Tensor) and out.shape == g.shape,
            self._ctx.internal_error,
        )

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
        if seen.is_sparse:
            seen = seen.coalesce().values()
        extremes = unit_extremes(seen, _unit_dim(seen.dim(), layer.channels_first))
        capture = Capture(
            sq=square_sum(seen),
            total=seen.sum(dtype=acc_dtype(seen)),
            extremes=extremes,
            absmax=whole_absmax(seen) if extremes is None else None,
            shape=str(tuple(seen.shape)),
            numel=seen.numel(),
            pre_sq=square_sum(grad) if new is not None else None,
        )
        calls = self._state.captures.setdefault((layer.name, tname), [])
        calls.append(capture)
        if layer.keep:
            label = layer.name if tname == "output" else f"{layer.name}.{tname}"
            if len(calls) > 1:
                label = f"{label}#{len(calls) - 1}"
            self._state.kept[label] = seen.detach().cpu().numpy().copy()

    def _drop_step(self) -> None:
        for handle in self._state.handles:
            handle.remove()
        self._state = StepState()

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Turn the step's captures into records with one host transfer, then reset.

        Raises:
            WatcherStateError: ``dbg.step()`` found nothing to close because the optimizer
                given to ``watch(optimizer=...)`` has closed the step already.
        """
        if self._optimizer is not None and not self._in_hook and not self.has_pending():
            raise WatcherStateError(
                f"dbg.step() found no gradient to record: {type(self._optimizer).__name__}"
                ".step() has closed this step already, as it does each step under "
                "watch(optimizer=...). Leave dbg.step() out of the loop, or drop optimizer=."
            )
        try:
            if not record:
                return StepResult()
            depths = {name: layer.depth for name, layer in self._layers.items()}
            self.last_result = gather(step, self._state, self._param_rows(grads), depths,
                                      full=self._options.param_stats == "full")
            return self.last_result
        finally:
            self._closed_any = True
            self._changed_in_place = False
            self._dirty = False
            self._user_closed = not self._in_hook
            self._drop_step()

    def _param_rows(self, grads: Sequence[Any] | None) -> list[ParamRow]:
        live = [(i, p) for i, p in enumerate(self._params) if p.param.requires_grad]
        if grads is not None:
            grads = list(grads)
            if len(grads) != len(live):
                raise GradientCountError(
                    f"step() got {len(grads)} gradients but {len(live)} parameters are "
                    "watched (those with requires_grad=True, in named_parameters() order)."
                )
            return [ParamRow(p.layer, p.tensor, self._depth(p), g, None, p.keep)
                    for (_, p), g in zip(live, grads, strict=True)]
        rows = []
        for i, p in live:
            seen = self._state.received.get(i)
            grad = p.param.grad
            if grad is None and seen is not None:
                grad = seen.grad
            fresh = (not self._changed_in_place and seen is not None and seen.grad is grad
                     and grad._version == seen.version)
            rows.append(ParamRow(p.layer, p.tensor, self._depth(p), grad,
                                 seen.sq if fresh and seen is not None else None, p.keep))
        return rows

    def _depth(self, param: _Param) -> int:
        for name in param.owner_chain:
            layer = self._layers.get(self._name(name))
            if layer is not None and layer.depth >= 0:
                return layer.depth
        return -1


def _ancestors(qualified: str) -> Iterator[str]:
    parts = qualified.split(".") if qualified else []
    for i in range(len(parts), -1, -1):
        yield ".".join(parts[:i])


def _owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))
