"""The strided samples through which adapters may estimate a parameter's weight and update
norms (:class:`graddebug.records.Record`'s ``weight_norm`` and ``update_norm``).

A tensor of ``numel`` entries is read at every ``stride``-th entry of its memory order, and the
sum of squares of the sample, times ``numel / len(sample)``, estimates the whole one's. The
stride is a prime that divides none of the tensor's row lengths (the products of its innermost
sizes), so that the sample walks across the columns of a matrix rather than down one of them:
a dead unit's column, or a column a mask keeps at zero, then weighs in the estimate as much as
it does in the tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

__all__ = ["prime_from", "row_lengths", "sample_stride"]


@functools.lru_cache(maxsize=4096)
def prime_from(n: int) -> int:
    """The smallest prime that is at least ``n`` (2 for ``n < 2``)."""
    candidate = max(n, 2)
    while any(candidate % d == 0 for d in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


def row_lengths(shape: Sequence[int]) -> list[int]:
    """The row lengths of a row-major tensor of ``shape``: the products of its innermost sizes,
    innermost first, leaving out axes of size 1 and the whole tensor."""
    rows, length = [], 1
    for size in reversed(shape[1:]):
        if size == 1:
            continue
        length *= size
        rows.append(length)
    return rows


def sample_stride(numel: int, k: int, rows: Sequence[int]) -> int:
    """A prime stride that takes at most ``k`` of ``numel`` entries and divides none of the
    row lengths ``rows``; 1 (every entry) where ``k >= numel``.

    Raises:
        ValueError: ``k`` is not positive.
    """
    if k < 1:
        raise ValueError(f"a sample needs at least one entry, got k={k}")
    if k >= numel:
        return 1
    stride = prime_from(-(-numel // k))
    while any(r % stride == 0 for r in rows):
        stride = prime_from(stride + 1)
    return stride
