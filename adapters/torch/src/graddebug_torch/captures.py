"""What the hooks fill during a step: captures of gradients, forward checks, tensor hooks.

Everything here lives until the step closes (:mod:`graddebug_torch.closing` reads it, with one
host transfer) and is then dropped. The objects are few and small on purpose: each one that
lives until the close is one more for the garbage collector to move between generations.
"""

from __future__ import annotations

import functools
import gc
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from graddebug.records import WEIGHTED_DETAIL, Event
from graddebug_torch.distributed import is_sharded
from graddebug_torch.staging import SmallGrads, StagedGroup
from graddebug_torch.stats import DotSums, finiteness, stack_scalars

__all__ = ["Capture", "CollectorPause", "ForwardChecks", "GradHook", "GradHooks", "Key",
           "StepCaptures", "kept_array", "shape_text"]

Key = tuple[str, str]
"""An output's ``(layer, tensor)``."""
GradHook = Callable[[Tensor], Tensor | None]
"""A tensor hook: called with the gradient, returns a replacement or None."""


@functools.lru_cache(maxsize=4096)
def shape_text(shape: torch.Size) -> str:
    """``str(tuple(shape))`` as the ``shape`` column holds it, built once per distinct shape."""
    return str(tuple(shape))


_PENDING = torch.empty(0)
"""Stands for a statistic of a staged gradient until the step's batched pass fills it in."""


@dataclass(slots=True)  # one object per hook call, not two: less for the collector
class Capture:
    """Device-side statistics of one gradient seen by one hook call.

    A small gradient is staged instead (``group`` and ``row`` say where, see
    :mod:`graddebug_torch.staging`); its statistics are filled in when the step closes.
    """

    sq: Tensor
    total: Tensor
    extremes: tuple[Tensor, Tensor] | None  # per-unit (max, min)
    absmax: Tensor | None  # only when there is no unit axis
    shape: str  # str(tuple(shape))
    numel: int
    pre_sq: Tensor | None  # sum of squares before an intervention
    n_units: int = 0
    """Number of units (features or channels); 0 without a unit axis."""
    group: StagedGroup | None = None
    row: int = 0

    @property
    def sentinel(self) -> bool:
        """Only the sum of squares and the sum were measured, no extremes (a step that is not
        full, see :mod:`graddebug.capture.tiers`)."""
        return self.group is None and self.extremes is None and self.absmax is None

    @classmethod
    def pending(cls, group: StagedGroup, row: int, shape: str, numel: int,
                n_units: int) -> Capture:
        """The capture of a gradient staged in ``row`` of ``group``."""
        return cls(_PENDING, _PENDING, None, None, shape, numel, None, n_units, group, row)


class CollectorPause:
    """Pauses Python's cyclic garbage collector while a recorded step's forward and backward
    passes run, as :func:`graddebug.capture.buffer.gc_paused` does while a step closes.

    Each output's tensor hook and capture live until the backward pass has used them. On a
    model of many small layers the young collections that the passes' allocations trigger
    move them all to the oldest generation, whose collections walk the whole heap (every
    module, parameter and tensor of the process): about a fifth of a step on 10,000 layers.
    Paused, they die young. The forward pass is paused by hooks on the root module (the one
    after it runs also when the forward raises); the backward pass from its first recorded
    gradient to its end, where the autograd engine calls back. A backward pass that raises
    before its end is resumed at the next forward, when the step closes, or on exit. A
    collector the user disabled stays disabled.
    """

    __slots__ = ("paused",)

    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        """Pause, if the collector runs and no pause holds it already."""
        if not self.paused and gc.isenabled():
            gc.disable()
            self.paused = True

    def until_backward_ends(self) -> None:
        """Pause, if the collector runs and no pause holds it already, until the running
        backward pass ends."""
        if self.paused or not gc.isenabled():
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.resume)
        except RuntimeError:  # not in a backward pass (a compiled graph's operator)
            return
        gc.disable()
        self.paused = True

    def resume(self) -> None:
        """Resume the collector if this pause stopped it."""
        if self.paused:
            self.paused = False
            gc.enable()


