"""The estimators of ``benchmarks/overhead_torch.py``: the ratio of rounds where only some
steps are recorded, and the bootstrap interval quoted next to each ratio."""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead_torch.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("overhead_torch_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_position_ratio_keeps_the_recorded_step_a_median_would_hide(bench):
    # Ten steps a round: the first one recorded (30 ms instead of 10), the rest plain.
    plain = [[10.0] * 10 for _ in range(5)]
    watched = [[30.0] + [10.0] * 9 for _ in range(5)]
    watched[2][4] = 500.0  # a burst of load from elsewhere in one round
    assert bench.position_ratio(watched, plain) == pytest.approx(120 / 100)


def test_the_interval_of_identical_rounds_is_their_ratio(bench):
    ratios = [1.07] * 9

    def estimate(picked):
        return statistics.median(ratios[i] for i in picked)

    assert bench.bootstrap_interval(estimate, len(ratios)) == (1.07, 1.07)


def test_the_interval_holds_the_median_and_narrows_with_more_rounds(bench):
    rng = random.Random(1)
    widths = []
    for rounds in (10, 160):
        ratios = [rng.gauss(1.10, 0.05) for _ in range(rounds)]

        def estimate(picked, ratios=ratios):
            return statistics.median(ratios[i] for i in picked)

        low, high = bench.bootstrap_interval(estimate, rounds)
        assert low <= statistics.median(ratios) <= high
        assert low < high
        widths.append(high - low)
    # The median's spread falls as one over the square root of the rounds: 4x for 16x.
    assert widths[1] < widths[0] / 2
    assert bench.bootstrap_interval(estimate, 160, seed=3) != (low, high)  # seeded, not fixed
