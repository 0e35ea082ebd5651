"""Op sites: the ops that op-level capture checks, named by type and by the user's source line.

An event about an op names it as ``<op type>@<file:line>``, the line being the innermost frame
of the op's creation traceback (``op.traceback``) that is the user's code rather than
TensorFlow's, Keras', graddebug's or the standard library's.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from graddebug.capture.layers import LayerSpec, display_path

__all__ = ["Site", "user_source"]

# This adapter's own frames are library frames: the folder graddebug_tensorflow is in.
_ADAPTER_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """The folders whose files are library code, each ending in a separator."""
    dirs = [os.path.dirname(tf.__file__), os.path.dirname(keras.__file__), _ADAPTER_ROOT,
            sysconfig.get_paths()["stdlib"]]
    # The core's folder, found without importing it: this module needs no path to the Watcher.
    spec = importlib.util.find_spec("graddebug")
    if spec is not None and spec.origin:
        dirs.append(os.path.dirname(spec.origin))
    # Keras 3 keeps part of its TF code in tf_keras or keras.src; TF in tensorflow.python.
    for name in ("tf_keras", "absl"):
        try:
            module = __import__(name)
            dirs.append(os.path.dirname(module.__file__ or ""))
        except ImportError:
            pass
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


@functools.cache
def _is_library(filename: str) -> bool:
    """Whether a traceback's file is TensorFlow's, Keras', graddebug's or Python's own."""
    return filename.startswith("<") or os.path.realpath(filename).startswith(_library_dirs())


def user_source(op: Any) -> str:
    """``file:line`` of the innermost frame of ``op``'s creation traceback that is the user's
    code (not TensorFlow's, Keras', graddebug's or the standard library's); empty if none."""
    for frame in reversed(list(getattr(op, "traceback", None) or ())):
        if not _is_library(frame.filename):
            return f"{display_path(frame.filename)}:{frame.lineno}"
    return ""


@dataclass(eq=False, slots=True)
class Site:
    """One op whose outputs are checked, and what its events carry.

    Attributes:
        spec: The watched layer whose ``call`` created it (for a gradient op, the forward
            op's).
        op_type: The op's type (``Log``).
        op_name: The op's name in the graph.
        source: ``file:line`` of the user's code that created it.
        codes: Indices of its outputs' codes (none for an output left unchecked, or not
            checked yet: see :mod:`.capture`'s ``_CHAINED``).
        inputs: Indices of the codes of the floating inputs it read.
        forward: For a gradient op, the forward op it differentiates.
    """

    spec: LayerSpec
    op_type: str
    op_name: str
    source: str
    codes: tuple[int, ...]
    inputs: tuple[int, ...] = ()
    forward: Site | None = None

    @property
    def tensor(self) -> str:
        """The ``tensor`` of its events: ``<op type>@<file:line>``."""
        return f"{self.op_type}@{self.source}" if self.source else self.op_type

    def describe(self) -> str:
        """``Log 'model/layer/Log' (file.py:12)``, for event details."""
        where = f" ({self.source})" if self.source else ""
        return f"{self.op_type} {self.op_name!r}{where}"
