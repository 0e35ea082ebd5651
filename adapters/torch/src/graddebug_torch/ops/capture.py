"""The op mode and :class:`OpCapture`: op-level capture for one torch adapter.

The mode is pushed by a forward pre-hook on the root module and popped by its forward hook
(``always_call=True``, so also when the forward raises); anything still on torch's mode stack
on exit is popped too (a ``KeyboardInterrupt`` skips ``always_call`` hooks). An op output that
needs a gradient is held until the module it ran in returns (see :mod:`graddebug_torch.ops`).
:class:`OpCapture` records through an :class:`OpHost` and reads nothing else of the adapter.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from graddebug.adapter import StepResult, WatchContext, WatchOptions
from graddebug.capture.layers import FailOpen, Intervention, LayerSpec, is_op_site
from graddebug.records import Kind
from graddebug_torch.captures import GradHook, Key, StepCaptures
from graddebug_torch.compiled import COMPILE_WARNING, wraps_compiled
from graddebug_torch.guards import in_functorch_transform
from graddebug_torch.ops.flow import (
    TO_NUMPY,
    StepFlow,
    ValueFlow,
    arguments,
    op_events,
    writes,
)
from graddebug_torch.ops.sites import OWN, PASS_THROUGH, OpSite, Running, SiteTable
from graddebug_torch.outputs import CHANNELS_FIRST, flatten, tensors
from graddebug_torch.stats import finiteness

__all__ = ["OpCapture", "OpHost"]

_OP = Kind.OP.value


class OpHost(Protocol):
    """What op capture needs of the adapter: its side that watches layer outputs.

    Op capture reads these as plain attributes, once per op output: it adds no call of its
    own per tensor to what the layer-output hooks do.

    Attributes:
        context: The Watcher's hook side: the open step, whether it captures operations.
        layers: The layer table: every watched layer and tap by name.
        state: The open step's captures, where op rows and forward checks go.
        grad_hooks: The gradient hook of each ``(layer, tensor)``, made once, reused.
    """

    context: WatchContext
    layers: Mapping[str, LayerSpec]
    state: StepCaptures
    grad_hooks: dict[Key, GradHook]

    def take_depth(self) -> int:
        """The next forward-order depth, shared with the layers."""

    def on_grad(self, layer: LayerSpec, tname: str, grad: Tensor) -> Tensor | None:
        """The gradient hook: record ``grad`` under ``(layer.name, tname)``, intervene."""

    def fail_open(self, where: str) -> FailOpen:
        """The fail-open guard for hooks running in ``where``."""

    def intervene_unrecorded(self, tensor: Tensor, spec: Intervention | None,
                             name: str) -> None:
        """Set ``spec``'s intervention on ``tensor``'s gradient without recording it."""


@dataclass
class _Step:
    """Op-level state of the open step.

    ``checks`` lists the captured op calls in call order, each with the ``(layer, tensor)``
    key whose forward finiteness check covers its output: its own, or the layer's whose output
    it is. ``aliases`` maps the op sites whose output was a watched layer's output to that
    layer's key: their rows are the layer's rows, measured once.
    """

    index: int = -1
    used: dict[Key, OpSite] = field(default_factory=dict)
    aliases: dict[OpSite, Key] = field(default_factory=dict)
    checks: list[list[Any]] = field(default_factory=list)
    # Through a lambda: dynamo, tracing a tap's first call in a compiled function, builds the
    # adapter there and inlines the lambda, where calling the class as the factory would break
    # the graph.
    flow: StepFlow = field(default_factory=lambda: StepFlow())


@dataclass(eq=False, slots=True)
class _Pending:
    """An op output whose gradient is to be recorded, held until the module it ran in returns:
    if it is that module's output, and the module is a watched layer, its row is the layer's."""

    tensor: Tensor
    site: OpSite
    check: list[Any]


_MAX_PENDING = 32
"""Op outputs held per running module before the oldest are hooked at once (bounds the memory
a long functional forward would otherwise hold until it returns)."""


class _OpMode(TorchFunctionMode):
    """The mode active during a watched forward pass: every call goes to ``on_op``."""

    def __init__(self, capture: OpCapture) -> None:
        super().__init__()
        self._on_op = capture._on_op
        self._pending = capture._pending_ids  # the same dict for the mode's life
        self._flush = capture._flush
        self._frames = capture._sites.frames
        self._guard = capture._guard

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        """Run ``func``, then hand the call to op capture (most calls pass straight through)."""
        if func in PASS_THROUGH or self._frames.get(sys._getframe(1).f_code) == OWN:
            # Most calls: metadata, and what graddebug's own hooks compute.
            return func(*args, **(kwargs or {}))
        if self._pending:
            # An op output held for later hooking is about to be written in place: hook it
            # now, or its row would be the gradient of the value written over it.
            with self._guard:
                out_arg = kwargs.get("out") if kwargs else None
                if out_arg is not None:
                    self._flush(out_arg)
                if args:
                    target = args[0]
                    base = getattr(target, "_base", None)  # a view's write is its base's
                    if (id(target) in self._pending or id(base) in self._pending) and writes(
                            func, args, kwargs):
                        self._flush(target)
                        self._flush(base)
        out = func(*args, **(kwargs or {}))
        self._on_op(func, args, kwargs, out)
        return out


class OpCapture:
    """Op-level capture for one torch adapter.

    Inert unless ``ops=True`` or ``escalate=True``; then it hooks the root module so that
    each forward pass in which ``WatchContext.capture_ops`` holds runs under the op mode.

    Args:
        host: The adapter's layer-output side, which op rows are recorded through.
        options: The ``watch`` options.
        model: What the user calls (a wrapper, maybe), or None.
        root: The unwrapped model, or None.
        watched: The names of the modules the adapter hooks.
        name: Turns a qualified module name into its layer name.
        matched: The adapter's set of ``keep=``/``intervene=`` names that matched something.
    """

    def __init__(self, host: OpHost, options: WatchOptions, *, model: nn.Module | None,
                 root: nn.Module | None, watched: Collection[str], name: Callable[[str], str],
                 matched: set[str]) -> None:
        self._host = host
        self._options = options
        self._model = model
        self._root = root
        self._watched = watched
        self._name = name
        self.enabled = (options.ops or options.escalate) and root is not None
        self._always = options.ops  # module hooks stay on (escalation adds them per forward)
        self._handles: list[RemovableHandle] = []
        self._module_handles: list[RemovableHandle] = []
        self._sites = SiteTable(options, matched, host.take_depth)
        self._stack: list[Running] = []
        self._pending: list[list[_Pending]] = []  # per entry of _stack
        self._pending_ids: dict[int, _Pending] = {}
        self._mode: _OpMode | None = None
        self._recording = False
        self._guard = host.fail_open("op-level capture")
        self._step = _Step()
        self._flow = ValueFlow(self._hold)
        self._scope: dict[str, bool] = {}
        self._intervened = any(is_op_site(name) for name in options.intervene)

    # -- set-up ----------------------------------------------------------------------------

    def attach(self) -> None:
        """Hook the root module's forward (nothing when op-level capture is off)."""
        root = self._root
        if not self.enabled or root is None:
            return
        if wraps_compiled(self._model):
            self._host.context.warn_once("ops-compile", COMPILE_WARNING)
        self._scope = self._scopes(root)
        self._handles = [
            root.register_forward_pre_hook(self._begin),
            root.register_forward_hook(self._end, always_call=True),
        ]
        if self._always:
            self._hook_modules()

    def detach(self) -> None:
        """Remove every hook and leave no mode behind, whatever state a forward left."""
        self._leave()
        for handle in [*self._handles, *self._module_handles]:
            handle.remove()
        self._handles.clear()
        self._module_handles.clear()
        self._step = _Step()

    def _scopes(self, root: nn.Module) -> dict[str, bool]:
        """Per module name: whether ops that run in it are recorded (``layers=``)."""
        chosen = None if self._options.layers is None else set(self._watched)
        scopes = {}
        for qualified, _ in root.named_modules():
            name = self._name(qualified)
            scopes[name] = chosen is None or any(
                name == c or name.startswith(f"{c}.") for c in chosen)
        return scopes

    def _hook_modules(self) -> None:
        """Hook every module below the root, to know which module an op runs in."""
        root = self._root
        assert root is not None
        for qualified, module in root.named_modules():
            if module is root:
                continue  # the root is entered by _begin
            name = self._name(qualified)
            entry = (name, self._scope.get(name, False), isinstance(module, CHANNELS_FIRST))
            self._module_handles += [
                module.register_forward_pre_hook(functools.partial(self._push, entry)),
                module.register_forward_hook(self._pop, always_call=True),
            ]

    # -- the forward pass ------------------------------------------------------------------

    def _begin(self, module: nn.Module, args: Any) -> None:
        """The root module's forward starts: push the mode where this step captures ops."""
        if torch.compiler.is_compiling():
            return  # dynamo cannot trace the mode: compiled forwards run without it
        if self._mode is not None:
            # A forward interrupted by a BaseException (KeyboardInterrupt, caught by the
            # loop) skipped _end. (A root module that calls itself ends the outer capture
            # here too: a rare model, which loses its outer ops, never a stale mode.)
            self._leave()
        with self._guard:
            ctx = self._host.context
            if not torch.is_grad_enabled() or in_functorch_transform():
                return
            recording = ctx.capture_ops
            # Interventions on op sites act on every step, as those on layers do.
            if not recording and not (self._always and self._intervened):
                return
            if self._step.index != ctx.step_index:
                self._step = _Step(index=ctx.step_index)
            if not self._module_handles:
                self._hook_modules()
            self._recording = recording
            self._flow.buffers = {id(b) for b in module.buffers()}
            name = self._name("")
            self._stack = [(name, self._scope.get(name, True), False)]
            self._pending = [[]]
            mode = _OpMode(self)
            mode.__enter__()
            self._mode = mode

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root module's forward returned or raised: resolve its outputs, pop the mode."""
        if self._mode is None or torch.compiler.is_compiling():
            return
        try:
            with self._guard:
                name = self._stack[0][0] if self._stack else ""
                if self._flow.has_cuts:
                    self._flow.reaches(output, name)
                self._resolve(output, name)
        finally:
            self._leave()

    def _leave(self) -> None:
        """Pop the mode (and any mode an interrupted forward left above it); forget the
        forward pass; drop the module hooks escalation added for it."""
        mode, self._mode = self._mode, None
        if mode is not None and any(m is mode for m in
                                    torch.overrides._get_current_function_mode_stack()):
            while torch.overrides._pop_mode() is not mode:
                pass
        self._stack.clear()
        self._pending.clear()
        self._pending_ids.clear()
        self._flow.forget()
        if not self._always and self._module_handles:
            for handle in self._module_handles:
                handle.remove()
            self._module_handles.clear()

    def _push(self, entry: Running, module: nn.Module, args: Any) -> None:
        """A module below the root starts: ops now run in it."""
        if self._mode is not None and not torch.compiler.is_compiling():
            self._stack.append(entry)
            self._pending.append([])

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        """A module below the root returned: resolve the op outputs held while it ran."""
        if self._mode is None or len(self._stack) <= 1 or torch.compiler.is_compiling():
            return
        name = self._stack.pop()[0]
        with self._guard:
            if self._flow.has_cuts:
                self._flow.reaches(output, name)
            self._resolve(output, name)

    def _resolve(self, output: Any, module: str) -> None:
        """Hook the op outputs held while ``module`` ran; those that are its output go to the
        watched layer's row when it is one, else wait for the module that called it."""
        held = self._pending.pop() if self._pending else []
        if not held:
            return
        outputs = {id(t): name for name, t in flatten(output)} if output is not None else {}
        layer = self._host.layers.get(module)
        as_layer = (layer is not None and layer.capture and module in self._watched
                    and self._recording)
        caller = self._pending[-1] if self._pending else None
        for held_out in held:
            tname = outputs.get(id(held_out.tensor))
            if tname is not None:
                spec = held_out.site.spec
                if as_layer and not spec.keep and spec.intervention is None:
                    self._pending_ids.pop(id(held_out.tensor), None)
                    held_out.check[1] = (module, tname)
                    self._step.aliases[held_out.site] = (module, tname)
                    continue
                if caller is not None:
                    caller.append(held_out)
                    continue
            self._watch(held_out)

    def _flush(self, tensor: Any) -> None:
        """Hook a held op output now (before it is written in place)."""
        held = self._pending_ids.get(id(tensor))
        if held is None or held.tensor is not tensor:
            return
        for level in self._pending:
            if held in level:
                level.remove(held)
                break
        self._watch(held)

    # -- one operation ---------------------------------------------------------------------

    def _on_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """One op ran under the mode: name its site, follow its values, hold its outputs."""
        with self._guard:
            is_tensor = isinstance(out, Tensor)
            if not is_tensor and not isinstance(out, (tuple, list)) and (
                    getattr(func, "__name__", None) not in TO_NUMPY):
                return
            sites = self._sites
            caller = sites.caller(sys._getframe(2))
            if caller is None:
                return  # graddebug's own hooks
            site = sites.site(func, caller, self._stack[-1])
            if self._recording:
                self._flow.follow(func, site, arguments(args, kwargs),
                                  (out,) if is_tensor else out, self._step.flow)
            elif site.spec.intervention is not None:
                for tensor in tensors(out):
                    self._host.intervene_unrecorded(tensor, site.spec.intervention,
                                                    site.spec.name)

    def _hold(self, site: OpSite, tensor: Tensor) -> None:
        """Keep an op output until the module it ran in returns (see :meth:`_resolve`)."""
        held = _Pending(tensor, site, [site, None])
        self._step.checks.append(held.check)
        level = self._pending[-1]
        level.append(held)
        self._pending_ids[id(tensor)] = held
        if len(level) > _MAX_PENDING:
            self._flush(level[0].tensor)

    def _watch(self, held: _Pending) -> None:
        """Record the gradient that reaches a held op output as a row of its site."""
        host = self._host
        state = host.state
        site, tensor = held.site, held.tensor
        if self._pending_ids.get(id(tensor)) is held:
            del self._pending_ids[id(tensor)]
        spec = site.spec
        mask = spec.intervention.mask if spec.intervention is not None else None
        if mask is not None and not spec.intervention.mask_is_callable:  # type: ignore[union-attr]
            spec.check_mask(mask, tuple(tensor.shape), isinstance(mask, Tensor))
        key = held.check[1] = site.key
        self._step.used[key] = site
        state.forward.add(key, site.depth, finiteness(tensor))
        hooks = host.grad_hooks
        hook = hooks.get(key)
        if hook is None:  # one per site, reused every step
            hook = hooks[key] = functools.partial(host.on_grad, spec, site.tensor)
        state.hooks.add(tensor, hook)

    # -- closing a step --------------------------------------------------------------------

    def close(self, result: StepResult) -> StepResult:
        """Mark the step's op rows (kind ``"op"``, the site's depth) and add the op-level
        events: the first op whose output was non-finite in forward, the ops whose backward
        turned a finite gradient non-finite, and the cuts used downstream.

        Args:
            result: The step as the adapter gathered it.

        Returns:
            ``result``, changed in place.
        """
        step, self._step = self._step, _Step()
        if not step.checks and not step.flow.cuts:
            return result
        rows = self._mark_rows(step, result)
        result.events[:] = op_events(step.index, result.events, step.used, step.checks,
                                     step.aliases, rows, step.flow)
        return result

    @staticmethod
    def _mark_rows(step: _Step, result: StepResult) -> dict[OpSite, Any]:
        """Give the op sites' rows kind ``"op"`` and their depth, add the rows of sites whose
        output was a layer's (copies of the layer's row), and return each site's row."""
        used = step.used
        records = result.records
        rows = {}
        layer_rows = {}
        for i, r in enumerate(records):
            site = used.get((r.layer, r.tensor))
            if site is not None:
                records[i] = r = r._replace(kind=_OP, depth=site.depth)
                rows[site] = r
            else:
                layer_rows[(r.layer, r.tensor)] = r
        for site, key in step.aliases.items():
            found = layer_rows.get(key)
            if found is not None and site not in rows:
                rows[site] = found._replace(layer=site.spec.name, tensor=site.tensor, kind=_OP,
                                            depth=site.depth)
                records.append(rows[site])
        return rows
