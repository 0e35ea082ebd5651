"""Full gradients kept by ``keep=``: the last few steps only, with a warning once they grow large.

A kept gradient is a numpy copy as large as the tensor it comes from, once per recorded step: a
small layer of a small model already adds about 256 KB a step. Keeping every step would grow
without bound over a long run, so only the last ``keep_steps`` recorded steps are held (older
ones are dropped as new ones arrive), and one warning says when what is held passes
:data:`KEEP_WARN_BYTES`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from graddebug.errors import ConfigError

__all__ = ["KEEP_STEPS", "KEEP_WARN_BYTES", "KeptGradients", "check_keep_steps"]

KEEP_STEPS = 10
"""Recorded steps whose kept gradients are held by default (``watch(keep_steps=...)``)."""
KEEP_WARN_BYTES = 1 << 30
"""Held kept gradients past this many bytes (1 GiB) warn once."""

Warn = Callable[[str, str], None]


def check_keep_steps(keep_steps: object) -> int | None:
    """Check ``watch(keep_steps=...)``: a positive int, or None to keep every step.

    Raises:
        ConfigError: Any other value.
    """
    if keep_steps is None:
        return None
    if isinstance(keep_steps, bool) or not isinstance(keep_steps, numbers.Integral) \
            or int(keep_steps) < 1:
        raise ConfigError(
            f"keep_steps={keep_steps!r} must be a positive int (how many recorded steps of "
            "keep= gradients to hold), or None to hold every step."
        )
    return int(keep_steps)


class KeptGradients(Mapping[int, dict[str, np.ndarray]]):
    """Kept gradients by step, holding the last ``limit`` steps.

    Args:
        limit: How many steps to hold; None for every step.
        warn: Called as ``warn(key, message)`` (once per key and Watcher) when the held arrays
            pass :data:`KEEP_WARN_BYTES`.
    """

    def __init__(self, limit: int | None, warn: Warn) -> None:
        self.limit = limit
        self._warn = warn
        self._steps: dict[int, dict[str, np.ndarray]] = {}
        self._bytes: dict[int, int] = {}
        self.dropped = 0
        """How many steps were dropped to stay within ``limit``."""

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held now."""
        return sum(self._bytes.values())

    def add(self, step: int, arrays: dict[str, np.ndarray]) -> None:
        """Hold the arrays of ``step``; drop the oldest step beyond the limit."""
        self._steps[step] = arrays
        self._bytes[step] = sum(a.nbytes for a in arrays.values())
        while self.limit is not None and len(self._steps) > self.limit:
            oldest = next(iter(self._steps))
            del self._steps[oldest], self._bytes[oldest]
            self.dropped += 1
        held = self.nbytes
        if held > KEEP_WARN_BYTES:
            self._warn("keep-size", (
                f"graddebug: gradients kept by keep= now hold {held / 2**30:.1f} GiB "
                f"({len(self._steps)} steps). Pass a smaller keep_steps= (default "
                f"{KEEP_STEPS}), fewer keep= names, or every= to record fewer steps."
            ))

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self._steps[step]

    def __iter__(self) -> Iterator[int]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)
