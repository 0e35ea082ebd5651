"""The strided samples adapters read weight and update norms through (graddebug.sampling)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from graddebug.sampling import prime_from, row_lengths, sample_stride


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 24, 90, 97, 1000, 7919])
def test_prime_from_is_the_smallest_prime_at_least_n(n):
    p = prime_from(n)
    assert _is_prime(p) and p >= n
    assert not any(_is_prime(q) for q in range(max(n, 2), p))


@pytest.mark.parametrize(("shape", "rows"), [
    ((3, 4, 5), [5, 20]), ((64,), []), ((1, 64, 1, 8), [8, 512]), ((512, 512), [512]),
    ((3, 3, 16, 32), [32, 512, 1536]), ((), []),
])
def test_row_lengths_are_the_products_of_the_innermost_sizes(shape, rows):
    assert row_lengths(shape) == rows


@pytest.mark.parametrize(("shape", "k"), [
    ((512, 512), 1024), ((4096,), 1024), ((3, 3, 64, 128), 1024), ((1000, 7), 100),
    ((64, 64), 1024), ((2, 1031), 10),
])
def test_the_stride_is_a_prime_that_takes_at_most_k_entries_across_the_columns(shape, k):
    numel = math.prod(shape)
    stride = sample_stride(numel, k, row_lengths(shape))
    assert _is_prime(stride)
    assert -(-numel // stride) <= k
    assert all(r % stride for r in row_lengths(shape))
    # across the columns: the sample meets many of the last axis' entries, not one
    columns = np.unique(np.arange(numel)[::stride] % shape[-1])
    assert len(columns) >= min(shape[-1], -(-numel // stride)) // 2


def test_a_tensor_within_k_entries_is_taken_whole():
    assert sample_stride(1024, 1024, [32]) == 1
    assert sample_stride(10, 1024, []) == 1


def test_a_sample_needs_an_entry():
    with pytest.raises(ValueError, match="at least one entry"):
        sample_stride(100, 0, [])
