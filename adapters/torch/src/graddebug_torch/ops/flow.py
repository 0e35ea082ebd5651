"""Value flow and cuts at op level: which op produced each value, and where the graph was cut.

For the op-level events of :mod:`graddebug.records`, the op mode follows how values flow
through a forward pass: which op produced each input (to find the op whose backward turned a
finite gradient into NaN), and where the graph was cut (``.detach()``, ``.data``, an op run
under ``no_grad`` or ``inference_mode``, values that left torch through ``.numpy()``). A cut is
kept as an ``op_cut`` event only when the cut values were used downstream (by an op whose
output needs a gradient, or as a module's output). This module also turns what was followed
into those events when the step closes.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from graddebug.records import Event, EventKind
from graddebug_torch.ops.sites import OpSite
from graddebug_torch.outputs import flatten, tensors

__all__ = ["TO_NUMPY", "Cut", "StepFlow", "ValueFlow", "arguments", "op_events", "writes"]

_DETACH: frozenset[Any] = frozenset({Tensor.detach, Tensor.detach_})
_DATA = Tensor.data.__get__  # type: ignore[attr-defined]
# Values that leave torch through these may come back as new tensors (a numpy round trip).
# By name: code that wraps Tensor.numpy (a profiler, a test counting host syncs) hands the mode
# the original method, which an identity check taken at import could miss.
TO_NUMPY = frozenset({"numpy", "__array__"})
_FROM_VALUES: frozenset[Any] = frozenset({torch.tensor, torch.as_tensor, torch.asarray})

_FORWARD_NONFINITE = EventKind.FORWARD_NONFINITE.value
_CAUSES = {
    "detach": "`.detach()` passes its input's values on without the graph",
    "data": "`.data` passes its input's values on without the graph",
    "no_grad": "it ran with gradients disabled (a torch.no_grad() block)",
    "inference_mode": "it ran under torch.inference_mode()",
    "numpy": "the values left torch through .numpy() (a numpy round trip)",
}


def arguments(args: Any, kwargs: Any) -> list[Tensor]:
    """The tensors among an op's arguments, and in lists of them (``torch.cat``): one level
    deep, without a generator per level (this runs for every op of the forward pass).

    Args:
        args: The op's positional arguments.
        kwargs: Its keyword arguments, or None.

    Returns:
        The tensors, in order.
    """
    found = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, Tensor)]
    return found


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


def writes(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``x[i] = v``,
    ``F.relu(x, inplace=True)``): the value a held output had is about to change.

    Args:
        func: The operation.
        args: Its positional arguments.
        kwargs: Its keyword arguments, or None.

    Returns:
        True where it writes in place.
    """
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS:
        return True
    at = _inplace_at(func)
    if at < 0:
        return False
    flag = kwargs["inplace"] if kwargs and "inplace" in kwargs else (
        args[at] if len(args) > at else False)
    return flag is True


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


@dataclass(eq=False)
class Cut:
    """Where values were cut from the graph in the open step, until used downstream.

    Attributes:
        site: The op whose output was cut.
        cause: A key of the causes (``detach``, ``data``, ``no_grad``, ``inference_mode``,
            ``numpy``).
        upstream: What fed the cut op, described.
        downstream: What used the cut values, described; empty while nothing did.
        through: The ``.numpy()`` site of a numpy round trip.
    """

    site: OpSite
    cause: str
    upstream: str
    downstream: str = ""
    through: str = ""


@dataclass
class StepFlow:
    """What value flow found in the open step.

    Attributes:
        consumers: Per op site, the captured sites that used its outputs.
        cuts: The cuts, in call order (kept as events where used downstream).
    """

    consumers: dict[OpSite, set[OpSite]] = field(default_factory=dict)
    cuts: list[Cut] = field(default_factory=list)


class ValueFlow:
    """The values of one forward pass: their producers and the cuts they descend from.

    Tensors are known by id and checked by weak reference, so that a value that died and
    whose id was reused is not mistaken for it.

    Args:
        hold: Called with each captured site and an output of it that needs a gradient.
    """

    def __init__(self, hold: Callable[[OpSite, Tensor], None]) -> None:
        self._hold = hold
        self._producers: dict[int, tuple[weakref.ref[Tensor], OpSite]] = {}
        self._cut_values: dict[int, tuple[weakref.ref[Tensor], Cut]] = {}
        self._escaped: Cut | None = None
        self.buffers: set[int] = set()
        """The ids of the root module's buffers: inputs that need no gradient by design."""

    @property
    def has_cuts(self) -> bool:
        """Whether cut values are live in this forward pass."""
        return bool(self._cut_values) or self._escaped is not None

    def forget(self) -> None:
        """Forget the forward pass (it ended)."""
        self._producers.clear()
        self._cut_values.clear()
        self._escaped = None
        self.buffers = set()

    def follow(self, func: Any, site: OpSite, inputs: list[Tensor], outputs: Any,
               step: StepFlow) -> None:
        """Record ``site``'s outputs and follow the values from its inputs to its outputs.

        Args:
            func: The operation.
            site: Its site.
            inputs: The tensors among its arguments (:func:`arguments`).
            outputs: Its outputs as a tuple or list, or an array (the values left torch).
            step: Where the step's consumers and cuts go.
        """
        producers, cut_values = self._producers, self._cut_values
        needs_grad = False
        upstream: OpSite | None = None
        cut_in: Cut | None = None
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
                elif t.is_floating_point() and id(t) not in self.buffers:
                    unknown = True
        if cut_in is None and self._escaped is not None and (unknown or func in _FROM_VALUES):
            cut_in = self._escaped  # values back from numpy, as far as one can tell
        if not isinstance(outputs, (tuple, list)):  # an array: the values left torch
            if needs_grad:
                self._escaped = self._cut(step, site, "numpy", upstream)
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
                cut_values[id(out)] = (weakref.ref(out), self._cut(step, site, cause, upstream))
            elif cut_in is not None:
                cut_values[id(out)] = (weakref.ref(out), cut_in)

    def _cut(self, step: StepFlow, site: OpSite, cause: str, upstream: OpSite | None) -> Cut:
        """A new cut at ``site``, listed in ``step``."""
        cut = Cut(site, cause, upstream.describe() if upstream is not None else
                  "a tensor from outside the forward pass (an input or a parameter)")
        step.cuts.append(cut)
        return cut

    def reaches(self, output: Any, module: str) -> None:
        """Cut values that are a module's output were used downstream: by its caller.

        Args:
            output: The module's output.
            module: Its name.
        """
        for _, tensor in flatten(output):
            found = self._cut_values.get(id(tensor))
            if found is not None and found[0]() is tensor and not found[1].downstream:
                found[1].downstream = f"the output of {module!r}"


