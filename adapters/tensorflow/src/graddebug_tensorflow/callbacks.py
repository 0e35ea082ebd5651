"""The Keras callback of the TensorFlow backend, importable from here as before: it is the one
callback of every Keras backend, :class:`graddebug_keras.callbacks.GradDebugCallback`, with
the optimizer's clipping read by :func:`graddebug_keras.optimizers.keras_clip`."""

from __future__ import annotations

from graddebug_keras.callbacks import GradDebugCallback
from graddebug_keras.optimizers import keras_clip

__all__ = ["GradDebugCallback", "keras_clip"]
