"""Source files as findings show them, for the ``source`` column of op-level findings."""

from __future__ import annotations

import functools
import os

__all__ = ["display_path"]


@functools.cache
def display_path(filename: str) -> str:
    """``filename`` relative to the working directory when it lies under it, else as given."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if relative.startswith(os.pardir) else relative
