"""Op-level capture for PyTorch: ``watch(model, ops=True)`` and ``escalate=True``.

While a watched forward pass runs, a ``TorchFunctionMode`` sees every torch operation the
model's code calls (``torch.log``, ``F.gelu``, ``x + y``, ``.detach()``), one call level deep:
the operations inside a torch function (``F.multi_head_attention_forward``) run with the mode
popped, so each row is an operation the code wrote. Each floating output that requires a
gradient gets the adapter's tensor hook (the gradient becomes a row of kind ``"op"``) and a
finiteness check (one reduction, read at the step's single host sync).

An op site is one call site of one operation in one module. Its rows carry ``layer`` = the
module it ran in (the innermost module running, from forward pre- and post-hooks on every
module), and ``tensor`` = ``<op>@<file>:<line>``, where the file and line are the user's: the
first frame outside torch and graddebug, taken once per site and cached. Two sites that would
share a name (two ``torch.add`` on one line) get ``:2``, ``:3`` appended. Sites are told apart by
the code object and instruction of their caller, so a loop over one site is one site.

Most op outputs are also a layer's output (``F.linear`` inside ``nn.Linear``): measuring the
same gradient twice would double the cost of capture. So an op output is held until the module
it ran in returns; if it is the output of a watched layer, the op's row is a copy of the layer's
row, measured once; otherwise the op output gets a tensor hook and a finiteness check of its
own then. A held output that is about to be written in place (``add_``, ``x[i] = v``,
``F.relu(x, inplace=True)``) is hooked first, so that its row stays the gradient of the value
the op produced. At most :data:`_MAX_PENDING` outputs are held per running module.

Besides statistics, the mode follows how values flow, for the op-level events of
:mod:`graddebug.records`: which op produced each input (to find the op whose backward turned a
finite gradient into NaN), and where the graph was cut (``.detach()``, ``.data``, an op run
under ``no_grad`` or ``inference_mode``, values that left torch through ``.numpy()``), kept as
an ``op_cut`` event only when the cut values were used downstream (by an op whose output needs
a gradient, or as a module's output).

The mode is pushed by a forward pre-hook on the root module and popped by its forward hook
(``always_call=True``, so also when the forward raises); anything still on torch's mode stack
on exit is popped too (a ``KeyboardInterrupt`` skips ``always_call`` hooks). torch's own
dispatch frames, other modes' ``__torch_function__`` and graddebug's own hooks are not user
code: calls from graddebug pass through unrecorded.

This module reads the adapter's per-step state and records through its ``_on_grad``, as a part
of the adapter split out of :mod:`graddebug_torch.adapter`.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils.hooks import RemovableHandle

import graddebug
import graddebug_torch
from graddebug.adapter import StepResult
from graddebug.capture.layers import (
    LayerSpec,
    display_path,
    is_op_site,
    keep_label,
    op_site_matches,
)
from graddebug.records import Event, EventKind, Kind
from graddebug_torch.guards import in_functorch_transform
from graddebug_torch.outputs import CHANNELS_FIRST, flatten, tensors
from graddebug_torch.stats import finiteness

if TYPE_CHECKING:
    from graddebug_torch.adapter import TorchAdapter

__all__ = ["OpCapture", "OpSite"]

_OP = Kind.OP.value
_FORWARD_NONFINITE = EventKind.FORWARD_NONFINITE.value

# Functions that read metadata only, or that graddebug's own hooks call most: passed through
# before any other work (they are most of the calls a forward pass makes under a mode).
_PASS: frozenset[Any] = frozenset({
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.stride, Tensor.element_size,
    Tensor.is_floating_point, Tensor.is_complex, Tensor.get_device, Tensor.__len__,
    Tensor.is_contiguous, Tensor.data_ptr, Tensor.register_hook,
    Tensor.dtype.__get__, Tensor.shape.__get__, Tensor.device.__get__,  # type: ignore[attr-defined]
    Tensor.ndim.__get__, Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    Tensor.is_cuda.__get__, Tensor.layout.__get__,  # type: ignore[attr-defined]
    Tensor.is_nested.__get__, Tensor.is_sparse.__get__,  # type: ignore[attr-defined]
    Tensor._version.__get__, Tensor.grad_fn.__get__,  # type: ignore[attr-defined, union-attr]
})
_DETACH: frozenset[Any] = frozenset({Tensor.detach, Tensor.detach_})
_DATA = Tensor.data.__get__  # type: ignore[attr-defined]
# Values that leave torch through these may come back as new tensors (a numpy round trip).
# By name: code that wraps Tensor.numpy (a profiler, a test counting host syncs) hands the mode
# the original method, which an identity check taken at import could miss.
_TO_NUMPY = frozenset({"numpy", "__array__"})
_FROM_VALUES: frozenset[Any] = frozenset({torch.tensor, torch.as_tensor, torch.asarray})

# What a frame of the call stack is, for naming an op's site.
_CALLER, _DISPATCH, _OWN = 0, 1, 2
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIRS = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (graddebug, graddebug_torch))
# torch's files that only dispatch a call to the mode (Python wrappers of torch functions).
_DISPATCH_FILES = frozenset(os.path.join(_TORCH_DIR, f) for f in (
    "overrides.py", "_tensor.py", "functional.py", "_jit_internal.py",
    os.path.join("nn", "functional.py"),
))


@functools.cache
def _op_name(func: Callable[..., Any]) -> str:
    """``torch.log``, ``torch.Tensor.add``, ``torch.nn.functional.gelu``, ``torch.Tensor.data``."""
    own = getattr(func, "__name__", None)
    name = resolve_name(func) or (
        f"{getattr(func, '__module__', None) or 'torch'}."
        f"{getattr(func, '__qualname__', None) or own or 'op'}")
    where, _, last = name.rpartition(".")
    if own and last != own and where:  # an alias: torch.mm is also listed as torch.spmm
        name = f"{where}.{own}"
    return name.removesuffix(".__get__")


def _arguments(args: Any, kwargs: Any) -> list[Tensor]:
    """The tensors among an op's arguments, and in lists of them (``torch.cat``): one level
    deep, without a generator per level (this runs for every op of the forward pass)."""
    found = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, Tensor)]
    return found


@dataclass(eq=False, slots=True)
class OpSite:
    """One call site of one operation in one module, with what its rows carry.

    Attributes:
        spec: Its layer entry for the adapter's hooks: ``name`` is the module it ran in,
            ``keep`` and ``intervention`` come from ``keep=`` and ``intervene=``.
        tensor: The ``tensor`` of its rows, ``<op>@<file>:<line>``.
        op: The operation, as torch names it (``torch.nn.functional.linear``).
        source: ``file:line`` of the user's code that ran it.
        depth: Forward-order index, from the adapter's shared count.
        captured: Whether its gradients are recorded (``layers=`` may leave it out).
    """

    spec: LayerSpec
    tensor: str
    op: str
    source: str
    depth: int
    captured: bool

    @property
    def key(self) -> tuple[str, str]:
        """The ``(layer, tensor)`` of its rows."""
        return self.spec.name, self.tensor

    def describe(self) -> str:
        """``torch.log in 'block' (model.py:42)``, for event details."""
        return f"{self.op} in {self.spec.name!r} ({self.source})"


@dataclass(eq=False)
class _Cut:
    """Where values were cut from the graph in the open step, until used downstream."""

    site: OpSite
    cause: str
    upstream: str
    downstream: str = ""
    through: str = ""  # the .numpy() site of a numpy round trip


_CAUSES = {
    "detach": "`.detach()` passes its input's values on without the graph",
    "data": "`.data` passes its input's values on without the graph",
    "no_grad": "it ran with gradients disabled (a torch.no_grad() block)",
    "inference_mode": "it ran under torch.inference_mode()",
    "numpy": "the values left torch through .numpy() (a numpy round trip)",
}


@dataclass
class _Step:
    """Op-level state of the open step.

    ``checks`` lists the captured op calls in call order, each with the ``(layer, tensor)``
    key whose forward finiteness check covers its output: its own, or the layer's whose output
    it is. ``aliases`` maps the op sites whose output was a watched layer's output to that
    layer's key: their rows are the layer's rows, measured once.
    """

    index: int = -1
    used: dict[tuple[str, str], OpSite] = field(default_factory=dict)
    aliases: dict[OpSite, tuple[str, str]] = field(default_factory=dict)
    checks: list[list[Any]] = field(default_factory=list)
    consumers: dict[OpSite, set[OpSite]] = field(default_factory=dict)
    cuts: list[_Cut] = field(default_factory=list)


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
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
})


@functools.cache
def _inplace_at(func: Any) -> int:
    """The position of an ``inplace`` parameter of ``func`` (``F.relu``), else -1."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return -1
    return names.index("inplace") if "inplace" in names else -1


