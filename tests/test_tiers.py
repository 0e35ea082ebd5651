"""Tiered statistics in the core: which recorded steps measure every statistic of layer
outputs (graddebug.capture.tiers). The torch adapter's side is in test_torch_tiers.py."""

from __future__ import annotations

import math

import pytest

import graddebug
from graddebug.adapter import StepResult
from graddebug.capture.tiers import JUMP, StatTiers
from graddebug.errors import ConfigError
from graddebug.records import Record


def rows(step: int, norms: dict[str, float]) -> StepResult:
    """A step's layer-output rows with the given norms (and one parameter row, ignored)."""
    records = [Record.from_sums(step, layer, "output", "activation", depth, "(4,)", 4,
                                norm=norm, total=0.0, absmax=math.nan, zero_frac=math.nan,
                                nan=math.isnan(norm), inf=math.isinf(norm))
               for depth, (layer, norm) in enumerate(norms.items())]
    records.append(Record.from_sums(step, "fc", "weight", "parameter", 0, "(4,)", 4,
                                    norm=1e9, total=0.0, absmax=math.nan, zero_frac=math.nan,
                                    nan=False, inf=False))
    return StepResult(records=records)


def full_steps(tiers: StatTiers, norms: list[dict[str, float]]) -> list[int]:
    """The steps ``tiers`` made full, feeding it ``norms[step]`` after each."""
    full = []
    for step, step_norms in enumerate(norms):
        if tiers.full(step):
            full.append(step)
        tiers.after(step, rows(step, step_norms))
    return full


def test_one_recorded_step_in_full_every_is_full() -> None:
    steady = [{"a": 1.0, "b": 2.0}] * 25
    assert full_steps(StatTiers(every=1, full_every=10), steady) == [0, 10, 20]
    assert full_steps(StatTiers(every=1, full_every=1), steady) == list(range(25))


def test_with_every_above_1_every_recorded_step_is_full() -> None:
    tiers = StatTiers(every=3, full_every=10)
    assert all(tiers.full(step) for step in range(0, 30, 3))


def test_a_non_finite_sentinel_makes_the_next_step_full_once() -> None:
    norms = [{"a": 1.0}] * 12
    norms[3] = {"a": math.nan}
    norms[6] = {"a": math.inf}
    assert full_steps(StatTiers(every=1, full_every=10), norms) == [0, 4, 7, 10]


@pytest.mark.parametrize("factor", [JUMP * 1.5, 1 / (JUMP * 1.5)])
def test_a_norm_far_from_the_last_full_steps_makes_the_next_step_full(factor: float) -> None:
    norms = [{"a": 1.0, "b": 2.0}] * 12
    norms[5] = {"a": 1.0, "b": 2.0 * factor}
    assert full_steps(StatTiers(every=1, full_every=10), norms) == [0, 6, 10]


def test_norms_within_the_jump_keep_the_schedule() -> None:
    norms = [{"a": 1.0 * (JUMP / 2) ** (step % 2)} for step in range(12)]
    assert full_steps(StatTiers(every=1, full_every=10), norms) == [0, 10]


def test_the_reference_is_the_last_full_step() -> None:
    # the norm drifts 3x a step: each sentinel is compared with the last full step, not with
    # the step before it, so the drift arms a full step once it has added up past JUMP
    norms = [{"a": 3.0**step} for step in range(9)]
    assert full_steps(StatTiers(every=1, full_every=10), norms) == [0, 4, 8]


@pytest.mark.parametrize("value", [0, -1, 2.5, "10", True])
def test_full_stats_every_must_be_a_positive_int(value: object) -> None:
    with pytest.raises(ConfigError, match="full_stats_every"):
        graddebug.watch(params={}, full_stats_every=value)


def zeroed(step: int, bias: float, output: float = math.nan) -> StepResult:
    """A step with a layer output (zero fraction ``output``, NaN: not measured) and its 1-D
    bias (zero fraction ``bias``), both of steady norm."""
    return StepResult(records=[
        Record.from_sums(step, "fc", "output", "activation", 0, "(8, 4)", 32, norm=1.0,
                         total=0.0, absmax=math.nan, zero_frac=output, nan=False, inf=False),
        Record.from_sums(step, "fc", "bias", "parameter", 0, "(4,)", 4, norm=1.0, total=0.0,
                         absmax=math.nan, zero_frac=bias, nan=False, inf=False)])


def full_zero_steps(tiers: StatTiers, biases: list[float], dead_from: int) -> list[int]:
    """The steps ``tiers`` made full, where the bias's zero fraction is ``biases[step]`` and
    the layer output's units (measured on full steps only) are dead from ``dead_from`` on."""
    full = []
    for step, bias in enumerate(biases):
        if tiers.full(step):
            full.append(step)
            tiers.after(step, zeroed(step, bias, 0.8 if step >= dead_from else 0.0))
        else:
            tiers.after(step, zeroed(step, bias))
    return full


def test_units_that_die_between_full_steps_make_the_next_two_steps_full() -> None:
    # the bias's zeros cross dead_fraction at step 13: step 14 measures the outputs, finds
    # them newly dead and makes step 15 full too (the dead rule needs two measured steps)
    biases = [0.0] * 13 + [0.8] * 12
    full = full_zero_steps(StatTiers(every=1, full_every=10, dead_fraction=0.7), biases, 13)
    assert full == [0, 10, 14, 15, 20]


def test_units_dead_all_along_or_below_the_fraction_keep_the_schedule() -> None:
    tiers = StatTiers(every=1, full_every=10, dead_fraction=0.7)
    # dead from step 0: step 0 measures them (step 1 follows, once), then no more crossings
    assert full_zero_steps(tiers, [0.8] * 25, 0) == [0, 1, 10, 20]
    below = [0.5 + 0.1 * (step % 2) for step in range(25)]  # 0.5, 0.6: never at 0.7
    assert full_zero_steps(StatTiers(every=1, full_every=10), below, 99) == [0, 10, 20]


def test_a_bias_whose_zeros_come_and_go_arms_at_each_crossing() -> None:
    biases = [0.0] * 25
    biases[3] = biases[7] = 0.9
    full = full_zero_steps(StatTiers(every=1, full_every=10, dead_fraction=0.7), biases, 99)
    assert full == [0, 4, 8, 10, 20]
