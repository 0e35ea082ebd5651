"""JAX adapter for graddebug: Flax NNX models, taps in plain JAX functions and optax, with the
statistics computed inside ``jax.jit``.

Users reach the adapter through ``graddebug.watch(model)``, found through the ``graddebug``
entry-point group; they import this package only for :func:`monitor`, the optax wrapper that
records parameter gradients, weights and updates.

Where things are (the file map every adapter shares):

- ``plugin``: the entry point; ``adapter``: the Adapter protocol and its capabilities.
- ``model``: an NNX model's modules and parameters by graph path, and the wrapped calls.
- ``outputs``: the ``custom_vjp`` identities on layer outputs and taps, and the token chain that
  batches a backward pass's rows into one parcel.
- ``transport``: the routes by which the parcels of a step (layer rows, the input check, the
  update's rows, the loss) reach the host together: one transfer per recorded step.
- ``recorder``: the rows, transport and chains of one adapter, the public interface that Keras
  on the JAX backend builds on.
- ``stats``: the statistics, computed on the device; ``closing``: the rows turned into records.
- ``updates``: the optimizer's view, the optax transformation :func:`monitor`, the carrier of a
  jitted step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graddebug_jax._version import __version__

if TYPE_CHECKING:
    from graddebug_jax.updates import MonitorState, monitor

__all__ = ["MonitorState", "__version__", "monitor"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the entry point (graddebug_jax.plugin) loads this package in
    # every process that uses graddebug, and must not import JAX where the user has not.
    if name in ("monitor", "MonitorState"):
        from graddebug_jax import updates

        return getattr(updates, name)
    raise AttributeError(f"module 'graddebug_jax' has no attribute {name!r}")
