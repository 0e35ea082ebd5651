"""Capture and intervention for PyTorch: forward hooks attach tensor hooks to layer outputs."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import BaseAdapter, Distribution, StepResult, WatchContext, WatchOptions
from graddebug.capture.layers import (
    Intervention,
    LayerSpec,
    intervene_fail_open,
    keep_label,
    select_layers,
)
from graddebug.errors import ConfigError
from graddebug.records import Event, EventKind
from graddebug_torch.compiled import (
    NEEDS_GRAD,
    NO_FORWARD_WARNING,
    SEVERED,
    UNJUDGED,
    UNJUDGED_WARNING,
    Ran,
    run_eagerly,
    trace_forward,
    tracing,
)
from graddebug_torch.guards import (
    FUNCTORCH_WARNING,
    ModuleOwners,
    check_mask_device,
    in_functorch_transform,
    transform_running,
)
from graddebug_torch.ops import OpCapture
from graddebug_torch.outputs import (
    CHANNELS_FIRST,
    KEEPS_FINITE,
    SEVERED_DETAIL,
    any_requires_grad,
    fits,
    flatten,
    watched_by_default,
)
from graddebug_torch.outputs import unit_dim as _unit_dim  # patched by the fail-open tests
from graddebug_torch.params import (
    TorchParam,
    check_optimizer,
    given_params,
    model_params,
    number_groups,
    param_rows,
    release_rows,
)
from graddebug_torch.parking import HookParking
from graddebug_torch.scaler import LossScaling
from graddebug_torch.sharded import is_sharded, reduce_sharded
from graddebug_torch.staging import SmallGrads
from graddebug_torch.stats import (
    DotSums,
    apply_intervention,
    square_sum,
    unit_extremes,
    whole_absmax,
)
from graddebug_torch.step import (
    Capture,
    CollectorPause,
    ForwardChecks,
    ParamRow,
    StepCaptures,
    gather,
    kept_array,
    shape_text,
)
from graddebug_torch.valueflow import ValueFlows, needs_value_flow, never_cuts
from graddebug_torch.wrappers import class_name, clean_name, compiled, unwrap

__all__ = ["TorchAdapter"]

def _grad_mark(grad: Tensor | None) -> tuple[int, int] | None:
    """Which gradient a tensor's ``.grad`` holds, and how often it changed in place."""
    if grad is None:
        return None
    # FSDP2 accumulates into the slice, unseen by the DTensor's own version counter.
    local: Tensor = grad.to_local() if is_sharded(grad) else grad  # type: ignore[attr-defined]
    return id(grad), local._version


