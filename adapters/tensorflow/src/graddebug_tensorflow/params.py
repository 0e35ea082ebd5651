"""Watched trainable variables, and the rows their gradients are written into."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from graddebug.errors import ConfigError, GradientCountError
from graddebug_tensorflow.captures import StateBuffers
from graddebug_tensorflow.distributed import replica_index
from graddebug_tensorflow.model import LayerIndex
from graddebug_tensorflow.stats import (
    EAGER_TENSOR,
    PARAM_WIDTH,
    compiled,
    param_row,
    unscale_param_rows,
)

__all__ = ["UNMEASURED", "Param", "ParamSet"]


@dataclass
class Param:
    """A watched variable, at ``index`` in the list that ``step(grads)`` aligns with."""

    layer: str
    tensor: str
    var: Any
    index: int
    chain: tuple[str, ...]  # its layer, then the layers that contain it
    keep: bool
    keep_var: tf.Variable | None = None
    graph_unread: bool = False  # inside a graph, its gradient is not read (see ParamSet)
    shape: tuple[str, int] | None = None
    """The ``shape`` column's text and the size of its rows, once the first was built."""


UNMEASURED = 2.0
"""Column 0 of a parameter row whose gradient was present but deliberately not read."""


def _param_rows(grads: list[Any], full: bool, scale: Any) -> tf.Tensor:
    """The rows of a list of gradients, with the loss ``scale`` divided out (None: none)."""
    rows = tf.stack([param_row(g, full) for g in grads])
    return rows if scale is None else unscale_param_rows(rows, scale)


_rows = compiled(_param_rows)


def _where(position: int, var: Any) -> str:
    """The gradient an error message is about (built only for the message)."""
    name = getattr(var, "path", None) or getattr(var, "name", "?")
    return f"step() gradient #{position} (for variable {name!r})"


def _check_given(position: int, grad: Any, var: Any, expected: tuple[tuple[int, ...], Any],
                 what: str) -> None:
    """Check one gradient handed to ``step(grads)`` against its variable, of shape and dtype
    ``expected``.

    Raises:
        GradientCountError: It is not a tensor (nor None), or its shape or dtype differs.
    """
    if grad is None:
        return
    if (type(grad) is EAGER_TENSOR and grad._shape_tuple() == expected[0]
            and grad.dtype is expected[1]):
        return  # the usual gradient, checked without building a TensorShape (~10 us each)
    if isinstance(grad, tf.distribute.DistributedValues):
        raise GradientCountError(
            f"{_where(position, var)} is a {type(grad).__name__}, one gradient per replica of "
            "a tf.distribute strategy; graddebug measures the gradients the replicas sum: pass "
            "the optimizer as watch(model, optimizer=opt) and close each step with dbg.step()."
        )
    if isinstance(grad, tf.IndexedSlices):  # sparse (an embedding): its dense shape counts
        shape, dtype = grad.dense_shape, grad.values.dtype
        static = tf.get_static_value(shape)
        got = tuple(int(d) for d in static) if static is not None else None
    elif isinstance(grad, (tf.Tensor, tf.Variable, keras.Variable, np.ndarray)):
        got, dtype = tuple(grad.shape), tf.as_dtype(grad.dtype)
    else:
        raise GradientCountError(
            f"{_where(position, var)} is a {type(grad).__name__}, not a tensor or None; pass "
            f"tape.gradient(loss, {what.split(' ')[0]}), in that order."
        )
    if (got is not None and got != expected[0]) or dtype != expected[1]:
        raise GradientCountError(
            f"{_where(position, var)} has shape {got} and dtype {dtype.name}, but the variable "
            f"has shape {expected[0]} and dtype {expected[1].name}; pass "
            f"tape.gradient(loss, {what.split(' ')[0]}), in that order."
        )


