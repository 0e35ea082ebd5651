"""graddebug: capture, alter and diagnose gradients in PyTorch and TensorFlow/Keras.

The public API is what this module exports; everything else is internal.

Example:
    >>> import graddebug
    >>> with graddebug.watch(model) as dbg:            # doctest: +SKIP
    ...     for x, y in data:
    ...         loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    ...         dbg.step()
    >>> dbg.findings()                                  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from graddebug.check import check
from graddebug.config import Thresholds
from graddebug.errors import (
    ConfigError,
    GradDebugError,
    GradDebugInternalError,
    GradDebugWarning,
    GradientCountError,
    MaskShapeError,
    MissingFrameworkError,
    NoAdapterError,
    UnknownNameError,
    WatcherStateError,
)
from graddebug.hookspecs import hookimpl
from graddebug.interventions import Intervention
from graddebug.plugins import get_plugin_manager
from graddebug.records import Finding, Issue, Severity

if TYPE_CHECKING:
    from graddebug.report import Report
    from graddebug.runload import load
    from graddebug.session import Watcher, watch

# Imported on first use: these pull in pandas, which `import graddebug` must not pay for,
# because pytest imports graddebug.pytest_plugin (and so this package) in every session.
_LAZY: dict[str, str] = {
    "Report": "graddebug.report",
    "Watcher": "graddebug.session",
    "load": "graddebug.runload",
    "watch": "graddebug.session",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graddebug' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Finding",
    "GradDebugError",
    "GradDebugInternalError",
    "GradDebugWarning",
    "GradientCountError",
    "Intervention",
    "Issue",
    "MaskShapeError",
    "MissingFrameworkError",
    "NoAdapterError",
    "Report",
    "Severity",
    "Thresholds",
    "UnknownNameError",
    "Watcher",
    "WatcherStateError",
    "__version__",
    "check",
    "get_plugin_manager",
    "hookimpl",
    "load",
    "watch",
]
