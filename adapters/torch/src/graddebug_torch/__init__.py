"""PyTorch adapter for graddebug: module hooks, tensor taps and device-side statistics.

Users do not import this package: ``graddebug.watch(model)`` finds it through the
``graddebug`` entry-point group.
"""

from __future__ import annotations

__all__: list[str] = []
