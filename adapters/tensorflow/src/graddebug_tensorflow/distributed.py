"""``tf.distribute``: which strategy a watched model runs under, and which replica runs now.

Under a strategy of several replicas in one process (``MirroredStrategy``), Keras and
``strategy.run`` call a replica function once per replica: the same layers, the same
gradient functions, in one graph traced once per replica. Each replica writes its
statistics into its own copy of the adapter's state (:class:`~.captures.StateBuffers` makes
the copies), chosen by the replica's index, which is known when the graph is traced. Without
a strategy none of this runs: there is one copy, and no replica to ask for.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

__all__ = ["all_reduced", "replica_index", "strategy_of"]


def strategy_of(model: Any, params: Any = ()) -> Any:
    """The ``tf.distribute`` strategy a watch runs under, or None for the default one.

    It is the strategy whose scope is open, else the one the Keras model was built under
    (``model.distribute_strategy``: ``fit`` needs no open scope), else the one that created
    the first ``params=`` variable.

    Args:
        model: The watched Keras model, or None.
        params: The ``params=`` variables (an iterable; empty without them).
    """
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    default = tf.distribute.get_strategy()
    candidates = [getattr(model, "distribute_strategy", None)]
    for var in params:
        var = var.value if isinstance(var, keras.Variable) else var
        candidates.append(getattr(var, "distribute_strategy", None))
        break
    for strategy in candidates:
        if strategy is not None and strategy is not default:
            return strategy
    return None


def replica_index() -> int:
    """The index of the replica whose function runs now: 0 in cross-replica context, in the
    default strategy, or where the index is not known while tracing (a TPU's)."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return 0
    index = tf.get_static_value(context.replica_id_in_sync_group)
    return int(index) if index is not None else 0


def all_reduced(pairs: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """``(row, gradient)`` pairs with the gradients summed over the replicas in sync, as a
    Keras optimizer sums them before it applies them; unchanged outside a replica function
    of several replicas.

    Every replica calls this, outside any ``tf.cond``: a cross-replica sum inside one
    cannot synchronise the replicas. It costs one more all-reduce of the watched gradients
    per step, as large as the optimizer's own, which happens after ``apply`` has clipped or
    accumulated them and so cannot be shared without recording other gradients than a single
    replica records.
    """
    context = tf.distribute.get_replica_context()
    present = [(i, g) for i, g in pairs if g is not None]
    if context is None or context.num_replicas_in_sync == 1 or not present:
        return pairs
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [g for _, g in present])
    return [(i, g) for (i, _), g in zip(present, summed, strict=True)]
