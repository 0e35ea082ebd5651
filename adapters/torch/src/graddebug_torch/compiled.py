"""Capture inside ``torch.compile``: the hooks' work as operators of the compiled graphs.

Dynamo traces a module's forward hooks into the graph it compiles. What a traced hook does to
Python objects is replayed after each run with the values it saw while tracing, so a step
counter read there becomes a constant, and every read of mutable state becomes a guard that
recompiles the model when the state changes (each step). A tensor hook registered inside the
region is traced into the backward graph and may hold tensor code only: a hook that records
into Python objects, or asks a gradient's layout (``is_contiguous``), breaks the graph.

So while dynamo traces, the forward hook reads nothing that changes between steps and writes
nothing. It emits operators that dynamo, AOTAutograd and inductor treat as opaque and keep in
order (each writes a graph input or is registered as an ordered side effect, so that no pass
removes or reorders it), and that call the watcher back when the graph runs:

- ``graddebug::forward_ran`` in the forward graph, once per call of a watched module, with
  the outputs it checks for NaN/Inf (all but batch norms'): the operator takes the check's one
  reduction when it runs, outside the kernels inductor generates;
- ``graddebug::grad_arrived`` (``graddebug::grad_replaced`` where an intervention changes the
  gradient) in the backward graph, from a tensor hook on each output, with the gradient itself.
  Dynamo traces such a hook into the backward graph as it would any tensor hook, which keeps
  in-place operations on the output working as in eager mode.

At run time the watcher's own hook methods do the bookkeeping, exactly as in eager mode. The
operators name the module by ``id``: the callback goes to the forward hook that a live watcher
has on that module now, so a graph compiled under one watcher serves the next one without a
recompile, and a module that no watcher hooks any more calls nothing back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn
from torch._library.effects import EffectType
from torch.nn.modules.batchnorm import _BatchNorm

from graddebug.capture.layers import LayerSpec
from graddebug.records import Event, EventKind
from graddebug_torch.guards import hooked_module
from graddebug_torch.outputs import SEVERED_DETAIL, any_requires_grad, flatten
from graddebug_torch.stats import finiteness
from graddebug_torch.valueflow import needs_value_flow

if TYPE_CHECKING:
    from graddebug.adapter import WatchContext
    from graddebug_torch.captures import StepCaptures

__all__ = ["COMPILE_WARNING", "NEEDS_GRAD", "NO_FORWARD_WARNING", "SEVERED", "UNJUDGED",
           "UNJUDGED_WARNING", "Ran", "record_ran", "run_eagerly", "trace_forward", "tracing",
           "wraps_compiled"]

NEEDS_GRAD = 1
"""Flag of an output that requires a gradient (a tensor hook was set on it)."""
SEVERED = 2
"""Flag of an output that requires no gradient although an input of the module does."""
UNJUDGED = 4
"""Flag of such an output of a module whose values only eager mode can follow
(:mod:`graddebug_torch.valueflow`): whether it cut the graph is not judged."""
NO_FORWARD_WARNING = (
    "graddebug: parameter gradients arrived in step {step} but no watched layer's forward "
    "pass was seen, so the step has no layer-output rows. A model compiled with torch.compile "
    "before watch() was entered, or first compiled on a step that every= skips, keeps running "
    "the graph traced without graddebug's hooks: enter watch() before the first compiled "
    "call, or call torch.compiler.reset() after entering it. A forward pass run before "
    "watch() was entered has the same effect, and so has dbg.step() called between the "
    "forward pass and backward(): call dbg.step() after backward()."
)
COMPILE_WARNING = (
    "graddebug: ops=True (or escalate=True) records the operations of eager forward passes "
    "only; the operations of a torch.compile'd model run inside dynamo's graphs, where no "
    "op-level rows or source lines are recorded. Layer-level capture goes on as usual; for "
    "op-level capture, run the model uncompiled while debugging."
)
"""Op-level capture's warning for a compiled model, whose ops it cannot see."""
UNJUDGED_WARNING = (
    "graddebug: {layer!r} ran inside torch.compile and returned an output that needs no "
    "gradient although its input needs one. graddebug follows values through such "
    "parameter-free modules in eager mode only, so it cannot tell a cut (.detach(), no_grad) "
    "from an output built from the input's shape (a mask, a position table): no cut_graph "
    "finding is made for it, or for other such modules, in compiled graphs. Watch one step "
    "of the model uncompiled to check."
)