class GradHooks:
    """The tensor hooks of one step, removed together when it closes.

    A plain tensor's hook goes straight into its hook dictionary, as ``Tensor.register_hook``
    does, without the handle and weak reference that call makes: on a model of 10,000 small
    layers those two objects a layer lived until the step closed, so the collector moved
    them to its oldest generation and walked the whole heap about once a step. Subclasses
    (``__torch_function__``) go through ``register_hook``.
    """

    __slots__ = ("_dicts", "_handles", "_ids")

    def __init__(self) -> None:
        self._dicts: list[dict[int, Any]] = []
        self._ids: list[int] = []
        self._handles: list[RemovableHandle] = []

    def add(self, tensor: Tensor, hook: Callable[[Tensor], Tensor | None]) -> None:
        """Register ``hook`` on ``tensor``'s gradient until :meth:`remove`."""
        hooks = tensor._backward_hooks if type(tensor) is Tensor else None
        if hooks is None:
            if type(tensor) is not Tensor or tensor.grad_fn is None:
                self._handles.append(tensor.register_hook(hook))
                return
            hooks = tensor._backward_hooks = OrderedDict()
            tensor.grad_fn._register_hook_dict(tensor)
        key = RemovableHandle.next_id  # the ids register_hook hands out: never a clash
        RemovableHandle.next_id = key + 1
        hooks[key] = hook
        self._dicts.append(hooks)
        self._ids.append(key)

    def __len__(self) -> int:
        """The number of hooks registered this step."""
        return len(self._ids) + len(self._handles)

    def remove(self) -> None:
        """Remove every hook this step registered."""
        for hooks, key in zip(self._dicts, self._ids, strict=True):
            hooks.pop(key, None)
        for handle in self._handles:
            handle.remove()
        self._dicts, self._ids, self._handles = [], [], []


class ForwardChecks:
    """The forward finiteness checks of one step: per watched output a number that is finite
    exactly when the output is (:func:`~graddebug_torch.stats.finiteness`), read at the step's
    single sync.

    A small output that needs a gradient is copied into a staging buffer of its shape (one
    kernel, as costly as the sum it replaces) and the buffer is summed row by row when the
    step closes. The checks live in parallel lists rather than a tuple each, so that the
    usual check adds no object that outlives the step's young collections.
    """

    __slots__ = ("_groups", "_rows", "_staging", "_sums", "_values", "_weighted", "depths",
                 "keys")

    def __init__(self, staging: SmallGrads, sums: DotSums) -> None:
        self._staging = staging
        self._sums = sums
        self.keys: list[Key] = []
        self.depths: list[int] = []
        self._values: list[Tensor | None] = []
        self._groups: list[StagedGroup | None] = []
        self._rows: list[int] = []
        self._weighted: set[int] = set()  # the checks of weighted layers' outputs, by index

    def __len__(self) -> int:
        """The number of checks."""
        return len(self.keys)

    def add(self, key: Key, depth: int, value: Tensor) -> None:
        """Add a check already reduced to its number (a compiled graph's, an op's)."""
        self.keys.append(key)
        self.depths.append(depth)
        self._values.append(value)
        self._groups.append(None)
        self._rows.append(0)

    def check(self, key: Key, depth: int, tensor: Tensor, weighted: bool = False) -> None:
        """Add the check of output ``key``, a floating ``tensor``; ``weighted`` for the output
        of a weighted layer (:attr:`~graddebug.capture.layers.LayerSpec.weighted`). A
        ``DTensor`` is checked on this rank's slice."""
        if type(tensor) is not Tensor and is_sharded(tensor):
            tensor = tensor.to_local()  # type: ignore[attr-defined]
        if weighted and tensor.dtype != torch.float16:
            # float16 overflows into +Inf and -Inf, whose sum is NaN: no evidence there.
            self._weighted.add(len(self.keys))
        if not (tensor.requires_grad and SmallGrads.fits(tensor)):
            self.add(key, depth, finiteness(tensor, self._sums))
            return
        group = self._staging.group(tensor, None)
        self.keys.append(key)
        self.depths.append(depth)
        self._values.append(None)
        self._groups.append(group)
        self._rows.append(group.put(tensor))

    def detail(self, index: int, value: float) -> str:
        """The event detail of check ``index`` whose number came out as ``value`` (not
        finite): ``"NaN"`` or ``"Inf"``, marked for a weighted layer's output."""
        what = "NaN" if math.isnan(value) else "Inf"
        return what + WEIGHTED_DETAIL if index in self._weighted else what

    def gather(self) -> Tensor:
        """Every check's number, in the order they were added (one tensor)."""
        parts: list[Tensor] = []
        direct = [v for v in self._values if v is not None]
        if direct:
            parts.append(stack_scalars(direct))
        offsets: dict[int, int] = {}
        size = len(direct)
        for group in self._groups:
            if group is not None and id(group) not in offsets:
                offsets[id(group)] = size
                parts.append(group.sums())
                size += group.used
        if not offsets:
            return parts[0]
        order, at = [], 0
        for group, row in zip(self._groups, self._rows, strict=True):
            if group is None:
                order.append(at)
                at += 1
            else:
                order.append(offsets[id(group)] + row)
        joined = torch.cat(parts) if len(parts) > 1 else parts[0]
        return joined[torch.tensor(order, device=joined.device)]


