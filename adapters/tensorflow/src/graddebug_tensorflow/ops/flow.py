"""Ops that cut a traced graph's gradient, named for ``cut_graph`` findings (``ops=True``).

The op callback of :mod:`.capture` notes, as a trace creates them inside watched layers, the ops
through which no gradient flows: ``StopGradient``, ``PyFunc``/``EagerPyFunc``
(``tf.numpy_function``, ``tf.py_function``), a ``Cast`` to an integer, rounding and argmax.
Only once a step shows a cut (starved variables, a cut layer output) is each one judged, once
per trace, by a walk of the graph: it cuts a gradient when it reads values computed from a
variable and something reads its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from graddebug.capture.layers import LayerSpec

__all__ = ["CHECK_SCOPE", "Cut", "cut_cause", "judge"]

CHECK_SCOPE = "graddebug_check"
"""The name scope of graddebug's finiteness checks, which a walk of the graph steps over."""

_PASS_THROUGH = frozenset({"Identity", "IdentityN"})
_CUT_CAUSES = {
    "StopGradient": "tf.stop_gradient cut the graph",
    "PreventGradient": "tf.raw_ops.PreventGradient cut the graph",
    "PyFunc": "the values left TensorFlow through tf.numpy_function, which has no gradient",
    "PyFuncStateless": "the values left TensorFlow through tf.numpy_function, which has no "
                       "gradient",
    "EagerPyFunc": "the values went through tf.py_function, and no tape watched them there",
    "Round": "tf.round has no gradient",
    "Floor": "tf.floor has no gradient",
    "Ceil": "tf.math.ceil has no gradient",
    "ArgMax": "an argmax has no gradient",
    "ArgMin": "an argmin has no gradient",
}
_INTEGER_CAST = "a cast to {dtype} (an integer has no gradient)"


def cut_cause(op_type: str, inputs: list[Any], outputs: list[Any]) -> str | None:
    """Why an op of ``op_type`` would cut the gradient of its floating inputs, in words; None
    for an op that passes gradients, or that reads no floating value."""
    cause = _CUT_CAUSES.get(op_type)
    if cause is None and op_type == "Cast" and outputs:
        dtype = outputs[0].dtype
        if dtype.is_integer or dtype == tf.bool:
            cause = _INTEGER_CAST.format(dtype=dtype.name)
    if cause is None or not any(t.dtype.is_floating for t in inputs):
        return None
    return cause


@dataclass(eq=False)
class Cut:
    """An op traced inside a watched layer that may cut the graph.

    Attributes:
        spec: The watched layer whose ``call`` created it.
        op_name: Its name in the traced graph.
        cause: What cuts the gradient there, in words.
        source: ``file:line`` of the user's code that created it.
        event: ``(tensor, detail)`` of its ``op_cut`` events, once :func:`judge` found it
            cuts a gradient.
        judged: Whether :func:`judge` looked at it.
    """

    spec: LayerSpec
    op_name: str
    cause: str
    source: str
    event: tuple[str, str] | None = None  # (tensor, detail), once judged a cut
    judged: bool = False


def judge(graph: Any, cut: Cut) -> tuple[str, str] | None:
    """The ``(tensor, detail)`` of a candidate cut that reads values computed from a variable
    and whose output is used; None for one that cuts nothing a gradient would cross."""
    op = graph.get_operation_by_name(cut.op_name)
    consumers = _readers(op)
    if not consumers:
        return None
    upstream = next((t.op for t in op.inputs if t.dtype.is_floating), None)
    while upstream is not None and upstream.type in _PASS_THROUGH and upstream.inputs:
        upstream = upstream.inputs[0].op  # a recording identity: name what it passes on
    if upstream is None or not _reads_variable(upstream):
        return None
    down = consumers[0]
    detail = (f"{cut.cause}; the gradient stops between {upstream.type} {upstream.name!r} "
              f"and {down.type} {down.name!r}")
    tensor = f"{op.type}@{cut.source}" if cut.source else op.type
    return tensor, detail


def _readers(op: Any) -> list[Any]:
    """The ops that read ``op``'s outputs, graddebug's checks and identities stepped over."""
    found: list[Any] = []
    todo = [op]
    seen = {op.name}
    while todo:
        for t in todo.pop(0).outputs:
            for reader in t.consumers():
                if CHECK_SCOPE in reader.name or reader.name in seen:
                    continue
                seen.add(reader.name)
                if reader.type in _PASS_THROUGH:
                    todo.append(reader)
                else:
                    found.append(reader)
    return found


def _reads_variable(op: Any, limit: int = 20000) -> bool:
    """Whether ``op`` depends on a variable read (its values can carry a gradient)."""
    seen = {op.name}
    todo = [op]
    while todo and len(seen) < limit:
        current = todo.pop()
        if current.type in ("ReadVariableOp", "ResourceGather"):
            return True
        for t in current.inputs:
            if (t.dtype.is_floating or t.dtype == tf.resource) and t.op.name not in seen:
                seen.add(t.op.name)
                todo.append(t.op)
    return False
