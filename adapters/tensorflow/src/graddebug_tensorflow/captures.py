"""What the hooks fill during a step: TF state that statistics are written into, read back and
cleared once per recorded step, and the flags that tell a compiled step whether to write it.

Hooks inside a ``tf.function`` run once, at trace time; what they leave in the graph must write
somewhere every step. They write rows into ``tf.Variable`` buffers (:class:`StateBuffers`):
activation rows in chunks of :data:`CHUNK` rows (a chunk is added, outside any graph, when a new
slot needs one, so graphs traced earlier stay valid), parameter rows in one variable. Closing a
step concatenates every buffer into one tensor, copies it to the host (one transfer per step)
and zeroes the buffers. An eager step's sentinel rows are gathered by
:class:`~.eagerrows.EagerRows` and written into these buffers just before they are read.

Under a ``tf.distribute`` strategy of several replicas, every buffer is a variable with one
copy per replica (``synchronization=ON_READ``, no aggregation): each replica writes its own
copy (:meth:`StateBuffers.local`), and closing a step reads them all, still in one transfer.
A loss-scaling optimizer adds one small row (:class:`ScalerCol`); the optimizer's view of the
weights (:mod:`.updates`) one row per watched variable (:class:`UpdateCol`); the loss of
``fit``'s batches one row per replica (:class:`LossCol`).

A compiled step cannot ask the Watcher whether it is recorded, or which statistics it
measures: :class:`StepGates` holds those answers in variables that it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np
import tensorflow as tf

from graddebug_tensorflow.distributed import replica_index
from graddebug_tensorflow.stats import ACT_WIDTH, PARAM_WIDTH, compiled, flat_entry

__all__ = ["CHUNK", "LOSS_WIDTH", "SCALER_WIDTH", "UPDATE_WIDTH", "LossCol", "Rows",
           "ScalerCol", "StateBuffers", "StepGates", "UpdateCol"]

CHUNK = 64


class ScalerCol:
    """Columns of the loss scaler's row."""

    APPLIED = 0  # 1 once the optimizer applied (or skipped) gradients in the step
    SKIPPED = 1  # 1 when it skipped a step: the scaled gradients overflowed
    SKIPPED_SCALE = 2  # the loss scale of the backward pass whose step was skipped
    SCALE = 3  # the loss scale of the backward pass of the last apply


SCALER_WIDTH = 4


class UpdateCol:
    """Columns of a watched variable's row of the optimizer's view (see :mod:`.updates`)."""

    SEEN = 0  # 1 once an apply (or the close) sampled the variable in the step
    WEIGHT_SQ = 1  # sum of squares of the sampled weights before the step's first apply
    UPDATE_SQ = 2  # sum of squares of the sampled change since then (-1: no apply seen)


UPDATE_WIDTH = 3


class LossCol:
    """Columns of the loss row (one per replica)."""

    SUM = 0  # the sum of the losses ``compute_loss`` returned in the step
    COUNT = 1  # how many it returned


LOSS_WIDTH = 2


class Rows(NamedTuple):
    """A step's rows as read back on the host.

    Attributes:
        acts: Activation rows, shape ``(replicas, rows, ACT_WIDTH)``.
        params: Parameter rows (replica 0's: the one that writes them), then the source row.
        scaler: The loss scaler's row (replica 0's), empty without a loss scaler.
        updates: The optimizer's view of the watched variables (replica 0's), shape
            ``(params, UPDATE_WIDTH)``; no rows where it is not measured.
        loss: The loss rows, shape ``(replicas, LOSS_WIDTH)``; no rows where no loss is
            captured.
    """

    acts: np.ndarray
    params: np.ndarray
    scaler: np.ndarray
    updates: np.ndarray = np.zeros((0, UPDATE_WIDTH))
    loss: np.ndarray = np.zeros((1, 0))