class ParamSet:
    """The variables whose gradients are recorded: a model's trainable variables (or those of
    the ``layers=`` selection), or the ``params=`` entries.

    They are resolved on first use, since a Keras model creates its variables on its first call.

    Args:
        buffers: Where gradient rows are written.
        index: The model's layers; None without a model.
        given: The ``params=`` mapping (empty without one).
        chosen: Names of the selected layers, or None when every variable is watched.
        keep: Layer names whose full gradients are kept.
        full: Also write the sum and absmax (``param_stats="full"``).
    """

    def __init__(self, buffers: StateBuffers, index: LayerIndex | None,
                 given: Mapping[str, Any], chosen: Collection[str] | None,
                 keep: Collection[str], full: bool,
                 graph_unread: Collection[str] = ()) -> None:
        for key, value in given.items():
            if not isinstance(value, (tf.Variable, keras.Variable)):
                raise ConfigError(
                    f"params[{key!r}] is a {type(value).__name__}, not a tf.Variable or "
                    f"keras.Variable; for an intermediate tensor use tap(t, {key!r})."
                )
        self._buffers = buffers
        self._index = index
        self._given = dict(given)
        self._chosen = None if chosen is None else set(chosen)
        self._keep = set(keep)
        self._full = full
        self._graph_unread = set(graph_unread)
        self._params: list[Param] | None = None
        self._positions: dict[int, int] = {}
        self.aligned: list[Any] = []
        self._expected: list[tuple[tuple[int, ...], Any]] = []  # shape and dtype, by position

    def resolve(self) -> list[Param]:
        """The watched parameters, resolved as soon as the variables exist."""
        if self._params is not None and (self._params or self._index is None):
            return self._params
        if self._given:
            aligned = list(self._given.values())
            names = [(key, key) for key in self._given]
        elif self._index is not None:
            aligned = list(self._index.model.trainable_variables)
            names = [self._index.owner(v) for v in aligned]
        else:
            aligned, names = [], []
        params: list[Param] = []
        for position, (var, (layer, short)) in enumerate(zip(aligned, names, strict=True)):
            chain = (layer, *(self._index.ancestors(layer) if self._index else ()))
            if self._chosen is not None and not self._chosen.intersection(chain):
                continue
            params.append(Param(layer, short, var, position, chain, keep=layer in self._keep,
                                graph_unread=layer in self._graph_unread))
        if params:
            with tf.init_scope():
                for p in params:
                    if p.keep:
                        # Replica 0 writes parameter rows and copies (see _store).
                        p.keep_var = self._buffers.copy(self._buffers.variable(
                            tf.zeros([0]), f"graddebug_keep_{p.layer}_{p.tensor}",
                            any_shape=True), 0)
            self._buffers.ensure_params(len(params))
        self.aligned = aligned
        self._expected = [(tuple(v.shape), tf.as_dtype(v.dtype)) for v in aligned]
        self._positions = {id(p.var): i for i, p in enumerate(params)}
        self._params = params
        return params

    def applied(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[tuple[int, Any]]:
        """``(row, gradient)`` of the watched variables among those an optimizer applies."""
        self.resolve()
        return [(self._positions[id(v)], g) for g, v in zip(grads, variables, strict=False)
                if id(v) in self._positions]

    def rows_of(self, variables: Sequence[Any]) -> list[tuple[int, Any]]:
        """``(row, variable)`` of the watched variables among ``variables``."""
        self.resolve()
        return [(self._positions[id(v)], v) for v in variables if id(v) in self._positions]

    def write_applied(self, pairs: list[tuple[int, Any]], scale: Any = None) -> tf.Tensor:
        """Write the rows of gradients an optimizer applies (eagerly or while tracing).

        Args:
            pairs: ``(row, gradient)`` as :meth:`applied` returns them.
            scale: The loss scale the gradients carry, divided out of their rows; None for
                none.
        """
        return self._store(pairs, scale)

    def write_given(self, grads: Sequence[Any], scale: Any = None) -> None:
        """Write the rows of gradients handed to ``step(grads)``, dividing out the loss
        ``scale`` they carry (None: none).

        Raises:
            GradientCountError: As :meth:`check_given`.
        """
        self.check_given(grads)
        self.store_given(grads, scale)

    def check_given(self, grads: Sequence[Any]) -> None:
        """Check gradients handed to ``step(grads)`` against the variables.

        Raises:
            GradientCountError: ``grads`` does not align with the variables: another count,
                an entry that is not a tensor, or one whose shape or dtype differs from its
                variable's (a list in the wrong order).
        """
        self.resolve()
        what = "params= entries" if self._given else "model.trainable_variables"
        if len(grads) != len(self.aligned):
            raise GradientCountError(
                f"step() got {len(grads)} gradients but there are {len(self.aligned)} "
                f"{what}; pass tape.gradient(loss, {what.split(' ')[0]}) in that order."
            )
        for position, (grad, var, expected) in enumerate(
                zip(grads, self.aligned, self._expected, strict=True)):
            _check_given(position, grad, var, expected, what)

    def store_given(self, grads: Sequence[Any], scale: Any = None) -> None:
        """Write the rows of checked gradients handed to ``step(grads)``, eagerly or inside
        graddebug's own function (they are not read inside the user's graph)."""
        params = self.resolve()
        self._store([(i, grads[p.index]) for i, p in enumerate(params)], scale,
                    users_graph=False)

    def _store(self, pairs: list[tuple[int, Any]], scale: Any,
               users_graph: bool | None = None) -> tf.Tensor:
        buffer = self._buffers.params
        if buffer is None or self._params is None:
            return tf.constant(False)
        if self._buffers.replicas > 1:
            # Every replica holds the same all-reduced gradients: replica 0 measures them.
            if replica_index() != 0:
                return tf.constant(False)
            buffer = self._buffers.copy(buffer, 0)
        params = self._params
        present = [(i, g) for i, g in pairs if g is not None]
        unread: list[int] = []
        if users_graph is None:
            users_graph = not tf.executing_eagerly()
        if users_graph:
            # A second reader of a batch norm's gamma/beta gradient inside the user's graph
            # stops TF's optimizer from fusing that backward as it does unwatched: the weights
            # would differ in their last bits. Those rows say "present, not measured".
            unread = [i for i, _ in present if params[i].graph_unread]
            present = [(i, g) for i, g in present if not params[i].graph_unread]
        pad = [0.0] * (PARAM_WIDTH - 1)
        marks = tf.constant([[1.0, *pad]] + [[UNMEASURED, *pad]] * len(unread), tf.float64)
        rows = tf.concat([_rows([g for _, g in present], self._full, scale), marks], 0) \
            if present else marks
        # One op writes the rows and marks the source row, in eager mode and in a graph alike.
        buffer.scatter_nd_update(
            [[i] for i, _ in present] + [[len(params)]] + [[i] for i in unread], rows)
        for i, g in present:
            keep_var = self._params[i].keep_var
            if keep_var is not None:
                keep_var.assign(tf.convert_to_tensor(g))
        return tf.constant(True)