def _writes(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``x[i] = v``,
    ``F.relu(x, inplace=True)``)."""
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS:
        return True
    at = _inplace_at(func)
    if at < 0:
        return False
    flag = kwargs["inplace"] if kwargs and "inplace" in kwargs else (
        args[at] if len(args) > at else False)
    return flag is True


class _OpMode(TorchFunctionMode):
    """The mode active during a watched forward pass: every call goes to ``on_op``."""

    def __init__(self, capture: OpCapture) -> None:
        super().__init__()
        self._on_op = capture._on_op
        self._pending = capture._pending_ids  # the same dict for the mode's life
        self._flush = capture._flush
        self._frames = capture._frames
        self._guard = capture._guard

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _PASS or self._frames.get(sys._getframe(1).f_code) == _OWN:
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
                    if (id(target) in self._pending or id(base) in self._pending) and _writes(
                            func, args, kwargs):
                        self._flush(target)
                        self._flush(base)
        out = func(*args, **(kwargs or {}))
        self._on_op(func, args, kwargs, out)
        return out


class OpCapture:
    """Op-level capture for one :class:`~graddebug_torch.adapter.TorchAdapter`.

    Inert unless ``ops=True`` or ``escalate=True``; then it hooks the root module so that
    each forward pass in which ``WatchContext.capture_ops`` holds runs under the op mode.

    Args:
        adapter: The adapter whose per-step state and hooks it records through.
    """

    def __init__(self, adapter: TorchAdapter) -> None:
        self._adapter = adapter
        options = adapter._options
        self.enabled = (options.ops or options.escalate) and adapter._root is not None
        self._always = options.ops  # module hooks stay on (escalation adds them per forward)
        self._handles: list[RemovableHandle] = []
        self._module_handles: list[RemovableHandle] = []
        self._frames: dict[CodeType, int] = {}
        self._sites: dict[tuple[str, Any, CodeType, int], OpSite] = {}
        self._taken: set[tuple[str, str]] = set()
        self._stack: list[tuple[str, bool, bool]] = []
        self._pending: list[list[_Pending]] = []  # per entry of _stack
        self._pending_ids: dict[int, _Pending] = {}
        self._mode: _OpMode | None = None
        self._recording = False
        self._guard = adapter._fail_open("op-level capture")
        self._step = _Step()
        # Per forward pass: the op site that produced each live tensor needing a gradient, and
        # the cut each tensor of cut-off values descends from (by id, checked by weak ref).
        self._producers: dict[int, tuple[weakref.ref[Tensor], OpSite]] = {}
        self._cut_values: dict[int, tuple[weakref.ref[Tensor], _Cut]] = {}
        self._escaped: _Cut | None = None
        self._buffers: set[int] = set()
        self._scope: dict[str, bool] = {}
        self._intervened = any(is_op_site(name) for name in options.intervene)

    # -- set-up ----------------------------------------------------------------------------

    def attach(self) -> None:
        """Hook the root module's forward (nothing when op-level capture is off)."""
        root = self._adapter._root
        if not self.enabled or root is None:
            return
        if _compiled(self._adapter._model):
            self._adapter._ctx.warn_once("ops-compile", COMPILE_WARNING)
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
        adapter = self._adapter
        chosen = None if adapter._options.layers is None else set(adapter._modules)
        scopes = {}
        for qualified, _ in root.named_modules():
            name = adapter._name(qualified)
            scopes[name] = chosen is None or any(
                name == c or name.startswith(f"{c}.") for c in chosen)
        return scopes

    def _hook_modules(self) -> None:
        root = self._adapter._root
        assert root is not None
        for qualified, module in root.named_modules():
            if module is root:
                continue  # the root is entered by _begin
            name = self._adapter._name(qualified)
            entry = (name, self._scope.get(name, False), isinstance(module, CHANNELS_FIRST))
            self._module_handles += [
                module.register_forward_pre_hook(functools.partial(self._push, entry)),
                module.register_forward_hook(self._pop, always_call=True),
            ]

    # -- the forward pass ------------------------------------------------------------------

    def _begin(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # dynamo cannot trace the mode: compiled forwards run without it
        if self._mode is not None:
            # A forward interrupted by a BaseException (KeyboardInterrupt, caught by the
            # loop) skipped _end. (A root module that calls itself ends the outer capture
            # here too: a rare model, which loses its outer ops, never a stale mode.)
            self._leave()
        with self._guard:
            ctx = self._adapter._ctx
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
            self._buffers = {id(b) for b in module.buffers()}
            name = self._adapter._name("")
            self._stack = [(name, self._scope.get(name, True), False)]
            self._pending = [[]]
            mode = _OpMode(self)
            mode.__enter__()
            self._mode = mode

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._mode is None or torch.compiler.is_compiling():
            return
        try:
            with self._guard:
                name = self._stack[0][0] if self._stack else ""
                if self._cut_values or self._escaped is not None:
                    self._reaches(output, name)
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
        self._producers.clear()
        self._cut_values.clear()
        self._escaped = None
        self._buffers = set()
        if not self._always and self._module_handles:
            for handle in self._module_handles:
                handle.remove()
            self._module_handles.clear()

    def _push(self, entry: tuple[str, bool, bool], module: nn.Module, args: Any) -> None:
        if self._mode is not None and not torch.compiler.is_compiling():
            self._stack.append(entry)
            self._pending.append([])

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._mode is None or len(self._stack) <= 1 or torch.compiler.is_compiling():
            return
        name = self._stack.pop()[0]
        with self._guard:
            if self._cut_values or self._escaped is not None:
                self._reaches(output, name)
            self._resolve(output, name)

    def _resolve(self, output: Any, module: str) -> None:
        """Hook the op outputs held while ``module`` ran; those that are its output go to the
        watched layer's row when it is one, else wait for the module that called it."""
        held = self._pending.pop() if self._pending else []
        if not held:
            return
        outputs = {id(t): name for name, t in flatten(output)} if output is not None else {}
        layer = self._adapter._layers.get(module)
        as_layer = (layer is not None and layer.capture and module in self._adapter._modules
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
        with self._guard:
            is_tensor = isinstance(out, Tensor)
            if not is_tensor and not isinstance(out, (tuple, list)) and (
                    getattr(func, "__name__", None) not in _TO_NUMPY):
                return
            caller = self._caller(sys._getframe(2))
            if caller is None:
                return  # graddebug's own hooks
            site = self._site(func, caller)
            if self._recording:
                self._follow(func, site, _arguments(args, kwargs),
                             (out,) if is_tensor else out)
            elif site.spec.intervention is not None:
                for tensor in tensors(out):
                    self._adapter._intervene_unrecorded(tensor, site.spec.intervention,
                                                        site.spec.name)

    def _caller(self, frame: FrameType | None) -> FrameType | None:
        """The frame that called the op, past torch's dispatch frames; None for graddebug."""
        kinds = self._frames
        while frame is not None:
            code = frame.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = kinds[code] = _frame_kind(code)
            if kind == _CALLER:
                return frame
            if kind == _OWN:
                return None
            frame = frame.f_back
        return None

    def _site(self, func: Any, caller: FrameType) -> OpSite:
        module, in_scope, channels_first = self._stack[-1]
        key = (module, func, caller.f_code, caller.f_lasti)
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = self._new_site(func, caller, module, in_scope,
                                                     channels_first)
        return site

    def _new_site(self, func: Any, caller: FrameType, module: str, in_scope: bool,
                  channels_first: bool) -> OpSite:
        user: FrameType | None = caller
        while user is not None and _is_library(user.f_code):
            user = user.f_back
        where = user if user is not None else caller
        filename, line = where.f_code.co_filename, where.f_lineno
        op = _op_name(func)
        tensor = f"{op}@{os.path.basename(filename)}:{line}"
        if (module, tensor) in self._taken:
            n = 2
            while (module, f"{tensor}:{n}") in self._taken:
                n += 1
            tensor = f"{tensor}:{n}"
        self._taken.add((module, tensor))
        adapter = self._adapter
        options = adapter._options
        label = keep_label(module, tensor)
        keep = op_site_matches(label, [k for k in options.keep if is_op_site(k)])
        intervene = op_site_matches(label, [k for k in options.intervene if is_op_site(k)])
        chosen = op_site_matches(label, options.op_sites)
        adapter._matched.update(keep, intervene, chosen)
        spec = LayerSpec(name=module, channels_first=channels_first, keep=bool(keep),
                         intervention=options.intervene[intervene[0]] if intervene else None,
                         depth=adapter._take_depth())
        return OpSite(spec, tensor, op, f"{display_path(filename)}:{line}", spec.depth,
                      captured=in_scope or bool(chosen or keep or intervene))

    def _follow(self, func: Any, site: OpSite, inputs: list[Tensor], outputs: Any) -> None:
        """Record ``site``'s outputs and follow the values from its inputs to its outputs."""
        step = self._step
        producers, cut_values = self._producers, self._cut_values
        needs_grad = False
        upstream: OpSite | None = None
        cut_in: _Cut | None = None
        unknown = False
        for t in inputs:
            if t.requires_grad:
                known = producers.get(id(t))
                producer = known[1] if known is not None and known[0]() is t else None
                if not needs_grad:
                    needs_grad, upstream = True, producer
                if producer is not None and site.captured:
                    step.consumers.setdefault(producer, set()).add(site)
            else:
                cut = cut_values.get(id(t))
                if cut is not None and cut[0]() is t:
                    cut_in = cut[1]
                elif t.is_floating_point() and id(t) not in self._buffers:
                    unknown = True
        if cut_in is None and self._escaped is not None and (unknown or func in _FROM_VALUES):
            cut_in = self._escaped  # values back from numpy, as far as one can tell
        if not isinstance(outputs, (tuple, list)):  # an array: the values left torch
            if needs_grad:
                self._escaped = self._cut(site, "numpy", upstream)
            elif cut_in is not None:
                cut_in.through = cut_in.through or site.source
                self._escaped = cut_in
            return
        for out in tensors(outputs):
            if not out.is_floating_point():
                continue
            if out.requires_grad:
                if site.captured:
                    self._hold(site, out)
                producers[id(out)] = (weakref.ref(out), site)
                if cut_in is not None and not cut_in.downstream:
                    cut_in.downstream = site.describe()
            elif needs_grad and (cause := _cause(func)) is not None:
                cut_values[id(out)] = (weakref.ref(out), self._cut(site, cause, upstream))
            elif cut_in is not None:
                cut_values[id(out)] = (weakref.ref(out), cut_in)

    def _cut(self, site: OpSite, cause: str, upstream: OpSite | None) -> _Cut:
        cut = _Cut(site, cause, upstream.describe() if upstream is not None else
                   "a tensor from outside the forward pass (an input or a parameter)")
        self._step.cuts.append(cut)
        return cut

    def _reaches(self, output: Any, module: str) -> None:
        """Cut values that are a module's output were used downstream: by its caller."""
        for _, tensor in flatten(output):
            found = self._cut_values.get(id(tensor))
            if found is not None and found[0]() is tensor and not found[1].downstream:
                found[1].downstream = f"the output of {module!r}"

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
        adapter = self._adapter
        state = adapter._state
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
        hook = adapter._grad_hooks.get(key)
        if hook is None:  # one per site, reused every step
            hook = adapter._grad_hooks[key] = functools.partial(adapter._on_grad, spec,
                                                                site.tensor)
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
        if not step.checks and not step.cuts:
            return result
        index = step.index
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
        nonfinite = {(e.layer, e.tensor): e.detail for e in result.events
                     if e.event == _FORWARD_NONFINITE}
        events = [e for e in result.events
                  if e.event != _FORWARD_NONFINITE or (e.layer, e.tensor) not in used]
        # Only where a layer's output went non-finite: -inf in an op alone is by design.
        layer_broke = any(key not in used for key in nonfinite)
        birth = _forward_birth(step, nonfinite) if layer_broke else None
        if birth is not None:
            site, detail = birth
            events.append(Event(index, site.spec.name, site.tensor, site.depth,
                                EventKind.OP_NONFINITE.value, detail, source=site.source))
        else:
            events += _backward_births(index, rows, step.consumers)
        for cut in step.cuts:
            if cut.downstream:
                events.append(_cut_event(index, cut))
        result.events[:] = events
        return result


COMPILE_WARNING = (
    "graddebug: ops=True (or escalate=True) records the operations of eager forward passes "
    "only; the operations of a torch.compile'd model run inside dynamo's graphs, where no "
    "op-level rows or source lines are recorded. Layer-level capture goes on as usual; for "
    "op-level capture, run the model uncompiled while debugging."
)


def _compiled(model: Any) -> bool:
    """Whether ``model`` is, or wraps (DDP), a ``torch.compile``d module."""
    seen: set[int] = set()
    while isinstance(model, nn.Module) and id(model) not in seen:
        seen.add(id(model))
        if type(model).__name__ == "OptimizedModule":
            return True
        model = getattr(model, "module", None)
    return False


def _cause(func: Any) -> str | None:
    """Why an op's output needs no gradient although an input needs one; None where that is
    by design (``zeros_like``, ``argmax``, comparisons)."""
    if func in _DETACH:
        return "detach"
    if func is _DATA:
        return "data"
    if torch.is_inference_mode_enabled():
        return "inference_mode"
    if not torch.is_grad_enabled():
        return "no_grad"
    return None


def _forward_birth(step: _Step, nonfinite: dict[tuple[str, str], str]
                   ) -> tuple[OpSite, str] | None:
    """The op where the NaN/Inf that reached a layer's output was born in the forward pass.

    A birth is an op whose output was non-finite while the outputs of the ops that fed it were
    finite. Not every birth is a fault: an attention mask filled with -inf is non-finite by
    design, and the softmax after it is finite again. So the op named is the first birth, in
    call order, whose non-finite values reach the output of a layer that went non-finite
    (else, where no op's output is a layer's, the last non-finite op of the step).

    Args:
        step: The step's op-level state.
        nonfinite: The ``(layer, tensor)`` keys whose forward check was not finite, with
            ``"NaN"`` or ``"Inf"``.

    Returns:
        The op site and what its output held; None where no birth reaches such an output.
    """
    bad: dict[OpSite, str] = {}
    for site, key in step.checks:
        if key in nonfinite and site not in bad:
            bad[site] = nonfinite[key]
    if not bad:
        return None
    feeds = {p: [c for c in users if c in bad and c is not p]
             for p, users in step.consumers.items() if p in bad}
    fed = {c for users in feeds.values() for c in users}
    targets = {site for site, key in step.aliases.items() if key in nonfinite} or {
        list(bad)[-1]}
    for birth in (s for s in bad if s not in fed):
        seen, todo = {birth}, [birth]
        while todo:
            site = todo.pop()
            if site in targets:
                return birth, bad[birth]
            for user in feeds.get(site, ()):
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
    return None


def _backward_births(step: int, rows: dict[OpSite, Any],
                     consumers: dict[OpSite, set[OpSite]]) -> list[Event]:
    """Ops whose backward turned a finite gradient non-finite: an op site whose gradient is
    NaN/Inf while the gradients at the outputs of every op that used it are finite."""
    events = []
    for producer, row in rows.items():
        if not (row.nan or row.inf):
            continue
        users = [c for c in consumers.get(producer, ()) if c in rows]
        if not users or any(rows[c].nan or rows[c].inf for c in users):
            continue
        what = "NaN" if row.nan else "Inf"
        for user in users:
            events.append(Event(
                step, user.spec.name, user.tensor, user.depth, EventKind.OP_GRAD_NONFINITE.value,
                f"{what}, in the gradient it passed to {producer.describe()}",
                source=user.source))
    return events


def _cut_event(step: int, cut: _Cut) -> Event:
    cause = _CAUSES[cut.cause]
    if cut.through:
        cause += f", and the values then left torch through .numpy() ({cut.through})"
    site = cut.site
    return Event(step, site.spec.name, site.tensor, site.depth, EventKind.OP_CUT.value,
                 f"{cause}; the gradient stops between {cut.upstream} and {cut.downstream}",
                 source=site.source)


def _frame_kind(code: CodeType) -> int:
    """Whether a frame is the caller of an op, torch's dispatch, or graddebug's own code."""
    filename = code.co_filename
    if code.co_name == "__torch_function__" or filename in _DISPATCH_FILES:
        return _DISPATCH
    if filename.startswith(_OWN_DIRS):
        return _OWN
    return _CALLER


def _is_library(code: CodeType) -> bool:
    """Whether a frame belongs to torch or graddebug rather than to the user's code."""
    return code.co_filename.startswith((_TORCH_DIR, *_OWN_DIRS)) or (
        code.co_name == "__torch_function__")
