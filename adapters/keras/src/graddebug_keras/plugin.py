"""The ``graddebug`` entry point of Keras on the torch and JAX backends. Imports nothing until
the user has imported Keras."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from graddebug.hookspecs import hookimpl

if TYPE_CHECKING:
    from graddebug.adapter import AdapterFactory

BACKENDS = ("torch", "jax")
"""The Keras backends this plugin serves (the TensorFlow backend is graddebug_tensorflow's)."""


def keras_backend(target: object) -> str | None:
    """The Keras backend of ``target`` when it is a Keras layer or model and Keras is
    imported; None otherwise."""
    keras = sys.modules.get("keras")
    if keras is None or not hasattr(keras, "layers") or not hasattr(keras, "backend"):
        return None
    if not isinstance(target, keras.layers.Layer):
        return None
    return str(keras.backend.backend())


# tryfirst: on torch a Keras layer is a torch.nn.Module, and the TensorFlow plugin claims every
# Keras layer once TensorFlow is imported (by tf.data, say), whatever the backend.
@hookimpl(tryfirst=True)
def graddebug_adapter(target: object) -> AdapterFactory | None:
    """Claim Keras layers and models whose backend is torch or JAX."""
    backend = keras_backend(target)
    if backend == "torch":
        from graddebug_keras.torch_backend import KerasTorchAdapter

        return KerasTorchAdapter
    if backend == "jax":
        from graddebug_keras.jax_backend import KerasJaxAdapter

        return KerasJaxAdapter
    return None
