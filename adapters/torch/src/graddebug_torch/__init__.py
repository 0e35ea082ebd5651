"""PyTorch adapter for graddebug: module hooks, tensor taps and device-side statistics.

Users do not import this package: ``graddebug.watch(model)`` finds it through the
``graddebug`` entry-point group.
"""

from __future__ import annotations

from graddebug_torch._version import __version__

__all__ = ["__version__"]
