"""The one sampling plan through which every adapter estimates a parameter's weight and update
norms (:class:`graddebug.records.Record`'s ``weight_norm`` and ``update_norm``).

:func:`plan` gives each of the watched tensors its :class:`Sample`: how many entries are read
and where. The :data:`BUDGET` is shared as water fills a basin: each tensor gets
``min(numel, level)`` for the highest level, at most :data:`MOST`, that the budget reaches, so
that small tensors are taken whole and the others share what is left equally (every sampled
estimate then has about the same relative error, ``1 / sqrt(2 k)`` for Gaussian-like entries);
the level is never below :data:`FLOOR`, so that no tensor goes without a sample.

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
from dataclasses import dataclass

import numpy as np

__all__ = ["BUDGET", "FLOOR", "MOST", "Sample", "plan", "prime_from", "row_lengths",
           "sample_stride"]

BUDGET = 0.005
"""The fraction of the watched tensors' entries that the samples read, at most, where the level
it reaches is above the :data:`FLOOR`. The torch adapter holds a parameter's sample in two
copies (before and after the optimizer's step), so its buffers hold at most 1% of the
parameters' entries there."""

MOST = 1024
"""The most entries read from one tensor, which bounds the pages a copy touches in a large
one. On a 512-wide MLP whose budget gives its 512 x 512 weights 598 entries each, the
estimates of their updates were off by 3.1% root mean square over 576 steps of SGD, momentum,
Adam and AdamW (11% at worst), and of their weights by 2.9%."""

FLOOR = 256
"""The level below which no tensor is read, the budget notwithstanding: a tensor of fewer
entries is read whole, a larger one at a stride that takes at most this many. So a small
model, whose budget would give each tensor a handful of entries, has no parameter without its
norms, and none estimated from too few: the relative error of an estimate from ``k`` entries is
about ``1 / sqrt(2 k)`` for Gaussian-like entries (4.4% at 256; 12% at 32, which made the
weight norm of a kernel of 4,096 entries 23% off in a test), and a sample of a few entries that
all happen to be zero would show a moving tensor as still."""


@dataclass(frozen=True, slots=True)
class Sample:
    """The entries of one tensor that are read: every ``stride``-th of its memory order, from
    the first.

    Attributes:
        numel: The tensor's number of entries.
        stride: The stride between the entries read (1: all of them, the norms are exact).
    """

    numel: int
    stride: int

    @property
    def count(self) -> int:
        """How many entries are read (0 for an empty tensor)."""
        return -(-self.numel // self.stride)

    @property
    def whole(self) -> bool:
        """Whether every entry is read."""
        return self.stride == 1

    @property
    def scale(self) -> float:
        """``sqrt(numel / count)``: what turns the sample's norm into the tensor's estimate
        (NaN for an empty tensor)."""
        return math.sqrt(self.numel / self.count) if self.count else math.nan

    def indices(self) -> np.ndarray:
        """The flat indices read, in memory order: ``range(0, numel, stride)``."""
        return np.arange(0, self.numel, self.stride, dtype=np.int64)


def plan(shapes: Sequence[Sequence[int]], budget: float = BUDGET, most: int = MOST,
         floor: int = FLOOR) -> list[Sample]:
    """The samples of the watched tensors of ``shapes``, each given in memory order (outermost
    axis first).

    Args:
        shapes: Every watched tensor's shape: the plan shares the budget among them all, so
            the same tensors give the same samples in every framework.
        budget: The fraction of all entries read, before the floor.
        most: The most entries read from one tensor.
        floor: The lowest level: a tensor of more entries is read at a stride that takes at
            most this many, and one of fewer whole.

    Returns:
        One :class:`Sample` per shape, in order.
    """
    numels = [math.prod(int(size) for size in shape) for shape in shapes]
    level = max(_level(sorted(numels), int(sum(numels) * budget), most), floor)
    samples = []
    for shape, numel in zip(shapes, numels, strict=True):
        k = min(numel, level)
        stride = sample_stride(numel, k, row_lengths(shape)) if numel else 1
        samples.append(Sample(numel, stride))
    return samples


def _level(ascending: Sequence[int], budget: int, most: int) -> int:
    """The highest ``c <= most`` with ``sum(min(n, c)) <= budget`` over ``ascending``."""
    whole = 0  # the entries of the tensors below the level, taken whole
    for j, n in enumerate(ascending):
        level = (budget - whole) // (len(ascending) - j)
        if level < n:
            return min(level, most)
        whole += n
    return most


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
