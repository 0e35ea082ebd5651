"""Op-level capture in TensorFlow graphs (``watch(model, ops=True)``, ``escalate=True``).

A ``tf.function`` (``model.fit``'s compiled step included) is traced once and then runs with no
Python: whatever names an operation must be built into the graph while it is traced. An op
callback (:mod:`tensorflow.python.framework.op_callbacks`, the mechanism
``tf.debugging.enable_check_numerics`` uses) sees every op as the trace creates it. For each op
with a floating output created inside a watched layer's ``call``, and for each op of the
backward pass that differentiates one of them, it adds a finiteness code (finite, Inf, NaN)
written into a ``tf.Variable``; closing the step reads the codes with one transfer and zeroes
them. Nothing raises inside the user's step, unlike ``CheckNumerics``.

From the codes, an op is where NaN or Inf was born when its output is non-finite while every
floating input it read was finite: in forward, the first such op (``op_nonfinite``); in
backward, the first gradient op, closest to the loss (``op_grad_nonfinite``), reported as the
backward of the forward op it differentiates. Each carries the op type, its name and the
user's source line from the op's creation traceback (``op.traceback``). A few links of
chains that Grappler rewrites are left unchecked, so that the weights stay bitwise identical
(see ``capture._CHAINED``).

Cut graphs need no per-step work: when a step shows starved parameters or cut layer outputs,
the ops that cut gradients (``StopGradient``, ``PyFunc``/``EagerPyFunc`` of
``tf.numpy_function``/``tf.py_function``, a ``Cast`` to an integer, rounding, argmax), traced
inside watched layers downstream of a variable, are named as ``op_cut`` events, judged once
per trace (:mod:`.flow`).

Eager steps are left to layer capture: the callback is registered on the first watched layer
call inside a graph, and never for an eager loop. Under ``escalate=True`` the same ops are
traced, each under a ``tf.cond`` on one variable, armed only for the steps that follow a
suspect step.

The package: :mod:`.capture` holds the op callback, the code variables and the events;
:mod:`.sites` names an op site and the user's frame that created it; :mod:`.flow` finds the
ops that cut a traced graph's gradient.
"""

from __future__ import annotations
