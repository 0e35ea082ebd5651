"""Layer outputs and taps: where each one's row is, which outputs are differentiable, how their
parts are named, and interventions as TF applies them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from graddebug.capture.layers import Intervention, LayerSpec, intervene_fail_open
from graddebug_tensorflow.stats import apply_intervention

__all__ = [
    "Slot",
    "carry_keras_attributes",
    "differentiable",
    "intervene",
    "is_mask_tensor",
    "keeps_finite",
    "leaf_names",
    "unit_axis",
    "weighted",
]


_KEEPS_FINITE = frozenset({
    keras.layers.Identity, keras.layers.Flatten, keras.layers.Reshape, keras.layers.Permute,
    keras.layers.ReLU, keras.layers.Dropout, keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D,
    keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D,
    keras.layers.GlobalMaxPooling1D, keras.layers.GlobalMaxPooling2D,
    keras.layers.GlobalMaxPooling3D,
})
_FINITE_ACTIVATIONS = frozenset({"linear", "relu", "relu6", "sigmoid", "hard_sigmoid", "tanh"})


def keeps_finite(layer: Any) -> bool:
    """Whether ``layer``'s output is finite whenever its input is (a clamp, a monotone squash,
    a mask or selection, a reshape), so that its forward finiteness check can find nothing.

    Exact types, as a subclass may override ``call``; an ``Activation`` layer by its function.
    Averages, normalisation, softmax, exp and log keep their check.
    """
    kind = type(layer)
    if kind in _KEEPS_FINITE:
        return True
    if kind is keras.layers.Activation:
        return getattr(layer.activation, "__name__", "") in _FINITE_ACTIVATIONS
    return False


_WEIGHTED = frozenset({
    keras.layers.Dense, keras.layers.EinsumDense,
    keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
    keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D, keras.layers.SeparableConv2D,
    keras.layers.Embedding,
    keras.layers.LayerNormalization, keras.layers.BatchNormalization,
    keras.layers.GroupNormalization,
})


def weighted(layer: Any) -> bool:
    """Whether ``layer``'s output is fixed by its input and its own weights (an affine map, a
    convolution, a lookup, a normalisation), so that a NaN it makes from a finite input was in
    its weights. Exact types; a built-in activation keeps it (a finite-to-finite function).
    Not under float16, which overflows into +Inf and -Inf, whose sum reads as NaN."""
    if type(layer) not in _WEIGHTED or getattr(layer, "compute_dtype", None) == "float16":
        return False
    activation = getattr(layer, "activation", None)
    return activation is None or getattr(activation, "__name__", "") in _FINITE_ACTIVATIONS


@dataclass
class Slot:
    """The buffer row of one (layer, output, call index)."""

    layer: LayerSpec
    tensor: str
    ordinal: int
    var: tf.Variable
    row: int
    index: int
    row_tensor: tf.Tensor  # the row as an eager tensor: compiled writers then trace once
    keep_var: tf.Variable | None = None
    severed: bool = False  # the layer cut the graph: its input is taped, its output is not


def is_mask_tensor(mask: Any) -> bool:
    """Whether ``mask`` is a tensor TF can apply as a mask (a tensor, a variable, an array)."""
    return isinstance(mask, (tf.Tensor, tf.Variable, np.ndarray))


def intervene(spec: Intervention, name: str, grad: tf.Tensor,
              on_bug: Callable[[BaseException, str], None]) -> tf.Tensor:
    """Apply ``spec`` to ``grad`` as every adapter does (see
    :func:`graddebug.capture.layers.intervene_fail_open`); shapes TF leaves unknown until run
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


# Keras keeps what it attaches to a tensor (``_keras_mask``, ``_keras_logits``) as an attribute
# of the tensor object, or, for tensor types that take no attributes, in a side table keyed by
# ``id(tensor)`` that only these accessors read.
try:
    from keras.src.backend.common.tensor_attributes import get_tensor_attr, set_tensor_attr
except ImportError:  # pragma: no cover - a Keras without the side table: attributes only
    get_tensor_attr = set_tensor_attr = None

_KERAS_PREFIX = "_keras_"
_SIDE_TABLE = ("_keras_mask",)  # the attributes Keras may keep in its side table


def carry_keras_attributes(source: tf.Tensor, target: tf.Tensor) -> tf.Tensor | None:
    """Copy every attribute Keras attached to ``source`` onto ``target``, its watched identity.

    Keras reads them downstream: losses compute cross-entropy from ``_keras_logits`` instead
    of ``log(clip(probabilities))``, and masked losses and metrics read ``_keras_mask``. An
    identity that dropped them would change the loss, and so the weights.

    Args:
        source: A layer's output as the layer returned it.
        target: The tensor that replaces it downstream.

    Returns:
        ``source._keras_logits`` when it has one, left for the caller to set on ``target``
        (it must pass through the recording identity too); None otherwise.
    """
    logits = None
    for name, value in list(getattr(source, "__dict__", {}).items()):
        if not name.startswith(_KERAS_PREFIX) or name == "_keras_history":
            continue  # _keras_history belongs to symbolic tensors, which are not watched
        if name == "_keras_logits":
            logits = value
        else:
            setattr(target, name, value)
    if get_tensor_attr is not None and set_tensor_attr is not None:
        for name in _SIDE_TABLE:
            value = get_tensor_attr(source, name)
            if value is not None and get_tensor_attr(target, name) is None:
                set_tensor_attr(target, name, value)
    return logits if isinstance(logits, tf.Tensor) else None