class StateBuffers:
    """Activation and parameter rows in ``tf.Variable`` buffers.

    Args:
        strategy: The ``tf.distribute`` strategy the watched model runs under, or None: with
            several replicas, each buffer holds one copy per replica.
    """

    def __init__(self, strategy: Any = None) -> None:
        replicas = int(strategy.num_replicas_in_sync) if strategy is not None else 1
        self._strategy = strategy if replicas > 1 else None
        self.replicas = replicas if self._strategy is not None else 1
        self._chunks: list[tf.Variable] = []
        self._rows = 0
        self.params: tf.Variable | None = None
        self.scaler: tf.Variable | None = None
        self.updates: tf.Variable | None = None
        self.loss: tf.Variable | None = None
        # flat() and clear() traced over the current variables (see _traced)
        self._traced: tuple[tuple[tf.Variable, ...], Any, Any] | None = None

    @property
    def rows(self) -> int:
        """Number of activation rows handed out."""
        return self._rows

    def variable(self, initial: Any, name: str, *, any_shape: bool = False) -> tf.Variable:
        """A non-trainable state variable: one copy per replica under a strategy of several.

        Call it outside any graph (in ``tf.init_scope()``): a ``tf.function`` that creates a
        variable traces again.

        Args:
            initial: Its initial value.
            name: Its name.
            any_shape: Whether it takes values of any shape (``keep=`` copies).
        """
        shape = {"shape": tf.TensorShape(None), "validate_shape": False} if any_shape else {}
        if self._strategy is None:
            return tf.Variable(initial, trainable=False, name=name, **shape)
        per_replica = {"synchronization": tf.VariableSynchronization.ON_READ,
                       "aggregation": tf.VariableAggregation.NONE}
        if tf.distribute.has_strategy():  # inside the scope, or a replica function of it
            return tf.Variable(initial, trainable=False, name=name, **shape, **per_replica)
        with self._strategy.scope():
            return tf.Variable(initial, trainable=False, name=name, **shape, **per_replica)

    def local(self, var: tf.Variable) -> tf.Variable:
        """The copy of ``var`` that the running replica writes (``var`` itself with one)."""
        if self._strategy is None:
            return var
        return var.values[replica_index()]

    def copy(self, var: tf.Variable, replica: int) -> tf.Variable:
        """Replica ``replica``'s copy of ``var``, to read (``var`` itself with one replica)."""
        return var if self._strategy is None else var.values[replica]

    def new_row(self) -> tuple[tf.Variable, int, int]:
        """Hand out the next activation row as ``(chunk variable, row in the chunk, index)``.

        Safe to call while a ``tf.function`` traces: a new chunk is created outside the graph.
        """
        index = self._rows
        if index // CHUNK >= len(self._chunks):
            with tf.init_scope():
                self.reserve(index + 1)
        self._rows += 1
        return self._chunks[index // CHUNK], index % CHUNK, index

    def reserve(self, rows: int) -> None:
        """Create the chunks for ``rows`` activation rows now, outside any graph, so that a
        ``tf.function`` traced later creates no variable (which would make it trace twice)."""
        while len(self._chunks) * CHUNK < rows:
            self._chunks.append(self.variable(
                tf.zeros([CHUNK, ACT_WIDTH], tf.float64), f"graddebug_rows_{len(self._chunks)}"))

    def ensure_params(self, count: int) -> tf.Variable:
        """Return the parameter buffer, (re)created for ``count`` parameters.

        Its last row is the source row: column 0 is set when gradients were handed over in the
        step (by the optimizer or ``step(grads)``), even if every one of them was None.
        """
        if self.params is None or self.params.shape[0] != count + 1:
            with tf.init_scope():
                self.params = self.variable(
                    tf.zeros([count + 1, PARAM_WIDTH], tf.float64), "graddebug_params")
        return self.params

    def ensure_scaler(self) -> tf.Variable:
        """Return the loss scaler's row (see :class:`ScalerCol`), created on first use."""
        if self.scaler is None:
            with tf.init_scope():
                self.scaler = self.variable(tf.zeros([SCALER_WIDTH], tf.float64),
                                            "graddebug_scaler")
        return self.scaler

    def ensure_updates(self, count: int) -> tf.Variable:
        """Return the rows of the optimizer's view (see :class:`UpdateCol`), (re)created for
        ``count`` variables."""
        if self.updates is None or self.updates.shape[0] != count:
            with tf.init_scope():
                self.updates = self.variable(tf.zeros([count, UPDATE_WIDTH], tf.float64),
                                             "graddebug_updates")
        return self.updates

    def ensure_loss(self) -> tf.Variable:
        """Return the loss row (see :class:`LossCol`), created on first use."""
        if self.loss is None:
            with tf.init_scope():
                self.loss = self.variable(tf.zeros([LOSS_WIDTH], tf.float64), "graddebug_loss")
        return self.loss

    def _variables(self) -> list[tf.Variable]:
        """Every buffer variable, in the order :meth:`flat` concatenates them."""
        return [*self._chunks, *(v for v in (self.params, self.scaler, self.updates, self.loss)
                                 if v is not None)]

    def flat(self) -> tf.Tensor | None:
        """Every buffer of every replica in one flat tensor (eagerly or inside a graph), for
        :meth:`unpack` to take apart after one transfer; None when there is no buffer."""
        variables = self._variables()
        if not variables:
            return None
        # One transfer for every buffer of every replica (not one per chunk: a model of
        # thousands of layers has hundreds of chunks).
        return tf.concat([tf.reshape(self.copy(v, r), [-1])
                          for r in range(self.replicas) for v in variables], 0)

    def unpack(self, flat: np.ndarray | None) -> Rows:
        """The rows of what :meth:`flat` returned, brought to the host."""
        if flat is None:
            return Rows(np.zeros((1, 0, ACT_WIDTH)), np.zeros((0, PARAM_WIDTH)), np.zeros(0))
        per_replica = flat.reshape(self.replicas, -1)
        split = len(self._chunks) * CHUNK * ACT_WIDTH
        acts = per_replica[:, :split].reshape(self.replicas, -1, ACT_WIDTH)[:, : self._rows]
        # The small buffers after the chunks, taken from the end in reverse order of flat().
        end = per_replica.shape[1]
        loss = per_replica[:, end - LOSS_WIDTH:] if self.loss is not None \
            else per_replica[:, :0]
        end -= loss.shape[1]
        size = 0 if self.updates is None else int(self.updates.shape[0]) * UPDATE_WIDTH
        updates = per_replica[0, end - size:end].reshape(-1, UPDATE_WIDTH)
        end -= size
        rest = per_replica[0, split:end]
        scaler = rest[len(rest) - SCALER_WIDTH:] if self.scaler is not None else rest[:0]
        params = rest[: len(rest) - len(scaler)].reshape(-1, PARAM_WIDTH)
        return Rows(acts, params, scaler, updates, loss)

    def _traced_pair(self) -> tuple[Any, Any] | None:
        """:meth:`flat` and :meth:`clear` as ``tf.function`` calls, traced once per set of
        variables, where they are called eagerly in one process: one dispatch each instead of an
        op per buffer, which made a close of a Keras MLP's ``fit`` step several times cheaper
        (see the Performance page). None where they must run as they are: inside a graph (the
        fused close of ``step(grads)``), or under a strategy of several replicas."""
        if self.replicas > 1 or not tf.executing_eagerly():
            return None
        variables = self._variables()
        traced = self._traced
        # Compared by identity: a variable recreated (the parameter buffer for another count)
        # needs a new trace; holding the old ones keeps their ids from being reused.
        if traced is None or len(traced[0]) != len(variables) or any(
                a is not b for a, b in zip(traced[0], variables, strict=True)):
            traced = self._traced = (tuple(variables), _no_args(compiled(self.flat)),
                                     _no_args(compiled(self._zero)))
        return traced[1], traced[2]

    def _read(self) -> Rows:
        """The rows of every buffer, read with one transfer."""
        traced = self._traced_pair()
        flat = self.flat() if traced is None else traced[0]()
        return self.unpack(None if flat is None else flat.numpy())

    def read_and_clear(self) -> Rows:
        """Return the rows of every buffer, and zero them."""
        rows = self._read()
        self.clear()
        return rows

    def peek(self) -> Rows:
        """Return the rows of every buffer without clearing them."""
        return self._read()

    def clear(self) -> None:
        """Zero every buffer (without reading it on steps that ``every=`` skips)."""
        traced = self._traced_pair()
        if traced is None:
            self._zero()
        else:
            traced[1]()

    def _zero(self) -> None:
        """Zero every copy of every buffer, op by op."""
        for v in self._variables():
            for r in range(self.replicas):
                copy = self.copy(v, r)
                copy.assign(tf.zeros_like(copy))


def _no_args(function: Any) -> Callable[[], Any]:
    """A ``tf.function`` of no arguments, traced now, as a call by its flat entry point."""
    traced = function.get_concrete_function()
    entry = flat_entry(traced)
    return cast("Callable[[], Any]", traced) if entry is None else lambda: entry([])


class StepGates:
    """The flags a compiled step reads, since it cannot ask the Watcher: whether the step is
    recorded (``every=``) and whether it measures every statistic (``full_stats_every=``).

    Each is a ``tf.Variable`` only where it can change from step to step; an eager hook asks
    the Watcher instead.

    Attributes:
        recording_var: Whether the step is recorded, where ``every > 1``; else None.
        full_var: Whether the step measures every statistic, where ``full_stats_every > 1``
            (and ``every`` is 1); else None.
    """

    __slots__ = ("_full_now", "_recording_now", "full_var", "recording_var")

    def __init__(self) -> None:
        self.recording_var: tf.Variable | None = None
        self.full_var: tf.Variable | None = None
        # What the two hold: an eager assign is an op dispatch, skipped when nothing changes.
        self._recording_now = self._full_now = True

    def create(self, every: int, full_stats_every: int, recording: bool, full: bool) -> None:
        """Create the variables that ``every`` and ``full_stats_every`` need.

        Args:
            every: Record one step in ``every``.
            full_stats_every: One recorded step in this many measures every statistic.
            recording: Whether the next step is recorded.
            full: Whether the next step measures every statistic.
        """
        self._recording_now, self._full_now = recording, full
        if every > 1:
            self.recording_var = tf.Variable(recording, trainable=False,
                                             name="graddebug_recording")
        elif full_stats_every > 1:
            self.full_var = tf.Variable(full, trainable=False, name="graddebug_full_stats")

    def when_recording(self, write: Callable[[], tf.Tensor]) -> None:
        """Run ``write`` now (eager), or on recorded steps only (a graph, with ``every=``)."""
        if self.recording_var is None or tf.executing_eagerly():
            write()
        else:
            tf.cond(self.recording_var, write, lambda: tf.constant(False))

    def set_recording(self, recording: bool) -> None:
        """Say whether the next step is recorded."""
        if self.recording_var is not None and recording != self._recording_now:
            self.recording_var.assign(recording)
            self._recording_now = recording

    def set_full(self, full: bool) -> None:
        """Say whether the next step measures every statistic."""
        if self.full_var is not None and full != self._full_now:
            self.full_var.assign(full)
            self._full_now = full
