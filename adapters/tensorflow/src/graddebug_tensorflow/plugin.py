"""The ``graddebug`` entry point of the TensorFlow adapter. Imports TF only once the user has."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from graddebug.hookspecs import hookimpl

if TYPE_CHECKING:
    from graddebug.adapter import AdapterFactory


@hookimpl
def graddebug_adapter(target: object) -> AdapterFactory | None:
    """Claim Keras layers and models, ``tf.Tensor``, ``tf.Variable`` and ``keras.Variable``
    objects, when TensorFlow is imported; those of a ``tf.compat.v1`` graph (and a model
    watched inside one, to refuse it) go to the v1-graph adapter."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return None
    claimed: tuple[type, ...] = (tf.Tensor, tf.Variable)
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "layers"):
        claimed += (keras.layers.Layer, keras.Variable)
    if not isinstance(target, claimed):
        return None
    from graddebug_tensorflow.v1session import in_v1_graph

    if in_v1_graph(target):
        from graddebug_tensorflow.v1graph import V1GraphAdapter

        return V1GraphAdapter
    from graddebug_tensorflow.adapter import TensorFlowAdapter

    return TensorFlowAdapter
