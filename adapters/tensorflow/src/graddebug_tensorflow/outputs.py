"""Layer outputs and taps: what is watched, where its row is, and checks on interventions."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from graddebug.errors import MaskShapeError
from graddebug.interventions import Intervention, intervene_fail_open
from graddebug_tensorflow.stats import apply_intervention

__all__ = [
    "Layer",
    "Slot",
    "check_mask",
    "differentiable",
    "intervene",
    "leaf_names",
    "unit_axis",
]


@dataclass
class Layer:
    """A watched layer, tap or ``params=`` entry."""

    name: str
    channels_first: bool = False
    keep: bool = False
    intervention: Intervention | None = None
    capture: bool = True
    depth: int = -1
    mask_checked: bool = False


@dataclass
class Slot:
    """The buffer row of one (layer, output, call index)."""

    layer: Layer
    tensor: str
    ordinal: int
    var: tf.Variable
    row: int
    index: int
    row_tensor: tf.Tensor  # the row as an eager tensor: compiled writers then trace once
    keep_var: tf.Variable | None = None


def check_mask(layer: Layer, tensor: tf.Tensor, mask: Any) -> None:
    """Check, at the first forward, that a mask tensor broadcasts to the layer's output.

    Raises:
        MaskShapeError: It does not; the message names the layer and both shapes.
    """
    if layer.mask_checked:
        return
    shape = tuple(getattr(mask, "shape", ()))
    target = tuple(tensor.shape)
    if not isinstance(mask, (tf.Tensor, tf.Variable, np.ndarray)) or not _broadcasts(
        shape, target
    ):
        raise MaskShapeError(
            f"the mask for {layer.name!r} has shape {shape} but the gradient there has "
            f"shape {target}; give a tensor that broadcasts to it (e.g. shape "
            "(1, features)) or a callable grad -> grad."
        )
    layer.mask_checked = True


def intervene(spec: Intervention, name: str, grad: tf.Tensor,
              on_bug: Callable[[BaseException, str], None]) -> tf.Tensor:
    """Apply ``spec`` to ``grad`` as every adapter does (see
    :func:`graddebug.interventions.intervene_fail_open`); shapes TF leaves unknown until run
    time are not compared."""
    return intervene_fail_open(spec, name, grad, apply_intervention, _fits, on_bug)


def _fits(out: Any, grad: tf.Tensor) -> bool:
    if not isinstance(out, tf.Tensor):
        return False
    known = out.shape.is_fully_defined() and grad.shape.is_fully_defined()
    return not known or out.shape == grad.shape


def differentiable(value: Any) -> bool:
    """Whether ``value`` is a concrete floating tensor (not a symbolic ``KerasTensor``)."""
    return isinstance(value, tf.Tensor) and value.dtype.is_floating and not isinstance(
        value, keras.KerasTensor
    )


def leaf_names(output: Any, count: int) -> list[str]:
    """``"output"`` for a single tensor, else ``"output.<path>"`` per leaf, in tf.nest order
    (sequences by index, dicts by sorted key)."""
    if count == 1 and not tf.nest.is_nested(output):
        return ["output"]
    names = ["output" + path for path in _paths(output)]
    return names if len(names) == count else [f"output.{i}" for i in range(count)]


def _paths(value: Any) -> Iterator[str]:
    if isinstance(value, Mapping):
        items: Iterable[tuple[Any, Any]] = ((k, value[k]) for k in sorted(value))
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        yield ""
        return
    for key, item in items:
        for rest in _paths(item):
            yield f".{key}{rest}"


def unit_axis(rank: int | None, channels_first: bool) -> int | None:
    """The axis of units (features or channels) of an output of ``rank``; None below rank 2."""
    if rank is None or rank < 2:
        return None
    return 1 if channels_first else rank - 1


def _broadcasts(shape: tuple[Any, ...], target: tuple[Any, ...]) -> bool:
    if len(shape) > len(target):
        return False
    for have, want in zip(reversed(shape), reversed(target), strict=False):
        if have not in (1, want) and want is not None:
            return False
    return True

