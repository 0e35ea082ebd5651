"""Op-level capture's op callback, the variables its finiteness codes are written into, and
the events read from them (see the package's docstring for how the three fit).

An op callback (:mod:`tensorflow.python.framework.op_callbacks`, the mechanism
``tf.debugging.enable_check_numerics`` uses) sees every op as a trace creates it. For each op
with a floating output created inside a watched layer's ``call``, and for each op of the
backward pass that differentiates one of them, it adds a finiteness code (finite, Inf, NaN)
written into a ``tf.Variable``; closing the step reads the codes with one transfer and zeroes
them. A few links of chains that Grappler rewrites are left unchecked, so that the weights stay
bitwise identical (see ``_CHAINED``).
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from graddebug.capture.layers import FailOpen, LayerSpec
from graddebug.records import Event, EventKind
from graddebug_tensorflow.ops.flow import CHECK_SCOPE, Cut, cut_cause, judge
from graddebug_tensorflow.ops.sites import Site, user_source

try:
    from tensorflow.python.framework import op_callbacks as _op_callbacks
except ImportError:  # pragma: no cover - a TF without op callbacks: layer capture only
    _op_callbacks = None

__all__ = ["CHUNK", "OpCapture", "available"]

CHUNK = 4096
"""Codes per variable chunk; a trace that needs more adds a chunk outside the graph."""

_FINITE, _INF, _NAN = 1, 2, 3  # 0: the op did not run in the step
_DETAIL = {_INF: "Inf", _NAN: "NaN"}

# Ops not checked: their outputs hold no values, or never change from step to step, or are
# weights (a variable read is taken as finite: weights go non-finite after a non-finite update,
# and only the first broken step has a meaningful origin).
_SKIP = frozenset({"Const", "Placeholder", "VarHandleOp", "ReadVariableOp", "NoOp", "Shape",
                   "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"})
# Grappler rewrites chains of ops when each is the only reader of the one before: it fuses a
# contraction (MatMul, a convolution, a fused batch norm) with the bias add, residual add and
# activation after it, and turns trees of adds into one AddN. A check would be a second
# reader: the rewrite would not happen, the kernels would round differently, and the weights
# would change in their last bits (a residual CNN under fit did, where a batch norm's output
# add fed the residual add). So contractions go unchecked, and the output of an add or a
# multiplication is checked only once an op reads it that no such chain would include.
_CONTRACTIONS = frozenset({"MatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv3D",
                           "DepthwiseConv2dNative", "FusedBatchNorm", "FusedBatchNormV2",
                           "FusedBatchNormV3"})
_CHAINED = frozenset({"BiasAdd", "Add", "AddV2", "AddN", "Sub", "Mul"})
_CHAIN_ENDS = _CHAINED | {"Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid"}
_TRUSTED_INPUTS = frozenset({"Const", "ReadVariableOp", "ZerosLike", "OnesLike"})
# A gradient op's name: the tape's (``gradient_tape/``) or ``tf.gradients``' scope.
_GRADIENT_SCOPE = re.compile(r"^(?:.*/)?(?:gradient_tape|gradients)(?:_\d+)?/")


def available() -> bool:
    """Whether this TensorFlow has op callbacks (every 2.x release so far)."""
    return _op_callbacks is not None


@dataclass(eq=False)
class _GraphState:
    """What one traced graph holds: its checked tensors, forward ops and candidate cuts."""

    graph: weakref.ReferenceType[Any]
    codes: dict[str, int] = field(default_factory=dict)  # tensor name -> code index
    aliases: dict[str, Any] = field(default_factory=dict)  # identity name -> tensor it passes
    pending: dict[str, Site] = field(default_factory=dict)  # chained outputs, unchecked yet
    forward: dict[str, Site] = field(default_factory=dict)  # op name -> site
    outputs: dict[str, Site] = field(default_factory=dict)  # tensor name -> forward site
    cuts: list[Cut] = field(default_factory=list)


class OpCapture:
    """The op callback, the code variables and the events of op-level capture.

    Args:
        on_bug: Called with a bug caught in the callback (fail-open: the op is left as is).
        gated: Whether the checks run only while :meth:`arm` says so (``escalate=True``);
            otherwise on every step.
    """

    def __init__(self, on_bug: Callable[[BaseException, str], None], gated: bool) -> None:
        self._on_bug = on_bug
        self._chunks: list[tf.Variable] = []
        self._count = 0
        self._sites: list[Site] = []
        self._graphs: weakref.WeakKeyDictionary[Any, _GraphState] = weakref.WeakKeyDictionary()
        self._stack: list[LayerSpec] = []
        self._own = 0
        self._registered = False
        self._removed = False  # a callback left in another thread then does nothing
        self._armed: tf.Variable | None = None
        self._armed_now = False
        with tf.init_scope():
            if gated:
                self._armed = tf.Variable(False, trainable=False, name="graddebug_ops_armed")
            self._grow(CHUNK)

    # -- lifecycle ------------------------------------------------------------------------

    def remove(self) -> None:
        """Unregister the op callback (graphs traced meanwhile keep their checks, which then
        write to variables nobody reads)."""
        self._removed = True
        if self._registered and _op_callbacks is not None:
            self._registered = False
            # Callbacks are per thread: one registered by another thread's trace is not here.
            with contextlib.suppress(KeyError):
                _op_callbacks.remove_op_callback(self._callback)

    @property
    def registered(self) -> bool:
        """Whether the op callback is registered now."""
        return self._registered

    @contextmanager
    def layer(self, spec: LayerSpec) -> Iterator[None]:
        """Attribute the ops traced in the block to ``spec``; eager calls pass through."""
        if tf.executing_eagerly() or _op_callbacks is None:
            yield
            return
        if not self._registered and not self._removed:
            _op_callbacks.add_op_callback(self._callback)
            self._registered = True
        self._stack.append(spec)
        try:
            yield
        finally:
            self._stack.pop()

    @contextmanager
    def own(self) -> Iterator[None]:
        """graddebug's own ops (recording identities, statistics) are not checked."""
        self._own += 1
        try:
            yield
        finally:
            self._own -= 1

    def alias(self, watched: Any, original: Any) -> None:
        """``watched`` (a recording identity of ``original``) holds the same values: readers
        of it are judged by ``original``'s code, with no check of their own."""
        if tf.executing_eagerly() or not self._registered:
            return
        state = self._graphs.get(original.graph)
        if state is not None:
            state.aliases[watched.name] = original
            if original.name in state.outputs:
                state.outputs[watched.name] = state.outputs[original.name]

    def arm(self, on: bool) -> None:
        """Under ``escalate=True``: whether the next steps run their checks."""
        if self._armed is not None and on != self._armed_now:
            self._armed.assign(on)
            self._armed_now = on

    # -- tracing --------------------------------------------------------------------------

    def _callback(self, op_type: str, inputs: Any, attrs: Any, outputs: Any,
                  op_name: str | None = None, graph: Any = None) -> None:
        """The op callback: every op a trace creates while it is registered (fail-open)."""
        if graph is None or self._own or self._removed or not outputs:
            return None
        with FailOpen(self._on_bug, f"ops ({op_type})"):  # the op stays unchecked
            self._trace(op_type, list(inputs), attrs, list(outputs), graph)
        return None

    def _trace(self, op_type: str, inputs: list[Any], attrs: Any, outputs: list[Any],
               graph: Any) -> None:
        """Check a forward op created inside a watched layer, or a gradient op that differentiates
        one; note the ops that may cut the graph."""
        state = self._graphs.get(graph)
        if self._stack:
            if state is None:
                state = self._graphs[graph] = _GraphState(weakref.ref(graph))
            self._note_cut(state, op_type, inputs, outputs)
            if op_type in _SKIP:
                return
            floating = [t for t in outputs if t.dtype.is_floating]
            if not floating:
                return
            op = floating[0].op
            site = Site(self._stack[-1], op_type, op.name, user_source(op), (),
                         self._input_codes(state, op_type, inputs))
            self._output_codes(state, site, floating)
            self._sites.append(site)
            state.forward[op.name] = site
            for t in floating:
                state.outputs[t.name] = site
            return
        if state is None or op_type in _SKIP:
            return
        floating = [t for t in outputs if t.dtype.is_floating]
        if not floating or not _GRADIENT_SCOPE.match(floating[0].op.name):
            return
        op = floating[0].op
        forward = self._differentiated(state, op.name, inputs)
        if forward is None:
            return
        site = Site(forward.spec, op_type, op.name, forward.source, (),
                     self._input_codes(state, op_type, inputs), forward)
        self._output_codes(state, site, floating)
        self._sites.append(site)

    def _differentiated(self, state: _GraphState, name: str, inputs: list[Any]) -> Site | None:
        """The forward op a gradient op named ``name`` differentiates: the forward op whose
        name scopes it (``gradient_tape/<forward op>/...``, or ``gradients/<forward
        op>_grad/...`` under ``tf.gradients``), else a forward op in the same scope whose
        output it reads (``gradient_tape/<scope>/SqrtGrad`` reads ``Sqrt``)."""
        rest = _GRADIENT_SCOPE.sub("", name, count=1)
        parts = rest.split("/")
        for end in range(len(parts) - 1, 0, -1):
            # tf.gradients scopes them as <forward op>_grad/...
            scope = "/".join(parts[:end])
            found = state.forward.get(scope) or state.forward.get(scope.removesuffix("_grad"))
            if found is not None:
                return found
        scope = rest.rpartition("/")[0]
        for t in inputs:
            site = state.outputs.get(t.name)
            if site is not None and site.op_name.rpartition("/")[0] == scope:
                return site
        return None

    def _output_codes(self, state: _GraphState, site: Site, outputs: list[Any]) -> None:
        """Check ``site``'s outputs now, or, for a link of a chain Grappler may rewrite,
        once a reader outside such chains appears (see ``_CHAINED``)."""
        if site.op_type in _CONTRACTIONS:
            return
        if site.op_type in _CHAINED:
            for t in outputs:
                state.pending[t.name] = site
            return
        site.codes = tuple(self._check(state, t) for t in outputs)

    def _input_codes(self, state: _GraphState, reader: str, inputs: list[Any]
                     ) -> tuple[int, ...]:
        """The codes of the floating inputs an op of type ``reader`` reads, checking those
        not checked yet; weights, constants and links of a rewritable chain are left out."""
        codes = []
        for t in inputs:
            t = state.aliases.get(t.name, t)
            if not t.dtype.is_floating or t.op.type in _TRUSTED_INPUTS:
                continue
            index = state.codes.get(t.name)
            if index is None:
                kind = t.op.type
                if kind in _CONTRACTIONS or (kind in _CHAINED and reader in _CHAIN_ENDS):
                    continue
                index = self._check(state, t)
                producer = state.pending.pop(t.name, None)
                if producer is not None:
                    producer.codes = (*producer.codes, index)
            codes.append(index)
        return tuple(codes)

    def _check(self, state: _GraphState, tensor: Any) -> int:
        """Add the ops that write ``tensor``'s code; return the code's index."""
        index = state.codes.get(tensor.name)
        if index is not None:
            return index
        index = self._count
        if index >= len(self._chunks) * CHUNK:
            with tf.init_scope():
                self._grow(index + 1)
        self._count += 1
        state.codes[tensor.name] = index
        chunk, offset = self._chunks[index // CHUNK], index % CHUNK

        def write() -> tf.Tensor:
            finite = tf.reduce_all(tf.math.is_finite(tensor))
            nan = tf.reduce_any(tf.math.is_nan(tensor))
            code = tf.where(finite, _FINITE, tf.where(nan, _NAN, _INF))
            chunk[offset].assign(code)
            return tf.constant(True)

        with tf.name_scope(CHECK_SCOPE):
            if self._armed is None:
                write()
            else:
                tf.cond(self._armed, write, lambda: tf.constant(False))
        return index

    def _grow(self, count: int) -> None:
        """Add code chunks until there are ``count`` codes; call it outside any graph."""
        while len(self._chunks) * CHUNK < count:
            self._chunks.append(tf.Variable(tf.zeros([CHUNK], tf.int32), trainable=False,
                                            name=f"graddebug_op_codes_{len(self._chunks)}"))

    def _note_cut(self, state: _GraphState, op_type: str, inputs: list[Any],
                  outputs: list[Any]) -> None:
        """Keep an op that may cut the gradient of a watched layer, to judge once a step shows a
        cut."""
        cause = cut_cause(op_type, inputs, outputs)
        if cause is not None:
            op = outputs[0].op
            state.cuts.append(Cut(self._stack[-1], op.name, cause, user_source(op)))

    # -- closing a step -------------------------------------------------------------------

    def read(self) -> np.ndarray | None:
        """The codes of the step (one transfer), zeroed for the next; None before any op was
        checked, or when the checks did not run (``escalate=True``, not armed)."""
        if self._count == 0 or (self._armed is not None and not self._armed_now):
            return None
        used = self._chunks[: (self._count - 1) // CHUNK + 1]
        codes = tf.concat([c.read_value() for c in used], 0).numpy()[: self._count]
        for c in used:
            c.assign(tf.zeros_like(c))
        return codes

    def nonfinite_events(self, step: int, codes: np.ndarray, layer_events: list[Event]
                         ) -> list[Event]:
        """The op where NaN/Inf was born in forward and the one in backward, if any.

        Args:
            step: The step.
            codes: Its codes, from :meth:`read`.
            layer_events: Its layer-level events: a forward birth in a layer whose output
                went non-finite is preferred to one in a layer that stayed finite (an
                attention mask's -inf, by design).
        """
        if not (codes > _FINITE).any():
            return []
        births = [s for s in self._sites
                  if s.codes and max(codes[i] for i in s.codes) > _FINITE
                  and all(codes[i] <= _FINITE for i in s.inputs)]
        events = []
        forward = [s for s in births if s.forward is None]
        if forward:
            broken = {e.layer for e in layer_events
                      if e.event == EventKind.FORWARD_NONFINITE.value}
            first = next((s for s in forward if s.spec.name in broken),
                         forward[0])
            events.append(self._event(step, first, EventKind.OP_NONFINITE,
                                      _DETAIL[max(codes[i] for i in first.codes)]))
        backward = [s for s in births if s.forward is not None]
        if backward:
            grad = backward[0]
            target = grad.forward
            assert target is not None
            what = _DETAIL[max(codes[i] for i in grad.codes)]
            events.append(self._event(
                step, target, EventKind.OP_GRAD_NONFINITE,
                f"{what}, in the gradient of {target.describe()}, computed by "
                f"{grad.op_type} {grad.op_name!r}"))
        return events

    @staticmethod
    def _event(step: int, site: Site, kind: EventKind, detail: str) -> Event:
        """The event of ``site`` in ``step``."""
        spec = site.spec
        return Event(step, spec.name, site.tensor, spec.depth, kind.value, detail,
                     source=site.source)

    def cut_events(self, step: int) -> list[Event]:
        """The ``op_cut`` events of every traced graph's cuts (judged once per trace)."""
        events = []
        for state in list(self._graphs.values()):
            graph = state.graph()
            if graph is None:
                continue
            for cut in state.cuts:
                if not cut.judged:
                    cut.judged = True
                    cut.event = judge(graph, cut)
                if cut.event is not None:
                    tensor, detail = cut.event
                    events.append(Event(step, cut.spec.name, tensor, cut.spec.depth,
                                        EventKind.OP_CUT.value, detail, source=cut.source))
        return events

