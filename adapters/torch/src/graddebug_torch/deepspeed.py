"""DeepSpeed: ``graddebug.watch(engine)`` on a ``deepspeed.DeepSpeedEngine``, ZeRO 1, 2 and 3.

::

    with graddebug.watch(engine) as dbg:
        for batch in loader:
            loss = loss_fn(engine(batch.x), batch.y)
            engine.backward(loss)
            engine.step()  # at an accumulation boundary: the update closes a graddebug step

The engine's module is watched under its own names. Each optimizer update of the engine (the
``engine.step()`` at a gradient-accumulation boundary) closes a graddebug step, as
``optimizer=`` does for a torch optimizer, and the micro-batches of that update are pooled: a
layer called once per micro-batch is a layer called several times, whose sums add. So there is
no ``dbg.step()``: calling it raises :class:`~graddebug.errors.EngineStepError`.

The rows are those of one process trained on the global batch:

- a parameter row is the norm of the gradient the optimizer applies, read from each rank's
  ZeRO partition right before the update (:mod:`graddebug_torch.zero`), the loss scale divided
  out, and the pieces combined over the ranks in the step's one collective;
- a layer-output row pools the micro-batches of every rank, each divided by the number of
  ranks (the global loss is the mean of the ranks' losses, as the engine averages the
  gradients), as under DDP.

Refused, with a :class:`~graddebug.errors.ConfigError` that says what to do: an engine without
ZeRO (stage 0), ``watch(engine.module)`` of a ZeRO engine (each rank would see its own
partition or none: the error says to pass the engine), ``optimizer=`` and
``scaler=`` (the engine's update closes the steps and the loss scale is the engine's), and
``graddebug.check`` and ``dbg.callback()``, which run loops of their own. ``keep=`` keeps
layer-output gradients; a ZeRO parameter's would need an all-gather, and is not kept (one
warning). Interventions act on layer outputs as on any torch module: they alter a
micro-batch's gradient, which backward then accumulates into the partitions.

DeepSpeed is never imported here: an engine is recognised through ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from graddebug.adapter import ReadAhead, StepResult, WatchContext, WatchOptions
from graddebug.errors import ConfigError, EngineStepError
from graddebug_torch.adapter import TorchAdapter
from graddebug_torch.model import ModuleIndex
from graddebug_torch.params import TorchParam
from graddebug_torch.zero import ZeroGrads, ZeroRows, partitioned

__all__ = ["DeepSpeedAdapter", "claim", "is_engine"]

_ENGINE = "deepspeed.runtime.engine"

STEP_REFUSED = (
    "dbg.step() was called under watch(engine): the DeepSpeed engine closes each graddebug "
    "step itself, at each optimizer update (engine.step() at a gradient-accumulation "
    "boundary), with the micro-batches of that update pooled. Leave dbg.step() out of the "
    "loop; dbg.record_loss(loss) after engine.step() records the loss.")

KEEP_WARNING = (
    "graddebug: keep= names {layers}, whose parameters DeepSpeed ZeRO partitions over the ranks; "
    "their full gradients would need an all-gather and are not kept (their rows are recorded, "
    "and their layer-output gradients kept).")


LOOSE_WARNING = (
    "graddebug: {params} require a gradient but the engine's ZeRO optimizer does not hold "
    "them (they are not in its parameter groups), so their p.grad is this rank's own, never "
    "reduced over the ranks; they get no row. Hand every trainable parameter to the "
    "optimizer, or freeze them (requires_grad_(False)).")


def is_engine(target: object) -> bool:
    """Whether ``target`` is a ``deepspeed.DeepSpeedEngine`` (checked only once the user
    imported DeepSpeed)."""
    cls = getattr(sys.modules.get(_ENGINE), "DeepSpeedEngine", None)
    return isinstance(cls, type) and isinstance(target, cls)


def _zero_partitioned(module: Any) -> bool:
    """Whether ``module``'s parameters are linked to a ZeRO optimizer's partitions."""
    parameters = getattr(module, "parameters", None)
    if not callable(parameters):
        return False
    return any(partitioned(p) for p in parameters())


def claim(target: object) -> type[DeepSpeedAdapter] | None:
    """The adapter of a DeepSpeed engine; None for anything else.

    Raises:
        ConfigError: ``target`` is the module of a ZeRO engine (``engine.module``).
    """
    if is_engine(target):
        return DeepSpeedAdapter
    if _zero_partitioned(target):
        raise ConfigError(
            f"watch({type(target).__name__}): its parameters are partitioned by a DeepSpeed "
            "ZeRO engine, so p.grad holds no gradient and each rank's partition is a piece of "
            "it. Pass the engine instead: graddebug.watch(engine), and leave dbg.step() out "
            "(each engine.step() at an accumulation boundary closes a step).")
    return None


class _EngineIndex(ModuleIndex):
    """The engine's module indexed as any torch module, its parameters kept out of the torch
    adapter's own close (they are read from the ZeRO partitions instead)."""

    watched: list[TorchParam]

    def params(self, chosen: Collection[str] | None,
               keep: Collection[str]) -> list[TorchParam]:
        """None for the torch adapter; the selection is kept in :attr:`watched`."""
        self.watched = super().params(chosen, keep)
        return []


