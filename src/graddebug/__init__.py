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
from graddebug.report import Report
from graddebug.session import Watcher, watch

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
    "get_plugin_manager",
    "hookimpl",
    "watch",
]
