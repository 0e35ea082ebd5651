"""Keras 3 on the torch and JAX backends for graddebug. (Keras on the TensorFlow backend is
``graddebug_tensorflow``'s.)

Users do not import this package: ``graddebug.watch(model)`` finds it through the
``graddebug`` entry-point group, and ``dbg.callback()`` is a Keras callback on every backend.

Where things are:

- ``plugin``: the entry point; it claims Keras layers and models whose backend is torch or JAX,
  ahead of the torch adapter (a Keras layer on torch is a ``torch.nn.Module`` too).
- ``layers``: a Keras model's layers by name, and which layer owns each variable.
- ``callback``: the Keras callback (one graddebug step per training batch); ``optimizers``:
  the wrap of a Keras optimizer's methods.
- ``torch_backend``: the torch backend, on :class:`graddebug_torch.adapter.TorchAdapter`'s hooks.
- ``jax_backend``: the JAX backend, on :mod:`graddebug_jax`'s ``custom_vjp`` identities and rows.
"""

from __future__ import annotations

from graddebug_keras._version import __version__

__all__ = ["__version__"]
