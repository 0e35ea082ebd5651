"""The torch adapter: what it watches, its hooks' lifetime, and the close of each step.

:class:`TorchAdapter` resolves the watched modules and parameters, registers and removes every
hook, and closes each step. The hooks themselves live in :mod:`graddebug_torch.watching`
(layer outputs and taps), :mod:`graddebug_torch.ops` (op-level capture) and
:mod:`graddebug_torch.compiled` (inside ``torch.compile``); the close turns their captures into
records in :mod:`graddebug_torch.closing`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import BaseAdapter, Distribution, StepResult, WatchContext, WatchOptions
from graddebug.adapter.protocol import Distributed, StepClock, TrainingCallback, TrainStep
from graddebug.capture.layers import Intervention, LayerSpec
from graddebug.errors import ConfigError
from graddebug.records import Event, EventKind
from graddebug_torch.clipping import UserClips
from graddebug_torch.closing import gather
from graddebug_torch.compiled import NO_FORWARD_WARNING, run_eagerly, tracing
from graddebug_torch.distributed import ShardedMarks, distribution
from graddebug_torch.guards import ModuleOwners, check_mask_device, in_functorch_transform
from graddebug_torch.model import ModelIndex, ModuleIndex
from graddebug_torch.ops import OpCapture
from graddebug_torch.params import (
    ParamRow,
    TorchParam,
    check_optimizer,
    given_params,
    number_groups,
    param_rows,
    release_rows,
)
from graddebug_torch.parking import HookParking
from graddebug_torch.scaling import LossScaling
from graddebug_torch.sharding import RankRows, rank_rows
from graddebug_torch.updates import UpdateWatch
from graddebug_torch.valueflow import needs_value_flow, never_cuts
from graddebug_torch.watching import OutputWatch
from graddebug_torch.wrappers import class_name, compiled, unwrap

__all__ = ["TorchAdapter"]


class TorchAdapter(BaseAdapter):
    """Watches a ``torch.nn.Module``, named tensors (``params=``), and taps.

    Activation gradients come from tensor hooks that forward hooks attach to each watched
    module's outputs; parameter gradients are read from ``p.grad`` when the step closes. All
    statistics stay on the device until ``close_step`` moves them to the host in one transfer.

    The model is read through its index (:class:`graddebug_torch.model.ModelIndex`): its
    layers by name, the ``layers=`` selection, the parameters they own. The default indexes a
    ``torch.nn.Module``; a model that names its layers otherwise (Keras on the torch backend)
    passes its own, and the hooks, the close and the optimizer's view stay this class's.

    Args:
        context: The Watcher.
        model: A ``torch.nn.Module`` (wrapped or compiled), or None for ``params=`` and taps.
        params: Named tensors recorded as parameters, or None.
        options: The validated ``watch`` options.
        index: The model's index; None indexes ``model`` as a ``torch.nn.Module``.

    Raises:
        ConfigError: ``model`` is not a ``torch.nn.Module``, or a parameter or ``params=``
            value cannot be watched.
        UnknownNameError: A ``layers=`` entry matches no layer.
    """

    name = "torch"
    capabilities = frozenset({StepClock, Distributed, TrainStep, TrainingCallback})
    watch_options = frozenset({"params", "layers", "keep", "intervene", "outputs", "param_stats",
                               "optimizer", "scaler", "ops", "escalate", "full_stats_every"})
    _scaling: LossScaling  # the watch(scaler=...) GradScaler, set up in attach

    def __init__(
        self,
        context: WatchContext,
        model: Any,
        params: Mapping[str, Any] | None,
        options: WatchOptions,
        *,
        index: ModelIndex | None = None,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ConfigError(
                f"the torch adapter watches torch.nn.Module models, not {type(model).__name__}; "
                "pass tensors as params={'name': tensor} or use tap()."
            )
        super().__init__(context, options)
        self._model: nn.Module | None = model  # what the user calls (a wrapper, maybe)
        self._root: nn.Module | None = unwrap(model) if model is not None else None
        self._index: ModelIndex = index if index is not None else ModuleIndex(self._root)
        self._handles: list[RemovableHandle] = []
        self._watch = OutputWatch(context, self._layers, self._take_depth, self._fail_open)
        self._owners = ModuleOwners()
        self._was_training: bool | None = None
        # Forward hooks taken off the modules on the steps every= skips; _parks says whether
        # that may be done (not once a compiled graph has called back from them).
        self._parking = HookParking()
        self._parks = False
        # Forward hooks that find nothing once their layer's depth is known (see _drop_idle).
        self._idle: list[tuple[LayerSpec, RemovableHandle]] = []
        # The watched modules and parameters (names are checked here, on entry).
        index = self._index
        self._modules: dict[str, nn.Module] = self._add_layers(
            index.layers, index.select(options.layers), index.channels_first,
            index.keeps_finite, index.weighted)
        chosen = None if options.layers is None else set(self._modules)
        self._params: list[TorchParam] = index.params(chosen, options.keep)
        if params:
            self._params += given_params(params, options.keep)
            self._add_param_keys(params)
        number_groups(self._params)
        self._ops = OpCapture(self._watch, options, model=self._model, root=self._root,
                              watched=self._modules, name=self._index.name,
                              matched=self._matched)
        self._sharded = ShardedMarks([p.param for p in self._params if p.sharded])
        self._updates = UpdateWatch(context, self._params, options.every,
                                    self._fail_open("optimizer step"))
        self._clips = UserClips(context, self._params, lambda: self._watch.state.received)
        self._ranks: RankRows | None = None  # several ranks: their rows combined

    # -- set-up ----------------------------------------------------------------------------

    def _model_layer_names(self) -> list[str]:
        """Every layer name of the model, watched or not (for suggestions)."""
        return list(self._index.layer_names())

    @property
    def updates(self) -> UpdateWatch:
        """The optimizer's view of the watched weights (``weight_norm``, ``update_norm``).

        It follows every torch optimizer's steps by itself. An optimizer that is not a torch
        optimizer (Keras's, on the torch backend) calls its
        :meth:`~graddebug_torch.updates.UpdateWatch.before_step` and
        :meth:`~graddebug_torch.updates.UpdateWatch.after_step` around each update, with an
        object whose ``param_groups`` hold the tensors it updates in place.
        """
        return self._updates

    # -- Adapter protocol ---------------------------------------------------------------

    def attach(self) -> None:
        """Register one forward hook per watched module and one post-accumulate hook per
        watched parameter; follow the ``scaler=`` GradScaler, and every torch optimizer's
        steps (:mod:`graddebug_torch.updates`).

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
        # A compiled model traces the root module's hooks into its graph, and a graph must
        # serve the next Watcher too: the collector is left alone in its forward pass. Dynamo
        # guards on the module hooks, so none is removed while the watch lasts either.
        target = self._model if self._model is not None else self._root
        runs_compiled = target is not None and compiled(target)
        self._hook_modules(runs_compiled)
        self._hook_root(runs_compiled)
        self._scaling.attach()
        self._ops.attach()
        self._updates.attach()
        self._clips.attach()
        self._ranks = rank_rows(distribution().world_size, self._layers, self._params,
                                self._ctx.warn_once)
        self._watch.layouts = self._ranks.layouts if self._ranks is not None else None
        # A compiled graph keeps the hooks it was traced with, so hooks parked while dynamo
        # traces would be missing from it on recorded steps too; op capture hooks the root.
        self._parks = self._options.every > 1 and not runs_compiled and not self._ops.enabled
        self._park_for(self._ctx.step_index)

    def _hook_modules(self, runs_compiled: bool) -> None:
        """One forward hook per watched module (and its value-flow hooks), one post-accumulate
        hook per watched parameter."""
        parking = self._parking
        for name, module in self._modules.items():
            layer = self._layers[name]
            hook = module.register_forward_hook(functools.partial(self._watch.on_forward, layer))
            handles = [hook]
            if not layer.capture and not runs_compiled and never_cuts(module):
                self._idle.append((layer, hook))
            if needs_value_flow(module):
                handles += self._watch.flows.follow(
                    module, lambda: self._ctx.recording and torch.is_grad_enabled(),
                    functools.partial(self._fail_open, name))
            self._handles += handles
            if layer.intervention is None:  # interventions act on every step
                parking.add(module, handles)
        for index, param in enumerate(self._params):
            if param.param.requires_grad:
                self._handles.append(param.param.register_post_accumulate_grad_hook(
                    functools.partial(self._watch.on_param_grad, index)))

    def _hook_root(self, runs_compiled: bool) -> None:
        """The root module's hooks: the model's input check, and the collector that pauses the
        garbage collector over a forward pass that makes graddebug's per-output objects."""
        parking = self._parking
        # Only graddebug's per-output objects (and op capture's) are worth pausing it for.
        outputs = any(self._layers[n].capture for n in self._modules)
        makes_objects = self._ops.enabled or outputs
        # The input check goes with the forward checks of layer outputs: outputs=False asks
        # for no forward work at all once the depths are known.
        if outputs and self._model is not None and self._root is not None and not runs_compiled:
            inputs = self._root.register_forward_pre_hook(self._watch.on_model_input,
                                                          with_kwargs=True)
            self._handles.append(inputs)
            parking.add(self._root, [inputs])
        if self._root is not None and makes_objects and not runs_compiled:
            collector = [self._root.register_forward_pre_hook(self._watch.forward_begins),
                         self._root.register_forward_hook(self._watch.forward_ends,
                                                          always_call=True)]
            self._handles += collector
            parking.add(self._root, collector)

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
        measure = self._updates.after_step

        def post_hook(opt: Any, args: Any, kwargs: Any) -> None:
            # torch runs an optimizer's own post-hooks before the global ones, and this one
            # closes the step: the update is measured first, for the close to read it.
            measure(opt)
            stepped()

        self._handles.append(optimizer.register_step_post_hook(post_hook))

    def detach(self) -> None:
        """Remove every module and tensor hook; restore ``model.training`` and the scaler."""
        scaling = getattr(self, "_scaling", None)  # None when attach failed early
        if scaling is not None:
            scaling.detach()
        self._updates.detach()
        self._clips.detach()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._idle.clear()
        self._parking.clear()
        self._watch.flows.clear()
        self._ops.detach()
        self._owners.release()
        self._watch.release()
        if self._model is not None and self._was_training is not None:
            self._model.train(self._was_training)

    def has_pending(self) -> bool:
        """Whether the open step captured anything, or holds gradients nobody recorded (read
        from Python state)."""
        state = self._watch.state
        if state.touched or state.captures or state.expected or state.transformed:
            return True
        if self._ctx.step_index == 0:
            return any(p.param.grad is not None for p in self._params)
        return self._sharded.changed()

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
        watch = self._watch
        if in_functorch_transform():
            watch.skip_transformed()
            return tensor
        if not self._ctx.recording or not torch.is_grad_enabled():
            watch.intervene_unrecorded(tensor, intervention, name)
            return tensor
        if layer.depth < 0:
            layer.depth = self._take_depth()
        state = watch.state
        if not tensor.requires_grad:
            detail = ("the tapped tensor does not require a gradient although an earlier tap "
                      "did, so the graph was cut between them") if state.tap_requires_grad else (
                "the tapped tensor does not require a gradient, so none can reach it: it was "
                "cut from the graph (.detach(), no_grad, a numpy round trip) or never needed one")
            state.events.append(Event(self._ctx.step_index, name, "output", layer.depth,
                                      EventKind.DETACHED_OUTPUT.value, detail))
            return tensor
        state.tap_requires_grad = True
        watch.watch_tensor(layer, "output", tensor)
        return tensor

    # -- closing a step ---------------------------------------------------------------------

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Turn the step's captures into records with one host transfer, then reset.

        Several ranks combine their rows with one collective (:class:`RankRows`), which every
        rank makes even where its own close failed. A bug in here becomes an
        ``internal_error`` finding and an empty step; a wrong ``grads`` list (the user's
        mistake) raises.
        """
        rows: list[ParamRow] = []
        watch = self._watch
        try:
            if not record:
                return StepResult()
            state = watch.state
            if (state.touched and not (state.forward or state.expected or state.transformed)
                    and any(self._layers[name].capture for name in self._modules)):
                self._ctx.warn_once("no-forward", NO_FORWARD_WARNING.format(step=step))
            rows = param_rows(self._params, state.received, grads, self._param_depth)
            full = self._options.param_stats == "full"
            # While an exception unwinds (the with block closing the step of a crashed rank)
            # the other ranks may never reach a collective: only whole rows are kept.
            unwinding = sys.exc_info()[0] is not None
            result = None
            with self._fail_open("step"):
                depths = {name: layer.depth for name, layer in self._layers.items()}
                scale = self._scaling.read()  # queued before the step's sync, read after it
                result = self._clips.restore(self._ops.close(scale.unscale(step, gather(
                    step, state, rows, depths, full=full, staging=watch.staging,
                    whole_kept=not unwinding, weights=self._updates))))
            ranks = self._ranks
            if ranks is not None:
                with self._fail_open("ranks"):
                    if not unwinding:
                        return ranks.combine(step, result, rows)
                    if result is not None:
                        return ranks.local(result, rows)
                return StepResult(events=list(state.events))
            return result if result is not None else StepResult(events=list(state.events))
        finally:
            release_rows(rows)
            self._updates.closed()
            self._scaling.next_pass()
            self._sharded.mark()
            watch.drop_step()
            if watch.compiled_ran:  # the graph was traced with the hooks: they come back
                self._parks = False
                self._idle.clear()
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

    def distribution(self) -> Distribution:
        """This process's rank, the world size and the backend of ``torch.distributed``'s
        default process group; one process when it is not available or not initialized."""
        return distribution()

    def _param_depth(self, param: TorchParam) -> int:
        """A parameter's depth: its owner's, or the nearest ancestor's that ran forward."""
        if param.depth >= 0:
            return param.depth
        name = self._index.name
        depth = self._depth_of(name(n) for n in param.owner_chain)
        owner = self._layers.get(name(param.owner_chain[0]))
        if owner is not None and owner.depth >= 0:  # the owner's own depth never changes
            param.depth = depth
        return depth
