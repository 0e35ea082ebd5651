"""The one sampling plan through which every adapter reads weight and update norms
(graddebug.sampling): the budget, the cap and the floor, the prime stride across the columns,
and the estimate against numpy on the planned indices."""

from __future__ import annotations

import math

import numpy as np
import pytest

from graddebug.sampling import (
    BUDGET,
    FLOOR,
    MOST,
    Sample,
    plan,
    prime_from,
    row_lengths,
    sample_stride,
)


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


def test_the_plan_fills_the_budget_small_tensors_first_up_to_the_cap():
    # A 16 x 512 MLP: the biases whole, the weights at the cap (0.5% of 262,656 is over 1024).
    shapes = [(512, 512), (512,)] * 16
    at_cap = sample_stride(512 * 512, MOST, [512])
    assert [s.stride for s in plan(shapes, budget=0.01)] == [at_cap, 1] * 16
    assert MOST // 2 < -(-512 * 512 // at_cap) <= MOST
    # A budget below the cap: the level where it runs out, the tensors below it whole.
    samples = plan([(1000, 100), (200, 100), (300,), (40,)], budget=0.01)
    counts = [s.count for s in samples]
    assert sum(counts) <= 0.01 * 120_340 and counts[2:] == [300, 40]
    assert samples[2].whole and samples[3].whole
    # equal shares: the same level, each strided to at most it
    assert 300 < min(counts[:2]) <= max(counts[:2]) <= (1204 - 340) // 2


def test_the_budget_is_the_fraction_read_above_the_floor():
    shapes = [(400, 256), (256,), (256, 10), (10,), (3, 3, 64, 128), (128,), (1,)]
    total = sum(math.prod(s) for s in shapes)
    samples = plan(shapes)
    assert sum(s.count for s in samples) <= BUDGET * total + FLOOR * len(shapes)
    # the budget's level is about 190 entries, below the floor: the tensors of at most FLOOR
    # entries whole, the others strided to at most FLOOR
    assert [s.whole for s in samples] == [False, True, False, True, False, True, True]
    assert all(s.count <= FLOOR for s in samples)


def test_every_tensor_gets_the_floor_or_its_whole_however_small_the_budget():
    # 0.5% of 10 x 2000 entries is 100: the floor gives each up to 256 entries all the same.
    samples = plan([(40, 50)] * 10 + [(5,)])
    assert [s.count for s in samples] == [-(-2000 // s.stride) for s in samples[:10]] + [5]
    assert all(FLOOR // 2 < s.count <= FLOOR for s in samples[:10])
    assert plan([(10,)]) == [Sample(10, 1)]
    assert plan([(0,), ()]) == [Sample(0, 1), Sample(1, 1)]
    assert plan([(0,)])[0].count == 0 and math.isnan(plan([(0,)])[0].scale)


def test_a_sample_reads_every_stride_th_entry_from_the_first():
    sample = plan([(64, 64)])[0]
    assert sample.stride > 1 and sample.count == len(range(0, 4096, sample.stride))
    np.testing.assert_array_equal(sample.indices(), np.arange(0, 4096, sample.stride))
    assert sample.scale == pytest.approx(math.sqrt(4096 / sample.count))
    # the prime stride of sample_stride, for the level the plan gives it
    assert sample.stride == sample_stride(4096, FLOOR, row_lengths((64, 64)))


@pytest.mark.parametrize("shape", [(512, 512), (3, 3, 64, 128), (1000, 7), (64, 64), (4096,)])
def test_the_estimate_on_the_planned_indices_is_close_to_the_norm(shape):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(shape)
    update = 1e-3 * rng.standard_normal(shape) * np.linspace(0.5, 2.0, shape[-1])
    sample = plan([shape], budget=0.01)[0]
    for array in (weights, update):
        part = array.reshape(-1)[sample.indices()]
        estimate = np.linalg.norm(part) * sample.scale
        # the estimator is the sample's norm scaled: here by hand, against numpy's norm
        assert estimate == pytest.approx(
            math.sqrt(float(np.sum(part ** 2)) * array.size / len(part)), rel=1e-12)
        assert estimate == pytest.approx(np.linalg.norm(array), rel=4 / math.sqrt(sample.count))
