"""The method of the overhead benchmarks (``benchmarks/ratios.py``): the alternation of the
pairs of single steps, the ratio over the pairs, the ratio of rounds where only some steps are
recorded, the ratio of ``fit`` rounds, the bootstrap interval quoted next to each, the verdict
against a target, and the allocator settings both twins run under."""

from __future__ import annotations

import platform
import random
import statistics
import subprocess
import sys

import pytest

from benchmark_scripts import BENCHMARKS, loaded


@pytest.fixture(scope="module")
def ratios():
    with loaded("ratios") as module:
        yield module


def test_position_ratio_keeps_the_recorded_step_a_median_would_hide(ratios):
    # Ten steps a round: the first one recorded (30 ms instead of 10), the rest plain.
    plain = [[10.0] * 10 for _ in range(5)]
    watched = [[30.0] + [10.0] * 9 for _ in range(5)]
    watched[2][4] = 500.0  # a burst of load from elsewhere in one round
    assert ratios.position_ratio(watched, plain) == pytest.approx(120 / 100)


def test_position_ratio_takes_each_position_s_median_pair_ratio(ratios):
    # Three rounds of three pairs; the first position is the recorded step.
    watched = [[30.0, 11.0, 10.0], [33.0, 10.0, 12.0], [90.0, 20.0, 20.0]]
    plain = [[10.0, 10.0, 10.0], [10.0, 10.0, 10.0], [30.0, 20.0, 10.0]]
    # Pair ratios by position: (3.0, 3.3, 3.0), (1.1, 1.0, 1.0), (1.0, 1.2, 2.0).
    assert ratios.position_ratio(watched, plain) == pytest.approx((3.0 + 1.0 + 1.2) / 3)


def test_the_interval_of_identical_rounds_is_their_ratio(ratios):
    values = [1.07] * 9

    def estimate(picked):
        return statistics.median(values[i] for i in picked)

    assert ratios.bootstrap_interval(estimate, len(values)) == (1.07, 1.07)


def test_the_interval_holds_the_median_and_narrows_with_more_rounds(ratios):
    rng = random.Random(1)
    widths = []
    for rounds in (10, 160):
        values = [rng.gauss(1.10, 0.05) for _ in range(rounds)]

        def estimate(picked, values=values):
            return statistics.median(values[i] for i in picked)

        low, high = ratios.bootstrap_interval(estimate, rounds)
        assert low <= statistics.median(values) <= high
        assert low < high
        widths.append(high - low)
    # The median's spread falls as one over the square root of the rounds: 4x for 16x.
    assert widths[1] < widths[0] / 2
    assert ratios.bootstrap_interval(estimate, 160, seed=3) != (low, high)  # seeded, not fixed


def test_the_ratio_is_the_median_over_every_pair_of_the_picked_rounds(ratios):
    # Pair ratios: round 0 gives 1.1, 1.1, 1.3; round 1 gives 1.2, 1.1, 1.2.
    plain = [[10.0, 20.0, 10.0], [10.0, 40.0, 40.0]]
    watched = [[11.0, 22.0, 13.0], [12.0, 44.0, 48.0]]
    estimate = ratios.pairs_estimator(watched, plain)
    assert estimate([0, 1]) == pytest.approx((1.1 + 1.2) / 2)
    assert estimate([0, 0]) == pytest.approx(1.1)
    # Not the ratio of the round's medians (44 / 40), which pairs the steps apart.
    assert estimate([1]) == pytest.approx(1.2)


def test_with_every_the_estimator_keeps_each_position(ratios):
    plain = [[10.0, 10.0], [10.0, 10.0], [10.0, 10.0]]
    watched = [[30.0, 10.0], [20.0, 11.0], [40.0, 10.0]]
    # Position medians: 3.0 (of 3.0, 2.0, 4.0) and 1.0 (of 1.0, 1.1, 1.0).
    assert ratios.pairs_estimator(watched, plain, every=2)([0, 1, 2]) == pytest.approx(2.0)
    assert ratios.pairs_estimator(watched, plain, every=1)([0, 1, 2]) == pytest.approx(
        statistics.median([3.0, 1.0, 2.0, 1.1, 4.0, 1.0]))


