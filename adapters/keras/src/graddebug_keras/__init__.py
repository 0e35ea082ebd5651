"""The Keras wing of graddebug: the half of Keras support that every backend shares, and Keras 3
on the torch and JAX backends.

``graddebug.watch(model)`` finds this package through the ``graddebug`` entry-point group, and
``dbg.callback()`` is its Keras callback on every backend; users import it for the stand-alone
callback, ``graddebug_keras.GradDebugCallback``, which watches the model during each ``fit``.
The TensorFlow adapter (``graddebug_tensorflow``) watches Keras on the
TensorFlow backend and imports the shared half from here; this package never imports it.

Where things are:

- Shared by every backend (they import no framework but Keras): ``callbacks``, the one Keras
  callback (one graddebug step per training batch; the optimizer's clip passed on);
  ``model``, a model's layers by name, which layer owns each variable, and the marker of the
  functions Keras compiled; ``optimizers``, the check that an object is a Keras optimizer, how
  it clips, and the instance-level wrap of a method.
- ``plugin``: the entry point; it claims Keras layers and models whose backend is torch or JAX,
  ahead of the torch adapter (a Keras layer on torch is a ``torch.nn.Module`` too).
- ``torch_backend``: the torch backend, :class:`graddebug_torch.adapter.TorchAdapter` reading
  the model through a Keras index (:class:`graddebug_torch.model.ModelIndex`).
- ``jax_backend``: the JAX backend, on :mod:`graddebug_jax`'s public recorder.
"""

from __future__ import annotations

from typing import Any

from graddebug_keras._version import __version__

__all__ = ["GradDebugCallback", "__version__"]


def __getattr__(name: str) -> Any:
    """``GradDebugCallback``, the stand-alone Keras callback, imported (with Keras) when first
    asked for."""
    if name == "GradDebugCallback":
        from graddebug_keras.callbacks import GradDebugCallback

        return GradDebugCallback
    raise AttributeError(f"module 'graddebug_keras' has no attribute {name!r}")
