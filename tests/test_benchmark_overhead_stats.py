"""The method of ``benchmarks/overhead_torch.py``: the twins' pairs of single steps, the ratio
over the pairs, the ratio of rounds where only some steps are recorded, and the bootstrap
interval quoted next to each ratio."""

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


def test_position_ratio_takes_each_position_s_median_pair_ratio(bench):
    # Three rounds of three pairs; the first position is the recorded step.
    watched = [[30.0, 11.0, 10.0], [33.0, 10.0, 12.0], [90.0, 20.0, 20.0]]
    plain = [[10.0, 10.0, 10.0], [10.0, 10.0, 10.0], [30.0, 20.0, 10.0]]
    # Pair ratios by position: (3.0, 3.3, 3.0), (1.1, 1.0, 1.0), (1.0, 1.2, 2.0).
    assert bench.position_ratio(watched, plain) == pytest.approx((3.0 + 1.0 + 1.2) / 3)


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


def test_the_ratio_is_the_median_over_every_pair_of_the_picked_rounds(bench):
    res = bench.Result("w", "b", "(b)", 1.15)
    # Pair ratios: round 0 gives 1.1, 1.1, 1.3; round 1 gives 1.2, 1.1, 1.2.
    res.plain_steps_ms = [[10.0, 20.0, 10.0], [10.0, 40.0, 40.0]]
    res.watched_steps_ms = [[11.0, 22.0, 13.0], [12.0, 44.0, 48.0]]
    estimate = bench._estimator(res, every=1)
    assert estimate([0, 1]) == pytest.approx((1.1 + 1.2) / 2)
    assert estimate([0, 0]) == pytest.approx(1.1)
    # Not the ratio of the round's medians (44 / 40), which pairs the steps apart.
    assert estimate([1]) == pytest.approx(1.2)


def test_time_pairs_alternates_single_steps_and_the_plain_twin_never_carries_a_hook(bench):
    import torch
    from torch import nn

    import graddebug

    log: list[tuple[str, int]] = []

    class Probe(nn.Linear):
        """Logs which twin ran and how many forward hooks its model carried then."""

        def __init__(self, tag: str) -> None:
            super().__init__(4, 4)
            self.tag = tag

        def forward(self, x):
            log.append((self.tag, sum(len(m._forward_hooks) for m in model_of[self.tag]
                                      .modules())))
            return super().forward(x)

    torch.manual_seed(0)
    plain_model = nn.Sequential(Probe("plain"), nn.ReLU(), nn.Linear(4, 2))
    work = bench.Workload("tiny", "", plain_model,
                          torch.optim.SGD(plain_model.parameters(), lr=1e-4),
                          torch.randn(8, 4), torch.randn(8, 2), nn.functional.mse_loss)
    other = bench.twin(work)
    other.model[0].tag = "watched"
    model_of = {"plain": plain_model, "watched": other.model}
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(),
                                                  other.model.parameters(), strict=True))
    watcher = graddebug.watch(other.model)
    plain, watched, enter_exit = bench.time_pairs(work, other, 4, watcher,
                                                  torch.device("cpu"), watched_first=True)
    assert [tag for tag, _ in log] == ["watched", "plain", "plain", "watched",
                                       "watched", "plain", "plain", "watched"]
    assert all(hooks == 0 for tag, hooks in log if tag == "plain")
    assert all(hooks > 0 for tag, hooks in log if tag == "watched")
    assert len(plain) == len(watched) == 4 and min(plain + watched) > 0 and enter_exit > 0
    assert sorted(set(watcher.frame()["step"])) == [0, 1, 2, 3]
