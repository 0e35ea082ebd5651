"""The errors and warnings graddebug raises.

Every error a user can trigger is a :class:`GradDebugError`. Each subclass also derives from the
built-in exception a caller would expect (``TypeError``, ``ValueError``, ...), so code that
already catches those keeps working.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "AdapterContractError",
    "ConfigError",
    "CorruptRunError",
    "EngineStepError",
    "FindingError",
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
    "UnsupportedOptionError",
    "WatcherStateError",
    "close_matches",
    "printable",
]

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Characters a terminal acts on instead of showing: C0 and C1 controls (ESC starts ANSI and OSC
sequences: a cleared screen, a new window title, a hyperlink), DEL, and the bidirectional
overrides that make text read differently from how it is stored. Tab and newline stay."""


def printable(text: str) -> str:
    """Return ``text`` with every control character written as a visible escape.

    Layer names, tap names, model class names and run metadata are user strings (or come from a
    run directory someone else wrote), and graddebug prints them to terminals: ``"\\x1b[2J"``
    in a layer name would clear the screen. Each such character becomes ``\\xNN`` or
    ``\\uNNNN``, so the name stays recognisable and nothing is executed. Tab and newline are
    kept.

    Args:
        text: Any string.

    Returns:
        The string, safe to print.
    """
    return _CONTROL.sub(lambda m: (f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100
                                   else f"\\u{ord(m[0]):04x}"), text)


class GradDebugError(Exception):
    """Base class of every error graddebug raises on purpose.

    Its text never holds a control character (see :func:`printable`): messages quote user
    strings, and tracebacks go to terminals.
    """

    def __str__(self) -> str:
        return printable(super().__str__())


class NoAdapterError(GradDebugError, TypeError):
    """No installed adapter recognises the object given to ``watch``."""


class MissingFrameworkError(GradDebugError, ImportError):
    """A feature needs a framework or an optional package that is not installed."""


class UnknownNameError(GradDebugError, LookupError):
    """A layer or tap name given in ``layers=``, ``keep=`` or ``intervene=`` matches nothing."""

    def __str__(self) -> str:
        # LookupError subclasses such as KeyError quote their message; keep ours readable.
        return printable(str(self.args[0])) if self.args else ""


class MaskShapeError(GradDebugError, ValueError):
    """A gradient mask does not broadcast to the gradient it is applied to."""


class GradientCountError(GradDebugError, ValueError):
    """A list of gradients does not line up with the variables it belongs to."""


class ConfigError(GradDebugError, ValueError):
    """An option or threshold has a value that cannot be used."""


class UnsupportedOptionError(ConfigError):
    """A ``watch`` option was set that the adapter chosen for the model does not honour (its
    ``watch_options`` declaration); the message names the adapter and what to use instead."""


class AdapterContractError(GradDebugError, TypeError):
    """An adapter class declares a capability it does not implement, implements one it does
    not declare, or implements a method with a signature the protocol cannot call."""


class WatcherStateError(GradDebugError, RuntimeError):
    """A Watcher method was called when the Watcher is not in a state to serve it."""


class EngineStepError(WatcherStateError):
    """``dbg.step()`` was called on a Watcher whose steps a training engine closes itself (a
    DeepSpeed engine given to ``watch``: each optimizer update of the engine is a step)."""


class FindingError(GradDebugError, RuntimeError):
    """``dbg.step()`` found an issue named in ``watch(raise_on=...)``: training stops at the
    step where it first appears, as ``torch.autograd.detect_anomaly`` stops at a NaN.

    Args:
        message: The first finding's message, with its step, layer and issue.
        findings: The findings that raised it, as rows of ``dbg.findings()``.

    Attributes:
        findings: The findings that raised it (a DataFrame with the columns of
            ``dbg.findings()``; None once the error was pickled, which keeps the message).
    """

    def __init__(self, message: str, findings: pd.DataFrame | None = None) -> None:
        super().__init__(message)
        self.findings = findings


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
    """Warns once about a problem inside graddebug that was recorded instead of raised.

    Its text never holds a control character (see :func:`printable`): ``warnings`` prints
    ``str()`` of it to stderr.
    """

    def __str__(self) -> str:
        return printable(super().__str__())


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