def tracing() -> bool:
    """Whether dynamo is tracing the code that calls this (``torch.compile``, ``export``)."""
    return torch.compiler.is_compiling()


def wraps_compiled(model: Any) -> bool:
    """Whether ``model`` is, or wraps (DDP), a ``torch.compile``d module."""
    seen: set[int] = set()
    while isinstance(model, nn.Module) and id(model) not in seen:
        seen.add(id(model))
        if type(model).__name__ == "OptimizedModule":
            return True
        model = getattr(model, "module", None)
    return False


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


run_eagerly: Callable[..., Any] = torch.compiler.disable(_call)
"""``run_eagerly(fn, *args)`` calls ``fn(*args)`` outside the graph being traced: dynamo breaks
the graph there, runs the call eagerly, and goes on tracing after it."""


@dataclass(frozen=True)
class Ran:
    """A call of a watched module inside a compiled graph, handed to the watcher's forward hook
    (as its ``args``) when the graph runs.

    Attributes:
        names: The ``tensor`` name of each floating output.
        checks: The forward finiteness check of each output (None where it is not captured).
        flags: :data:`NEEDS_GRAD`, :data:`SEVERED` and :data:`UNJUDGED` bits of each output.
    """

    names: Sequence[str]
    checks: Sequence[Tensor | None]
    flags: Sequence[int]


class _Watcher(Protocol):
    """What the operators call back on: the object whose ``on_forward`` is the hook."""

    def on_grad(self, layer: LayerSpec, tname: str, grad: Tensor) -> Tensor | None:
        """The tensor hook of output ``tname`` of ``layer``."""


def _hook_of(token: int) -> tuple[functools.partial[None], nn.Module] | None:
    """The forward hook a live watcher has on the module of ``id`` ``token``, if any: the
    partial of its ``on_forward`` bound to the module's :class:`LayerSpec`."""
    module = hooked_module(token)
    if module is None:
        return None
    for hook in module._forward_hooks.values():
        if isinstance(hook, functools.partial) and hook.args and isinstance(
                hook.args[0], LayerSpec):
            return hook, module
    return None


# Operators take no list of strings: the output names travel joined by a separator that no
# name holds (ASCII's unit separator).
_SEP = "\x1f"


_SINK = torch.zeros(())
"""What ``graddebug::forward_ran`` declares that it writes, and never does: the compilers keep
an operator that writes a graph input, and run such operators in the order of the trace."""


@torch.library.custom_op("graddebug::forward_ran", mutates_args=("sink",))
def _forward_ran(sink: Tensor, checked: list[Tensor | None], token: int, names: str,
                 flags: list[int]) -> None:
    found = _hook_of(token)
    if found is not None:
        hook, module = found
        # Measured now: inductor reuses its buffers for later results of the same graph.
        checks = [None if t is None else finiteness(t) for t in checked]
        hook(module, Ran(names.split(_SEP) if names else [], checks, flags), None)


def _grad_hook_target(token: int) -> tuple[_Watcher, LayerSpec] | None:
    found = _hook_of(token)
    if found is None:
        return None
    hook = found[0]
    watcher: _Watcher = hook.func.__self__  # type: ignore[attr-defined]
    return watcher, hook.args[0]


@torch.library.custom_op("graddebug::grad_arrived", mutates_args=())
def _grad_arrived(grad: Tensor, token: int, tname: str) -> None:
    target = _grad_hook_target(token)
    if target is not None:
        target[0].on_grad(target[1], tname, grad)


@_grad_arrived.register_fake
def _(grad: Tensor, token: int, tname: str) -> None:
    return None


@torch.library.custom_op("graddebug::grad_replaced", mutates_args=())
def _grad_replaced(grad: Tensor, token: int, tname: str) -> Tensor:
    target = _grad_hook_target(token)
    new = target[0].on_grad(target[1], tname, grad) if target is not None else None
    if new is None or new.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        return grad.clone()  # an operator's output may not alias its input
    return new


@_grad_replaced.register_fake
def _(grad: Tensor, token: int, tname: str) -> Tensor:
    return torch.empty_like(grad)


# Without an effect the compilers would drop an operator that returns nothing; ordered, it
# runs where the hook ran. The forward operator writes a graph input instead (see _SINK): an
# ordered operator there would need a data input to stay in place (inductor 2.13 otherwise
# scheduled it among the kernels of a fused computation, and freed one of their inputs too
# early), and a module's output as that input makes inductor write the output to memory
# where it would have fused it into the next kernel (2.6x the plain step on a CNN).
_grad_arrived.register_effect(EffectType.ORDERED)


