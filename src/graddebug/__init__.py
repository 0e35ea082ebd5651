"""graddebug: capture, alter and diagnose gradients in PyTorch, TensorFlow/Keras and JAX.

The public API is what this module exports; everything else is internal. The subpackages are
the pipeline: ``capture`` (the Watcher) -> ``detectors`` (diagnoses) -> ``runs`` (the files on
disk) -> ``report`` (Report, load, plots, HTML) -> ``integrations`` (check, pytest, callbacks),
and ``cli``. Which of them may import which is written in ``docs/architecture.md`` and checked
by import-linter.

Example:
    >>> import graddebug
    >>> with graddebug.watch(model) as dbg:            # doctest: +SKIP
    ...     for x, y in data:
    ...         loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    ...         dbg.step()
    >>> dbg.findings()                                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graddebug._version import __version__
from graddebug.capture.layers import Intervention
from graddebug.config import Thresholds
from graddebug.errors import (
    ConfigError,
    CorruptRunError,
    EngineStepError,
    FindingError,
    GradDebugError,
    GradDebugInternalError,
    GradDebugWarning,
    GradientCountError,
    MaskShapeError,
    MissingFrameworkError,
    NoAdapterError,
    NotARunError,
    RunFileError,
    UnknownNameError,
    UnsupportedOptionError,
    WatcherStateError,
)
from graddebug.hookspecs import hookimpl
from graddebug.plugins import get_plugin_manager
from graddebug.records import Finding, Issue, Severity

if TYPE_CHECKING:
    from graddebug.capture.factory import watch
    from graddebug.capture.watcher import Watcher
    from graddebug.integrations.check import check
    from graddebug.report.load import load
    from graddebug.report.report import Report

# Imported on first use: Report, Watcher, watch and load pull in pandas, which `import graddebug`
# must not pay for, because pytest imports graddebug.integrations.pytest_plugin (and so this
# package) in every session; check, so that importing the package imports no integration.
_LAZY = ("Report", "Watcher", "check", "load", "watch")


def __getattr__(name: str) -> object:
    # Import statements, not importlib.import_module(a module's name): import-linter sees what
    # this package reaches through them only, and a module that imports graddebug reaches the
    # Watcher (the contracts in pyproject.toml say which adapter module may).
    value: object
    if name == "check":
        from graddebug.integrations.check import check as value
    elif name == "load":
        from graddebug.report.load import load as value
    elif name == "Report":
        from graddebug.report.report import Report as value
    elif name == "Watcher":
        from graddebug.capture.watcher import Watcher as value
    elif name == "watch":
        from graddebug.capture.factory import watch as value
    else:
        raise AttributeError(f"module 'graddebug' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ConfigError",
    "CorruptRunError",
    "EngineStepError",
    "Finding",
    "FindingError",
    "GradDebugError",
    "GradDebugInternalError",
    "GradDebugWarning",
    "GradientCountError",
    "Intervention",
    "Issue",
    "MaskShapeError",
    "MissingFrameworkError",
    "NoAdapterError",
    "NotARunError",
    "Report",
    "RunFileError",
    "Severity",
    "Thresholds",
    "UnknownNameError",
    "UnsupportedOptionError",
    "Watcher",
    "WatcherStateError",
    "__version__",
    "check",
    "get_plugin_manager",
    "hookimpl",
    "load",
    "watch",
]