class DeepSpeedAdapter(TorchAdapter):
    """Watches the module of a DeepSpeed engine; the engine's updates close the steps (see the
    module's docstring).

    Args:
        context: The Watcher.
        model: The ``deepspeed.DeepSpeedEngine``.
        params: Named tensors recorded as parameters, or None.
        options: The validated ``watch`` options.

    Raises:
        ConfigError: ``optimizer=`` or ``scaler=`` was given, the engine has no optimizer,
            or it runs without ZeRO (stage 0).
    """

    capabilities = TorchAdapter.capabilities | {ReadAhead}

    def __init__(self, context: WatchContext, model: Any, params: Mapping[str, Any] | None,
                 options: WatchOptions) -> None:
        for option in ("optimizer", "scaler"):
            if getattr(options, option) is not None:
                raise ConfigError(
                    f"watch(engine, {option}=...): the DeepSpeed engine closes each step at its "
                    "optimizer update and divides out its own loss scale; drop "
                    f"{option}=.")
        if getattr(model, "optimizer", None) is None:
            raise ConfigError(
                "watch(engine): this DeepSpeed engine has no optimizer, so no update closes a "
                "step; build it with an optimizer (deepspeed.initialize(..., optimizer=...) or "
                "the config's \"optimizer\"), or watch(engine.module) for forward/backward "
                "passes without ZeRO.")
        stage = int(model.zero_optimization_stage())
        if stage not in (1, 2, 3):
            raise ConfigError(
                f"watch(engine): this DeepSpeed engine runs ZeRO stage {stage}; graddebug reads "
                "the gradients of ZeRO stages 1, 2 and 3 from their partitions, and stage 0 is "
                "not covered. In fp32 without ZeRO the engine averages p.grad as DDP does: "
                "watch(engine.module) and call dbg.step() after engine.backward() at each "
                "accumulation boundary, before engine.step().")
        index = _EngineIndex(model.module)
        super().__init__(context, model.module, params, options, index=index)
        self._engine = model
        held = [p for p in index.watched if partitioned(p.param)]
        self._loose = [f"{p.layer}.{p.tensor}" for p in index.watched
                       if p.param.requires_grad and not partitioned(p.param)]
        self._zero = ZeroGrads(model.optimizer, held, full=options.param_stats == "full")
        self._kept = sorted({p.layer for p in held if p.keep})
        self._closing = False

    def attach(self) -> None:
        """Attach the module's hooks, note which parameters get gradients, and close a step
        at each update of the engine's optimizer (its ``step`` wrapped on the instance)."""
        super().attach()
        self._zero.attach()
        if self._ranks is not None:
            layers = self._layers
            self._ranks = ZeroRows(
                self._ranks.layouts.world,
                lambda name: name in layers and layers[name].channels_first,
                self._ctx.warn_once, self._zero, self._param_depth)
            self._watch.layouts = self._ranks.layouts
        if self._loose:
            self._ctx.warn_once("deepspeed-loose", LOOSE_WARNING.format(
                params=", ".join(self._loose[:5]) + (", ..." if len(self._loose) > 5 else "")))
        if self._kept:
            self._ctx.warn_once("deepspeed-keep", KEEP_WARNING.format(
                layers=", ".join(repr(n) for n in self._kept)))
        optimizer = self._engine.optimizer
        optimizer.step = self._closing_step(optimizer.step)

    def _closing_step(self, update: Callable[..., Any]) -> Callable[..., Any]:
        """The optimizer's ``step``: the pieces read before it, the graddebug step closed
        after it (where ``optimizer=`` closes one)."""
        ctx = self._ctx

        def step(*args: Any, **kwargs: Any) -> Any:
            if ctx.recording:
                with self._fail_open("DeepSpeed partitions"):
                    self._zero.read()
            out = update(*args, **kwargs)
            with self._fail_open("DeepSpeed clip"):
                self._zero.clipped()
            self._closing = True
            try:
                ctx.watcher.step()
            finally:
                self._closing = False
            return out

        return step

    def detach(self) -> None:
        """Unwrap the optimizer's ``step``, then remove every hook."""
        vars(self._engine.optimizer).pop("step", None)
        self._zero.detach()
        super().detach()

    def has_pending(self) -> bool:
        """Never: the engine's updates close every step, and micro-batches after the last
        update are no step (the ``with`` block's end records nothing of them)."""
        return False

    def pending_for_close(self) -> bool:
        """True for the engine's own close.

        Raises:
            EngineStepError: ``dbg.step()`` was called.
        """
        if not self._closing:
            raise EngineStepError(STEP_REFUSED)
        return True

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Close the engine's update: the torch adapter's rows with the ZeRO pieces' (in one
        process added here; with several, before the ranks combine them).

        Raises:
            EngineStepError: ``dbg.step()`` was called.
        """
        if not self._closing:
            raise EngineStepError(STEP_REFUSED)
        try:
            result = super().close_step(step, grads, record)
            if record and not result.shared:
                with self._fail_open("DeepSpeed partitions"):
                    return self._zero.add_to(step, result, self._param_depth)
            return result
        finally:
            self._zero.clear()

    def train_step(self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any,
                   optimizer: Any) -> Sequence[Any] | None:
        """Refused: the engine runs the training step.

        Raises:
            ConfigError: Always.
        """
        raise ConfigError(
            "graddebug.check and dbg.train_step run a training step of their own; a DeepSpeed "
            "engine runs its own (engine(x), engine.backward(loss), engine.step()): use "
            "`with graddebug.watch(engine)` around that loop.")

    def callback(self, **options: Any) -> Any:
        """Refused: the engine's updates close the steps, no callback is needed.

        Raises:
            ConfigError: Always.
        """
        raise ConfigError(
            "dbg.callback() closes a step after each batch of a training loop; under "
            "watch(engine) each DeepSpeed update closes one already: drop the callback.")