def op_events(index: int, events: list[Event], used: Mapping[tuple[str, str], OpSite],
              checks: list[list[Any]], aliases: dict[OpSite, tuple[str, str]],
              rows: dict[OpSite, Any], step: StepFlow) -> list[Event]:
    """The step's events with the op-level ones added: the first op whose output was
    non-finite in forward, the ops whose backward turned a finite gradient non-finite, and the
    cuts used downstream. An op's own ``forward_nonfinite`` event gives way to them.

    Args:
        index: Index of the step.
        events: The step's events as the adapter gathered them.
        used: The captured op sites, by the ``(layer, tensor)`` of their rows.
        checks: The captured op calls in call order, each ``[site, key]`` with the key whose
            forward check covers its output.
        aliases: The sites whose output was a watched layer's, with that layer's key.
        rows: The step's row of each captured site.
        step: What value flow found in the step.

    Returns:
        The new list of events.
    """
    nonfinite = {(e.layer, e.tensor): e.detail for e in events
                 if e.event == _FORWARD_NONFINITE}
    kept = [e for e in events if e.event != _FORWARD_NONFINITE or (e.layer, e.tensor) not in used]
    # Only where a layer's output went non-finite: -inf in an op alone is by design.
    layer_broke = any(key not in used for key in nonfinite)
    birth = _forward_birth(checks, aliases, step.consumers, nonfinite) if layer_broke else None
    if birth is not None:
        site, detail = birth
        kept.append(Event(index, site.spec.name, site.tensor, site.depth,
                          EventKind.OP_NONFINITE.value, detail, source=site.source))
    else:
        kept += _backward_births(index, rows, step.consumers)
    for cut in step.cuts:
        if cut.downstream:
            kept.append(_cut_event(index, cut))
    return kept


def _forward_birth(checks: list[list[Any]], aliases: dict[OpSite, tuple[str, str]],
                  consumers: dict[OpSite, set[OpSite]], nonfinite: dict[tuple[str, str], str]
                  ) -> tuple[OpSite, str] | None:
    """The op where the NaN/Inf that reached a layer's output was born in the forward pass.

    A birth is an op whose output was non-finite while the outputs of the ops that fed it were
    finite. Not every birth is a fault: an attention mask filled with -inf is non-finite by
    design, and the softmax after it is finite again. So the op named is the first birth, in
    call order, whose non-finite values reach the output of a layer that went non-finite
    (else, where no op's output is a layer's, the last non-finite op of the step).

    Args:
        checks: The captured op calls in call order, each ``[site, key]`` with the key whose
            forward check covers its output.
        aliases: The sites whose output was a watched layer's, with that layer's key.
        consumers: Per site, the captured sites that used its outputs.
        nonfinite: The ``(layer, tensor)`` keys whose forward check was not finite, with
            ``"NaN"`` or ``"Inf"``.

    Returns:
        The op site and what its output held; None where no birth reaches such an output.
    """
    bad: dict[OpSite, str] = {}
    for site, key in checks:
        if key in nonfinite and site not in bad:
            bad[site] = nonfinite[key]
    if not bad:
        return None
    feeds = {p: [c for c in users if c in bad and c is not p]
             for p, users in consumers.items() if p in bad}
    fed = {c for users in feeds.values() for c in users}
    targets = {site for site, key in aliases.items() if key in nonfinite} or {list(bad)[-1]}
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
    NaN/Inf while the gradients at the outputs of every op that used it are finite.

    Args:
        step: Index of the step.
        rows: The step's row of each captured site.
        consumers: Per site, the captured sites that used its outputs.

    Returns:
        One ``op_grad_nonfinite`` event per user of such a site.
    """
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


def _cut_event(step: int, cut: Cut) -> Event:
    """The ``op_cut`` event of a cut whose values were used downstream.

    Args:
        step: Index of the step.
        cut: The cut.

    Returns:
        The event, which names both sides of the cut.
    """
    cause = _CAUSES[cut.cause]
    if cut.through:
        cause += f", and the values then left torch through .numpy() ({cut.through})"
    site = cut.site
    return Event(step, site.spec.name, site.tensor, site.depth, EventKind.OP_CUT.value,
                 f"{cause}; the gradient stops between {cut.upstream} and {cut.downstream}",
                 source=site.source)