def test_fit_rounds_take_the_median_of_their_own_ratios(ratios):
    estimate = ratios.rounds_estimator([1.2, 1.0, 1.1, 5.0])
    assert estimate([0, 1, 2, 3]) == pytest.approx(1.15)
    assert estimate([3, 3, 0]) == pytest.approx(5.0)


def test_pairs_of_unequal_length_are_refused(ratios):
    with pytest.raises(ValueError):
        ratios.pair_ratios([1.0, 2.0], [1.0])


def test_an_interval_needs_a_round(ratios):
    with pytest.raises(ValueError, match="at least one round"):
        ratios.bootstrap_interval(lambda picked: 1.0, 0)


@pytest.mark.parametrize(("low", "high", "expected"), [
    (1.10, 1.14, "pass"),
    (1.10, 1.15, "pass"),      # the target itself is met
    (1.14, 1.16, "within noise"),
    (1.15, 1.20, "within noise"),
    (1.151, 1.20, "FAIL"),
])
def test_the_verdict_reads_the_whole_interval(ratios, low, high, expected):
    assert ratios.verdict(low, high, 1.15) == expected


def test_quartiles(ratios):
    assert ratios.quartiles([2.0]) == (2.0, 2.0)
    assert ratios.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)
    with pytest.raises(ValueError):
        ratios.quartiles([])


def test_pairs_alternate_single_steps_and_flip_their_order(ratios):
    log: list[str] = []

    def side(name: str, seconds: float):
        def run() -> float:
            log.append(name)
            return seconds
        return run

    plain, watched = ratios.alternate(side("plain", 1.0), side("watched", 2.0), 3,
                                      watched_first=True)
    assert log == ["watched", "plain", "plain", "watched", "watched", "plain"]
    assert plain == [1.0] * 3 and watched == [2.0] * 3
    log.clear()
    ratios.alternate(side("plain", 1.0), side("watched", 2.0), 2, watched_first=False)
    assert log == ["plain", "watched", "watched", "plain"]


# The allocator is the process's own: its tests run in fresh child processes.
_MALLOC_PROBE = r"""
import ctypes, sys
sys.path.insert(0, sys.argv[1])
import ratios

libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped(size):  # bytes glibc mapped apart from its heap for one block of size
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    during = libc.mallinfo2().hblkhd
    libc.free(block)
    return during - before

def left_free(size):  # free bytes the heap holds once a block of size came and went
    libc.free(libc.malloc(size))
    return libc.mallinfo2().fordblks

if sys.argv[2] == "steady":
    print(int(ratios.steady_allocator()))
print(mapped(8 << 20), left_free(24 << 20), mapped(ratios.STEADY_HEAP_BYTES + (1 << 20)))
"""


def _probe_malloc(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, str(BENCHMARKS), mode],
                          capture_output=True, text=True, timeout=60, check=True)
    return [int(v) for v in done.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="steady_allocator sets glibc's thresholds; this C library is not glibc")
def test_steady_allocator_serves_large_blocks_from_a_heap_it_never_trims():
    small, large = 8 << 20, 24 << 20
    # glibc left alone, in a fresh process: both blocks are mapped apart and unmapped when
    # freed, so the heap never holds their bytes.
    mapped, left_free, beyond = _probe_malloc("default")
    assert mapped >= small
    assert left_free < large
    applied, mapped, left_free, beyond = _probe_malloc("steady")
    assert applied == 1
    assert mapped == 0  # from the heap
    assert left_free >= large  # which kept the block's bytes after the free
    assert beyond >= (32 << 20) + (1 << 20)  # past the fixed threshold: mapped apart again


def test_steady_allocator_leaves_other_c_libraries_alone(ratios, monkeypatch):
    monkeypatch.setattr(ratios.sys, "platform", "darwin")
    assert ratios._glibc() is None
    assert ratios.steady_allocator() is False
