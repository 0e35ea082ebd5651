"""TF1 sessions: whether a tensor belongs to a ``tf.compat.v1`` graph, what graddebug's fetches
hold in a ``session.run`` (:class:`GraphStats`), and the ``MonitoredTrainingSession`` hook that
fetches them every step (:class:`SessionHook`).

:class:`~.v1graph.V1GraphAdapter` builds the fetches; a session returns them with numpy values
in place of the tensors, which ``dbg.step()`` turns into records. This module imports nothing of
:mod:`.v1graph`, not even for type checking: the hook knows the adapter as a :class:`Fetches`,
the one method it calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import tensorflow as tf

from graddebug.capture.layers import FailOpen

if TYPE_CHECKING:
    from graddebug.adapter import WatchContext

__all__ = ["Fetches", "GraphStats", "SessionHook", "in_v1_graph"]


def _v1_graph(graph: Any) -> bool:
    """Whether ``graph`` is a v1 graph, not one a ``tf.function`` builds."""
    return isinstance(graph, tf.Graph) and not getattr(graph, "building_function", False)


def in_v1_graph(target: Any) -> bool:
    """Whether ``target`` (a tensor, a variable, or anything else: the default graph) belongs
    to a ``tf.compat.v1`` graph, one that a session runs, rather than to eager code or a
    ``tf.function``."""
    if isinstance(target, (tf.Tensor, tf.Variable)):
        try:
            return _v1_graph(target.graph)
        except AttributeError:  # eager tensors and variables have no graph
            return False
    return not tf.executing_eagerly() and _v1_graph(tf.compat.v1.get_default_graph())


class GraphStats(NamedTuple):
    """graddebug's fetches in a v1 graph, and what ``session.run`` returns for them.

    ``session.run`` gives back a named tuple of this type with numpy values in place of the
    tensors, which ``dbg.step()`` tells apart from a list of gradients by its type.

    Attributes:
        layout: Which :meth:`~.v1graph.V1GraphAdapter.fetches` call built it (an int64 scalar).
        activations: The rows of the taps, ``(taps, ACT_WIDTH)``.
        params: The rows of the ``params=`` gradients, then the source row.
        kept: The gradients that ``keep=`` asks for, by label.
    """

    layout: Any
    activations: Any
    params: Any
    kept: Any


class Fetches(Protocol):
    """What builds graddebug's fetches in a v1 graph (:class:`~.v1graph.V1GraphAdapter`)."""

    def fetches(self, grads: Any) -> GraphStats:
        """The fetches of the taps in the default graph and of the ``params=`` gradients
        ``grads``."""
        ...


class SessionHook(tf.compat.v1.train.SessionRunHook):
    """Records a step in every ``run`` of a ``MonitoredTrainingSession``:
    ``MonitoredTrainingSession(hooks=[dbg.session_hook()])``.

    The fetches are built in :meth:`begin`, before the session finalizes the graph, so build
    the taps and gradients before the session.

    Args:
        context: The hook side of the Watcher, whose ``watcher.step()`` closes each step.
        adapter: The adapter that builds the fetches.
        grads: As for :meth:`~.v1graph.V1GraphAdapter.fetches`.
    """

    def __init__(self, context: WatchContext, adapter: Fetches, grads: Any) -> None:
        self._ctx = context
        self._adapter = adapter
        self._grads = grads
        self._fetches: GraphStats | None = None

    def begin(self) -> None:
        """Build the fetches in the session's graph."""
        self._fetches = self._adapter.fetches(self._grads)

    def before_run(self, run_context: Any) -> Any:
        """Add the fetches to the ``run``."""
        return tf.compat.v1.train.SessionRunArgs(self._fetches)

    def after_run(self, run_context: Any, run_values: Any) -> None:
        """Close the step with what the ``run`` fetched."""
        with FailOpen(self._ctx.internal_error, "session_hook"):  # the run has happened
            self._ctx.watcher.step(run_values.results)
