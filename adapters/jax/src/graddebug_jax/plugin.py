"""The ``graddebug`` entry point of the JAX adapter. Imports JAX only once the user has."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from graddebug.hookspecs import hookimpl

if TYPE_CHECKING:
    from graddebug.adapter import AdapterFactory


@hookimpl
def graddebug_adapter(target: object) -> AdapterFactory | None:
    """Claim Flax NNX modules and JAX arrays (tracers included), when JAX is imported."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    claimed: tuple[type, ...] = (jax.Array,)
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and hasattr(nnx, "Module"):
        claimed += (nnx.Module,)
    if not isinstance(target, claimed):
        return None
    from graddebug_jax.adapter import JaxAdapter

    return JaxAdapter