def _on_grad(token: int, tname: str, replace: bool, grad: Tensor) -> Tensor | None:
    # The tensor hook, traced into the backward graph: operators only. Statistics taken here
    # in graph code instead, fused by inductor, made the backward no faster (ResNet-18).
    if replace:
        out: Tensor = torch.ops.graddebug.grad_replaced(grad, token, tname)
        return out
    torch.ops.graddebug.grad_arrived(grad, token, tname)
    return None


def _norm_state(module: _BatchNorm) -> Tensor | None:
    """What a batch norm's forward check reads inside a compiled graph: the sum of the tensors
    it normalises with, which is finite exactly when its output is for a finite input (None
    when there are none: the output is then finite).

    Its output handed to any reader outside inductor's own kernels (the check, fused or not)
    made a compiled CNN's step several times slower on the CPU. The running statistics count
    only where the forward uses them (evaluation): a NaN left in them by an earlier step does
    not reach a training-mode output.
    """
    parts: list[Tensor | None] = [module.weight, module.bias]
    if not (module.training or module.running_mean is None):
        parts += [module.running_mean, module.running_var]
    sums = [p.detach().float().sum() for p in parts if p is not None]
    return torch.stack(sums).sum() if sums else None


def trace_forward(layer: LayerSpec, module: nn.Module, args: Any, output: Any) -> None:
    """The forward hook's body while dynamo traces it: emit the operators, touch no state.

    Args:
        layer: The module's layer.
        module: The module.
        args: Its positional inputs.
        output: Its output.

    Raises:
        MaskShapeError: The layer's mask does not broadcast to an output.
    """
    spec = layer.intervention
    replace = spec is not None and spec.active
    # Whether an output that needs no gradient was computed from the inputs' values can only
    # be followed eagerly (graddebug_torch.valueflow).
    severs = SEVERED if not needs_value_flow(module) else UNJUDGED
    inputs_need_grad = any_requires_grad(args)
    token = id(module)
    names: list[str] = []
    checked: list[Tensor | None] = []
    check = layer.capture and layer.check_forward
    norm = module if isinstance(module, _BatchNorm) else None
    state = _norm_state(norm) if check and norm is not None else None
    flags: list[int] = []
    for tname, tensor in flatten(output):
        if not tensor.is_floating_point():
            continue
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            # On a fresh spec: the layer's mask_checked flag, read here, would be a guard
            # that recompiles the model once it is set.
            LayerSpec(layer.name).check_mask(spec.mask, tuple(tensor.shape),
                                             isinstance(spec.mask, Tensor))
        flag = 0
        if tensor.requires_grad:
            if layer.capture:
                flag |= NEEDS_GRAD
            if layer.capture or replace:
                tensor.register_hook(functools.partial(_on_grad, token, tname, replace))
        elif inputs_need_grad:
            flag |= severs
        names.append(tname)
        checked.append(None if not check else tensor if norm is None else state)
        flags.append(flag)
    torch.ops.graddebug.forward_ran(_SINK, checked, token, _SEP.join(names), flags)


def record_ran(layer: LayerSpec, ran: Ran, state: StepCaptures, ctx: WatchContext,
               take_depth: Callable[[], int]) -> None:
    """The forward hook's body when a compiled graph calls back (a recorded step): the
    bookkeeping of eager mode, from what the traced hook handed over.

    Args:
        layer: The module's layer.
        ran: What the graph's ``graddebug::forward_ran`` operator saw.
        state: The open step's captures.
        ctx: The Watcher's hook side.
        take_depth: Hands out the next forward-order depth.
    """
    if layer.depth < 0:
        layer.depth = take_depth()
    for tname, check, flag in zip(ran.names, ran.checks, ran.flags, strict=True):
        key = (layer.name, tname)
        if check is not None:
            state.forward.add(key, layer.depth, check)
        if flag & NEEDS_GRAD:
            state.expected.setdefault(key, layer.depth)
        if flag & SEVERED:
            state.events.append(Event(ctx.step_index, layer.name, tname, layer.depth,
                                      EventKind.DETACHED_OUTPUT.value, SEVERED_DETAIL))
        if flag & UNJUDGED:
            ctx.warn_once("compiled-value-flow", UNJUDGED_WARNING.format(layer=layer.name))