@dataclass
class StepCaptures:
    """Everything captured in the open step; dropped when it closes.

    ``touched`` says that a parameter gradient arrived (recorded or not); ``transformed`` that
    a watched module ran inside a ``torch.func`` transform, unrecorded.
    """

    forward: ForwardChecks
    inputs: ForwardChecks
    """The finiteness checks of the watched model's floating inputs."""
    between: ForwardChecks
    """The finiteness checks of watched layers' inputs that no recorded output gave them."""
    covered: dict[int, weakref.ref[Tensor]] = field(default_factory=dict)
    """The tensors whose finiteness a check answers already (recorded outputs, the model's
    inputs), by id; a weak reference tells a live tensor from a newer one at the same id."""
    captures: dict[Key, Capture] = field(default_factory=dict)
    """The first call's capture of each output; :meth:`calls` has them all."""
    repeats: dict[Key, list[Capture]] = field(default_factory=dict)
    """Every call's capture, for outputs captured more than once (a module called twice)."""
    expected: dict[Key, int] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    kept: dict[str, np.ndarray] = field(default_factory=dict)
    # Through a lambda: dynamo, tracing a tap's first call in a compiled function, inlines
    # it, where calling the class as the factory would break the graph.
    hooks: GradHooks = field(default_factory=lambda: GradHooks())
    received: dict[int, Tensor] = field(default_factory=dict)
    """The gradients the post-accumulate hooks held, by parameter index (measured when the
    step closes)."""
    tap_requires_grad: bool = False
    touched: bool = False
    transformed: bool = False

    def reusable(self) -> bool:
        """Whether nothing but the flags was captured (a step that ``every=`` skipped with
        the forward hooks parked): the next step can start from this one, flags cleared."""
        return not (self.captures or self.repeats or self.expected or self.events or self.kept
                    or self.received or self.covered or len(self.hooks) or len(self.forward)
                    or len(self.inputs) or len(self.between))

    def add(self, key: Key, capture: Capture) -> int:
        """Add one call's capture of output ``key``; return how many came before it.

        The usual output, captured once a step, costs a dictionary entry and no list: each
        object that lives until the step closes is one more for the collector to move.
        """
        first = self.captures.get(key)
        if first is None:
            self.captures[key] = capture
            return 0
        calls = self.repeats.get(key)
        if calls is None:
            calls = self.repeats[key] = [first]
        calls.append(capture)
        return len(calls) - 1

    def calls(self) -> dict[Key, list[Capture]]:
        """Every output's captures, one per call, in the order the outputs were first seen."""
        repeats = self.repeats
        return {key: repeats.get(key, [c]) for key, c in self.captures.items()}


def kept_array(grad: Tensor) -> np.ndarray:
    """A gradient as ``keep=`` keeps it: a dense numpy copy on the host. Sparse gradients
    (``Embedding(sparse=True)``) are densified; floating dtypes numpy lacks or computes poorly
    (bfloat16, float16 under autocast) become float32, which holds them exactly."""
    out = grad.detach()
    if out.layout != torch.strided:
        out = out.to_dense()
    if out.is_floating_point() and out.dtype not in (torch.float32, torch.float64):
        out = out.float()
    return out.cpu().numpy().copy()
