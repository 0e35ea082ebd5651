"""What a run's JSON file says about it: framework, versions, model class, options, host."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from graddebug.adapter import Distribution, WatchOptions

__all__ = ["run_metadata"]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _describe(value: Any) -> Any:
    """A JSON-friendly account of an option value (tensors and callables by their type)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()  # numpy scalars (every=np.int64(5)) are stored as numbers
    if isinstance(value, type):
        return _qualname(value)
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [_describe(v) for v in items]
    if callable(value) and not hasattr(value, "shape"):
        return f"<callable {getattr(value, '__qualname__', type(value).__name__)}>"
    return f"<{_qualname(type(value))}>"


def run_metadata(*, adapter: str | None, model: Any, options: WatchOptions,
                 settings: Mapping[str, Any], started: str,
                 distribution: Distribution) -> dict[str, Any]:
    """Describe a run for its JSON file: framework and versions, model class, options, start
    time, host, and the rank among the run's processes.

    Args:
        adapter: The adapter's name (``"torch"``), None before one was chosen.
        model: The watched model, or None.
        options: The validated ``watch`` options.
        settings: Further options of the Watcher (``every``, ``strict``, ...).
        started: When the ``with`` block was first entered (see :func:`now`).
        distribution: This process's rank, the world size and the backend.

    Returns:
        A dict of JSON values.
    """
    module = sys.modules.get(adapter) if adapter else None
    interventions = {
        name: {k: v for k, v in vars(spec).items() if v is not None}
        for name, spec in options.intervene.items()
    }
    return {
        "framework": adapter,
        "framework_version": getattr(module, "__version__", None) or (
            _version(adapter) if adapter else None),
        "adapter_version": _version(f"graddebug-{adapter}") if adapter else None,
        "graddebug_version": _version("graddebug"),
        "python": platform.python_version(),
        "model": _qualname(type(model)) if model is not None else None,
        "options": _describe({
            "layers": options.layers,
            "keep": options.keep,
            "intervene": interventions,
            "outputs": options.outputs,
            "param_stats": options.param_stats,
            "optimizer": type(options.optimizer) if options.optimizer is not None else None,
            "scaler": type(options.scaler) if options.scaler is not None else None,
            "ops": options.ops,
            "escalate": options.escalate,
            "full_stats_every": options.full_stats_every,
            "op_sites": sorted(options.op_sites),
            **settings,
        }),
        "started": started,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": distribution.rank,
        "world_size": distribution.world_size,
        "processes": distribution.writers,
        "backend": distribution.backend,
    }
