"""The errors and warnings graddebug raises.

Every error a user can trigger is a :class:`GradDebugError`. Each subclass also derives from the
built-in exception a caller would expect (``TypeError``, ``ValueError``, ...), so code that
already catches those keeps working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "ConfigError",
    "CorruptRunError",
    "GradDebugError",
    "GradDebugInternalError",
    "GradDebugWarning",
    "GradientCountError",
    "MaskShapeError",
    "MissingFrameworkError",
    "NoAdapterError",
    "NotARunError",
    "RunFileError",
    "UnknownNameError",
    "WatcherStateError",
    "close_matches",
]


class GradDebugError(Exception):
    """Base class of every error graddebug raises on purpose."""


class NoAdapterError(GradDebugError, TypeError):
    """No installed adapter recognises the object given to ``watch``."""


class MissingFrameworkError(GradDebugError, ImportError):
    """A feature needs a framework or an optional package that is not installed."""


class UnknownNameError(GradDebugError, LookupError):
    """A layer or tap name given in ``layers=``, ``keep=`` or ``intervene=`` matches nothing."""

    def __str__(self) -> str:
        # LookupError subclasses such as KeyError quote their message; keep ours readable.
        return str(self.args[0]) if self.args else ""


class MaskShapeError(GradDebugError, ValueError):
    """A gradient mask does not broadcast to the gradient it is applied to."""


class GradientCountError(GradDebugError, ValueError):
    """A list of gradients does not line up with the variables it belongs to."""


class ConfigError(GradDebugError, ValueError):
    """An option or threshold has a value that cannot be used."""


class WatcherStateError(GradDebugError, RuntimeError):
    """A Watcher method was called when the Watcher is not in a state to serve it."""


class GradDebugInternalError(GradDebugError, RuntimeError):
    """A bug inside a graddebug hook, raised instead of recorded because ``strict=True``."""


class RunFileError(GradDebugError, ValueError):
    """A run on disk (``watch(log_dir=...)``, ``save``) cannot be written or read as asked."""


class NotARunError(RunFileError):
    """The path given to ``graddebug.load`` (or ``graddebug report``) holds no graddebug run."""


class CorruptRunError(RunFileError):
    """A file of a run is truncated or corrupt.

    Args:
        message: What is wrong and what could still be recovered.
        path: The damaged file.
        recoverable: What of the run is still readable, in words.
    """

    def __init__(self, message: str, *, path: str = "", recoverable: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.recoverable = recoverable


class GradDebugWarning(UserWarning):
    """Warns once about a problem inside graddebug that was recorded instead of raised."""


def close_matches(name: str, candidates: Iterable[str], limit: int = 3) -> str:
    """Return a ``" Did you mean ...?"`` suffix for ``name``, or ``""`` when nothing is close.

    Args:
        name: The name the user gave.
        candidates: The names that exist.
        limit: How many suggestions to offer at most.

    Returns:
        A sentence fragment to append to an error message.
    """
    pool = list(dict.fromkeys(candidates))
    matches = difflib.get_close_matches(name, pool, n=limit, cutoff=0.5)
    if not matches:
        # Prefix and suffix matches catch "fc" for "model.fc" that difflib scores low.
        matches = [c for c in pool if c.endswith("." + name) or c.startswith(name)][:limit]
    if not matches:
        return ""
    return " Did you mean " + ", ".join(repr(m) for m in matches) + "?"