class TorchAdapter(BaseAdapter):
    """Watches a ``torch.nn.Module``, named tensors (``params=``), and taps.

    Activation gradients come from tensor hooks that forward hooks attach to each watched
    module's outputs; parameter gradients are read from ``p.grad`` when the step closes. All
    statistics stay on the device until ``close_step`` moves them to the host in one transfer.
    """

    name = "torch"
    _scaling: LossScaling  # the watch(scaler=...) GradScaler, set up in attach

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
        super().__init__(context, options)
        self._model: nn.Module | None = model  # what the user calls (a wrapper, maybe)
        self._root: nn.Module | None = unwrap(model) if model is not None else None
        self._modules: dict[str, nn.Module] = {}
        self._params: list[TorchParam] = []
        self._handles: list[RemovableHandle] = []
        self._staging = SmallGrads()  # gradients
        self._sums = DotSums()
        self._pause = CollectorPause()
        self._forward_staging = SmallGrads()  # outputs, for the forward check
        self._state = StepCaptures(forward=ForwardChecks(self._forward_staging, self._sums))
        self._owners = ModuleOwners()
        self._grad_hooks: dict[tuple[str, str], Callable[[Tensor], Tensor | None]] = {}
        self._was_training: bool | None = None
        self._flows = ValueFlows()
        # Forward hooks taken off the modules on the steps every= skips; _parks says whether
        # that may be done (not once a compiled graph has called back from them).
        self._parking = HookParking()
        self._parks = False
        # Forward hooks that find nothing once their layer's depth is known (see _drop_idle).
        self._idle: list[tuple[LayerSpec, RemovableHandle]] = []
        # Per sharded parameter (by index), its gradient's identity and version when the last
        # step closed: FSDP2 may set .grad without running the post-accumulate hooks.
        self._sharded_marks: dict[int, tuple[int, int] | None] = {}
        self._ops = OpCapture(self)
        self._resolve(params)
        self._sharded = [i for i, p in enumerate(self._params) if p.sharded]

    # -- set-up ----------------------------------------------------------------------------

    def _resolve(self, params: Mapping[str, Any] | None) -> None:
        options = self._options
        if self._root is not None:
            named = {self._name(n): m for n, m in self._root.named_modules()}
            self._modules = self._add_layers(
                named, self._select(named, options.layers),
                lambda m: isinstance(m, CHANNELS_FIRST), lambda m: type(m) in KEEPS_FINITE)
            chosen = None if options.layers is None else set(self._modules)
            self._params = model_params(self._root, self._name, chosen, options.keep)
        if params:
            self._params += given_params(params, options.keep)
            self._add_param_keys(params)
        number_groups(self._params)

    def _name(self, qualified: str) -> str:
        name = clean_name(qualified)
        if name or self._root is None:
            return name
        return class_name(self._root)

    def _select(self, named: dict[str, nn.Module], layers: Sequence[Any] | None
                ) -> dict[str, nn.Module]:
        if layers is None:
            return {n: m for n, m in named.items() if watched_by_default(m)}
        owner = class_name(self._root) if self._root is not None else ""
        return select_layers(named, layers, noun="module", owner=owner)

    def _model_layer_names(self) -> list[str]:
        if self._root is None:
            return []
        return [self._name(n) for n, _ in self._root.named_modules()]

    # -- Adapter protocol ---------------------------------------------------------------

    def attach(self) -> None:
        """Register one forward hook per watched module and one post-accumulate hook per
        watched parameter; follow the ``scaler=`` GradScaler.

        Raises:
            ConfigError: ``scaler=`` is not a ``torch.amp.GradScaler``.
        """
        self._scaling = LossScaling(
            self._options.scaler, [(p.layer, p.tensor, p.param) for p in self._params],
            self._fail_open("GradScaler"))
        for name, spec in self._options.intervene.items():
            check_mask_device(spec, name)
        self._owners.claim(self._modules, class_name(self._root) if self._root is not None
                           else "params")
        if self._model is not None:
            self._was_training = self._model.training
        parking = self._parking
        # A compiled model traces the root module's hooks into its graph, and a graph must
        # serve the next Watcher too: the collector is left alone in its forward pass. Dynamo
        # guards on the module hooks, so none is removed while the watch lasts either.
        target = self._model if self._model is not None else self._root
        runs_compiled = target is not None and compiled(target)
        for name, module in self._modules.items():
            layer = self._layers[name]
            hook = module.register_forward_hook(functools.partial(self._on_forward, layer))
            handles = [hook]
            if not layer.capture and not runs_compiled and never_cuts(module):
                self._idle.append((layer, hook))
            if needs_value_flow(module):
                handles += self._flows.follow(
                    module, lambda: self._ctx.recording and torch.is_grad_enabled(),
                    functools.partial(self._fail_open, name))
            self._handles += handles
            if layer.intervention is None:  # interventions act on every step
                parking.add(module, handles)
        for index, param in enumerate(self._params):
            if param.param.requires_grad:
                self._handles.append(param.param.register_post_accumulate_grad_hook(
                    functools.partial(self._on_param_grad, index)))
        # Only graddebug's per-output objects (and op capture's) are worth pausing it for.
        makes_objects = self._ops.enabled or any(self._layers[n].capture for n in self._modules)
        if self._root is not None and makes_objects and not runs_compiled:
            collector = [self._root.register_forward_pre_hook(self._forward_begins),
                         self._root.register_forward_hook(self._forward_ends, always_call=True)]
            self._handles += collector
            parking.add(self._root, collector)
        self._scaling.attach()
        self._ops.attach()
        # A compiled graph keeps the hooks it was traced with, so hooks parked while dynamo
        # traces would be missing from it on recorded steps too; op capture hooks the root.
        self._parks = self._options.every > 1 and not runs_compiled and not self._ops.enabled
        self._park_for(self._ctx.step_index)

    def follow_optimizer(self, optimizer: Any, on_step: Callable[[], None]) -> None:
        """Call ``on_step`` after each ``optimizer.step()`` (a step post-hook, removed on
        exit): the gradients are still on ``p.grad`` then. Under ``scaler=``, a
        ``scaler.step(optimizer)`` that skips ``optimizer.step()`` calls it too.

        Raises:
            ConfigError: ``optimizer`` is not a ``torch.optim.Optimizer`` or holds none of the
                watched parameters.
        """
        optimizer = check_optimizer(optimizer, self._params)
        stepped = self._scaling.follow(optimizer, on_step)
        self._handles.append(optimizer.register_step_post_hook(
            lambda opt, args, kwargs: stepped()))

    def detach(self) -> None:
        """Remove every module and tensor hook; restore ``model.training`` and the scaler."""
        scaling = getattr(self, "_scaling", None)  # None when attach failed early
        if scaling is not None:
            scaling.detach()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._idle.clear()
        self._parking.clear()
        self._flows.clear()
        self._ops.detach()
        self._owners.release()
        self._drop_step()
        self._staging = SmallGrads()  # the staging buffers go with the hooks
        if self._model is not None and self._was_training is not None:
            self._model.train(self._was_training)

    def has_pending(self) -> bool:
        """Whether the open step captured anything, or holds gradients nobody recorded (read
        from Python state)."""
        state = self._state
        if state.touched or state.captures or state.expected or state.transformed:
            return True
        if self._ctx.step_index == 0:
            return any(p.param.grad is not None for p in self._params)
        params = self._params
        return any(params[i].param.grad is not None
                   and _grad_mark(params[i].param.grad) != self._sharded_marks.get(i)
                   for i in self._sharded)

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

        return GradDebugCallback.bound(self._ctx.watcher, **options)

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Hook ``tensor`` so that its gradient is recorded (and altered) under ``name``."""
        if tracing():
            # Dynamo cannot trace a tap's bookkeeping into a graph: the tap runs eagerly, at
            # the cost of one graph break, and records as in eager mode.
            return run_eagerly(self.tap, tensor, name, intervention)
        if not isinstance(tensor, Tensor):
            raise ConfigError(
                f"tap({type(tensor).__name__}, {name!r}): the torch adapter taps torch.Tensor "
                "objects only."
            )
        check_mask_device(intervention, name)
        layer = self._tap_layer(name, intervention)
        if in_functorch_transform():
            self._skip_transformed()
            return tensor
        if not self._ctx.recording or not torch.is_grad_enabled():
            self._intervene_unrecorded(tensor, intervention, name)
            return tensor
        if layer.depth < 0:
            layer.depth = self._take_depth()
        state = self._state
        if not tensor.requires_grad:
            detail = ("the tapped tensor does not require a gradient although an earlier tap "
                      "did, so the graph was cut between them") if state.tap_requires_grad else (
                "the tapped tensor does not require a gradient, so none can reach it: it was "
                "cut from the graph (.detach(), no_grad, a numpy round trip) or never needed one")
            state.events.append(Event(self._ctx.step_index, name, "output", layer.depth,
                                      EventKind.DETACHED_OUTPUT.value, detail))
            return tensor
        state.tap_requires_grad = True
        self._watch_tensor(layer, "output", tensor)
        return tensor

    # -- hooks ------------------------------------------------------------------------------

    def _on_param_grad(self, index: int, param: Tensor) -> None:
        """The post-accumulate hook of a watched parameter: it holds the gradient, so that
        ``step()`` may come after ``zero_grad(set_to_none=True)``.

        Every parameter gradient is measured when the step closes, in one fused pass, as it
        is then: after accumulation, clipping, unscaling or a multi-rank all-reduce. A kernel
        per gradient here, inside the backward pass, cost more than that pass.
        """
        state = self._state
        state.touched = True
        grad = param.grad
        if grad is not None and self._ctx.recording:
            state.received[index] = grad

    def _forward_begins(self, module: nn.Module, args: Any) -> None:
        """The root module's forward starts: pause the collector on recorded steps."""
        if torch.compiler.is_compiling() or not (self._ctx.recording
                                                 and torch.is_grad_enabled()):
            return
        self._pause.resume()  # a backward pass that raised before its end left it paused
        self._pause.pause()

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root module's forward returned or raised: resume the collector."""
        if not torch.compiler.is_compiling():
            self._pause.resume()

    def _skip_transformed(self) -> None:
        """A forward or a tap inside a ``torch.func`` transform: skipped, with one warning."""
        self._state.transformed = True
        self._ctx.warn_once("functorch", FUNCTORCH_WARNING)

    def _on_forward(self, layer: LayerSpec, module: nn.Module, args: Any, output: Any) -> None:
        if tracing():
            # Dynamo is tracing this hook into a compiled graph, whose operators call back
            # here (args is then a Ran) and _on_grad when it runs: see graddebug_torch.compiled.
            if torch.is_grad_enabled():
                trace_forward(layer, module, args, output)
            return
        ctx = self._ctx
        if isinstance(args, Ran):  # a compiled forward, calling back as it runs
            self._parks = False  # the hooks come back when the step closes
            self._idle.clear()  # and stay
            if ctx.recording:
                with self._fail_open(layer.name):
                    if layer.depth < 0:
                        layer.depth = self._take_depth()
                    state = self._state
                    for tname, check, flag in zip(args.names, args.checks, args.flags,
                                                  strict=True):
                        key = (layer.name, tname)
                        if check is not None:
                            state.forward.add(key, layer.depth, check)
                        if flag & NEEDS_GRAD:
                            state.expected.setdefault(key, layer.depth)
                        if flag & SEVERED:
                            state.events.append(Event(
                                ctx.step_index, layer.name, tname, layer.depth,
                                EventKind.DETACHED_OUTPUT.value, SEVERED_DETAIL))
                        if flag & UNJUDGED:
                            ctx.warn_once("compiled-value-flow",
                                          UNJUDGED_WARNING.format(layer=layer.name))
            return
        if not ctx.recording:  # a step every= skips: nothing to do but interventions
            if layer.intervention is not None and not transform_running():
                self._intervene_outputs(layer, output)
            return
        flow = self._flows.finished(module)  # left unread on skipped steps: replaced per call
        if transform_running():
            self._skip_transformed()
            return
        if not torch.is_grad_enabled():
            if layer.intervention is not None:
                self._intervene_outputs(layer, output)
            return
        with self._fail_open(layer.name):
            if layer.depth < 0:
                layer.depth = self._take_depth()
            tensors = (("output", output),) if isinstance(output, Tensor) else flatten(output)
            for tname, tensor in tensors:
                if not tensor.is_floating_point():
                    continue
                if layer.capture:
                    self._watch_tensor(layer, tname, tensor)
                if tensor.requires_grad or not any_requires_grad(args):
                    continue
                # Without a ValueFlow the module owns trainable parameters (starved by this
                # output) or is a torch.nn module, which never drops a gradient on purpose.
                if flow is None or flow.escaped or flow.marked(tensor):
                    self._state.events.append(
                        Event(ctx.step_index, layer.name, tname, layer.depth,
                              EventKind.DETACHED_OUTPUT.value, SEVERED_DETAIL)
                    )

    def _watch_tensor(self, layer: LayerSpec, tname: str, tensor: Tensor) -> None:
        key = (layer.name, tname)
        state = self._state
        spec = layer.intervention
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            layer.check_mask(spec.mask, tuple(tensor.shape), isinstance(spec.mask, Tensor))
        if layer.capture and layer.check_forward:
            # Forward finiteness check: one reduction, read at the step's single sync.
            state.forward.check(key, layer.depth, tensor)
        if not tensor.requires_grad:
            return
        state.expected.setdefault(key, layer.depth)
        hook = self._grad_hooks.get(key)
        if hook is None:  # one per output, reused every step
            hook = self._grad_hooks[key] = functools.partial(self._on_grad, layer, tname)
        state.hooks.add(tensor, hook)

    def _intervene_outputs(self, layer: LayerSpec, output: Any) -> None:
        """Set the interventions of ``layer`` on an output that is not recorded."""
        for _, tensor in flatten(output):
            self._intervene_unrecorded(tensor, layer.intervention, layer.name)

    def _intervene_unrecorded(self, tensor: Tensor, spec: Intervention | None,
                              name: str) -> None:
        """Interventions act on every step: on steps ``every=`` skips, alter without recording."""
        if spec is not None and spec.active and tensor.requires_grad:
            hook = functools.partial(self._intervene, spec, name)
            self._state.hooks.add(tensor, hook)

    def _intervene(self, spec: Intervention, name: str, grad: Tensor) -> Tensor:
        return intervene_fail_open(spec, name, grad, apply_intervention, fits,
                                   self._ctx.internal_error)

    def _on_grad(self, layer: LayerSpec, tname: str, grad: Tensor) -> Tensor | None:
        spec = layer.intervention
        new = None
        if spec is not None and spec.active:
            new = self._intervene(spec, layer.name, grad)
        if not self._ctx.recording:
            # Only a compiled graph calls this on a step that every= skips: its operators run
            # on every step, where eager hooks are set on recorded steps alone.
            return new
        with self._fail_open(layer.name):
            self._record_grad(layer, tname, grad, new)
        return new

    def _record_grad(self, layer: LayerSpec, tname: str, grad: Tensor,
                     new: Tensor | None) -> None:
        if not self._pause.paused:
            self._pause.until_backward_ends()
        seen = new if new is not None else grad
        if seen.is_sparse:
            seen = seen.coalesce().values()
        unit_dim = _unit_dim(seen.dim(), layer.channels_first)
        if new is None and SmallGrads.fits(seen):
            group = self._staging.group(seen, unit_dim)
            capture = Capture.pending(
                group, group.put(seen), shape_text(seen.shape), seen.numel(),
                seen.shape[unit_dim] if unit_dim is not None else 0)
        else:
            # The extremes (absmax, zero_frac) are two passes more: on full steps only.
            full = layer.keep or self._ctx.full_stats
            extremes = unit_extremes(seen, unit_dim) if full else None
            sq, total = self._sums.sentinel(seen)
            capture = Capture(
                sq=sq,
                total=total,
                extremes=extremes,
                absmax=whole_absmax(seen) if full and extremes is None else None,
                shape=shape_text(seen.shape),
                numel=seen.numel(),
                pre_sq=square_sum(grad) if new is not None else None,
                n_units=0 if extremes is None else extremes[0].numel(),
            )
        before = self._state.add((layer.name, tname), capture)
        if layer.keep:
            label = keep_label(layer.name, tname, before)
            self._state.kept[label] = kept_array(new if new is not None else grad)

    # -- closing a step ---------------------------------------------------------------------

    def _drop_step(self) -> None:
        self._pause.resume()
        self._state.hooks.remove()
        self._state = StepCaptures(forward=ForwardChecks(self._forward_staging, self._sums))
        self._staging.clear()
        self._forward_staging.clear()

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Turn the step's captures into records with one host transfer, then reset.

        Sharded parameters (FSDP2) add one collective over every rank, before anything else
        that could fail on one rank only. A bug in here becomes an ``internal_error`` finding
        and an empty step; a wrong ``grads`` list (the user's mistake) raises.
        """
        rows: list[ParamRow] = []
        try:
            if not record:
                return StepResult()
            state = self._state
            if (state.touched and not (state.forward or state.expected or state.transformed)
                    and any(self._layers[name].capture for name in self._modules)):
                self._ctx.warn_once("no-forward", NO_FORWARD_WARNING.format(step=step))
            rows = param_rows(self._params, state.received, grads, self._param_depth)
            full = self._options.param_stats == "full"
            with self._fail_open("step"):
                # While an exception unwinds (the with block closing the step of a crashed
                # rank) the other ranks may never reach the collective: sharded rows are left
                # out rather than wait for them.
                unwinding = sys.exc_info()[0] is not None
                sharded = None if unwinding else reduce_sharded(
                    [r.grad for r in rows if r.sharded], full, self._ctx.internal_error)
                depths = {name: layer.depth for name, layer in self._layers.items()}
                scale = self._scaling.read()  # queued before the step's sync, read after it
                return self._ops.close(scale.unscale(step, gather(
                    step, state, rows, depths, full=full, staging=self._staging,
                    sharded=sharded, on_bug=self._ctx.internal_error)))
            return StepResult(events=list(state.events))
        finally:
            release_rows(rows)
            self._scaling.next_pass()
            self._mark_sharded()
            self._drop_step()
            if self._idle:
                self._drop_idle()
            self._park_for(step + 1)

    def _drop_idle(self) -> None:
        """Remove the forward hooks left with nothing to do.

        A layer whose outputs are not recorded (``outputs=False``) needs its forward hook for
        two things: its depth, set at its first recorded forward, and the cut check on its
        outputs. A module of torch's own, children included, computes from its inputs and
        never cuts the graph, so once its depth is known its hook can find nothing; removed,
        it no longer sends every call of the module down torch's slower path for modules with
        hooks.
        """
        idle = []
        for layer, handle in self._idle:
            if layer.depth >= 0:
                handle.remove()
            else:
                idle.append((layer, handle))
        self._idle = idle

    def _park_for(self, step: int) -> None:
        """Park the forward hooks before a step ``every=`` skips; put them back before a
        recorded one (see :mod:`graddebug_torch.parking`)."""
        parking = self._parking
        if not (self._parks or parking.parked):
            return
        with self._fail_open("every"):
            if self._parks and step % self._options.every:
                parking.park()
            elif parking.parked:
                parking.restore()

    def _mark_sharded(self) -> None:
        """Remember the sharded gradients this step closed on (see :meth:`has_pending`)."""
        for i in self._sharded:
            self._sharded_marks[i] = _grad_mark(self._params[i].param.grad)

    def distribution(self) -> Distribution:
        """This process's rank, the world size and the backend of ``torch.distributed``'s
        default process group; one process when it is not available or not initialized."""
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            return Distribution()
        return Distribution(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))

    def _param_depth(self, param: TorchParam) -> int:
        if param.depth >= 0:
            return param.depth
        depth = self._depth_of(self._name(n) for n in param.owner_chain)
        owner = self._layers.get(self._name(param.owner_chain[0]))
        if owner is not None and owner.depth >= 0:  # the owner's own depth never changes
            param.depth = depth
        return depth
