"""Detectors on hand-built records: no framework needed."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import make_record
from graddebug import Thresholds
from graddebug.detectors import Evidence
from graddebug.frames import event_frame, finding_frame, record_frame
from graddebug.plugins import new_plugin_manager
from graddebug.records import Event, EventKind


def diagnose(records, events=(), **thresholds) -> pd.DataFrame:
    pm = new_plugin_manager(entry_points=False)
    evidence = Evidence(records=record_frame(list(records)), events=event_frame(list(events)))
    found = [f for batch in pm.hook.graddebug_findings(
        evidence=evidence, thresholds=Thresholds(**thresholds)) for f in batch]
    return finding_frame(found)


def chain(step: int, norms: list[float], **kw):
    return [make_record(step, f"l{i}", i, n, **kw) for i, n in enumerate(norms)]


def test_flat_gradients_give_no_finding() -> None:
    rng = np.random.default_rng(0)
    rows = [r for s in range(30) for r in chain(s, list(rng.uniform(0.5, 2.0, size=6)))]
    assert diagnose(rows).empty


def test_vanishing_names_the_layers_below_the_ratio_and_absolute_rule() -> None:
    norms = [1e-9, 1e-7, 1e-5, 1e-2, 0.5, 1.0]
    found = diagnose([r for s in range(3) for r in chain(s, norms)])
    vanishing = found[found["issue"] == "vanishing"]
    # ratio < 1e-3 and norm < 1e-4: l0, l1, l2 (l3 is 1e-2: ratio 1e-2 >= 1e-3)
    assert list(vanishing["layer"]) == ["l0", "l1", "l2"]
    assert vanishing["value"].iloc[0] == pytest.approx(1e-9)
    assert "l5" in vanishing["message"].iloc[0]  # names the last layer it compared with


def test_small_ratio_alone_is_not_vanishing_when_first_norm_is_large() -> None:
    # first/last = 1e-4 but the first layer's norm is 10 > 1e-4: AUTOTRAINER needs both.
    found = diagnose(chain(0, [10.0, 1e3, 1e5]))
    assert "vanishing" not in set(found["issue"])


def test_absolute_floor_flags_tiny_layer_even_without_depth_ratio() -> None:
    found = diagnose([r for s in range(3) for r in chain(s, [1e-8, 1e-8])])
    assert set(found["layer"]) == {"l0", "l1"}
    assert set(found["issue"]) == {"vanishing"}


def test_exploding_magnitude_and_ratio() -> None:
    found = diagnose(chain(0, [5e5, 2e3, 1.0]))
    exploding = found[found["issue"] == "exploding"]
    assert list(exploding["layer"]) == ["l0", "l1"]  # 5e5 > 1e4 ; 2e3 / 1 > 70


def test_exploding_growth_across_steps_on_smoothed_total() -> None:
    rows = [r for s in range(20) for r in chain(s, [1.0 * 3.0**s, 1.0])]
    found = diagnose(rows, exploding_norm=1e30, exploding_ratio=1e30)
    growth = found[found["message"].str.contains("grew")]
    assert len(growth) == 1
    assert growth["layer"].iloc[0] == "l0"
    assert growth["value"].iloc[0] > 100


def test_single_small_tensor_swinging_100x_is_not_growth() -> None:
    # A one-element bias crossing zero swings by orders of magnitude; the total barely moves.
    rows = []
    for s in range(30):
        rows += chain(s, [1.0, 1.1, 0.9])
        rows.append(make_record(s, "bias", 1, 1e-6 if s % 2 else 1e-3, kind="parameter",
                                tensor="bias"))
    assert diagnose(rows).empty


def test_nonfinite_backward_origin_is_first_nan_in_backward_order() -> None:
    rows = [
        make_record(0, "l0", 0, float("nan"), nan=True),
        make_record(0, "l1", 1, float("nan"), nan=True),
        make_record(0, "l2", 2, 1.0),
        make_record(0, "l3", 3, 1.0),
    ]
    found = diagnose(rows)
    assert list(found["issue"]) == ["nonfinite"]
    assert found["layer"].iloc[0] == "l1"
    assert "'l2'" in found["message"].iloc[0]  # the finite neighbour whose backward produced it


def test_nonfinite_forward_origin_beats_backward_walk() -> None:
    rows = [make_record(0, f"l{i}", i, float("nan"), nan=True) for i in range(4)]
    events = [Event(0, "l2", "output", 2, EventKind.FORWARD_NONFINITE.value, "NaN"),
              Event(0, "l3", "output", 3, EventKind.FORWARD_NONFINITE.value, "NaN")]
    found = diagnose(rows, events)
    assert list(found["layer"]) == ["l2"]
    assert "forward" in found["message"].iloc[0]


def test_cut_boundary_between_unreached_and_reached_layers() -> None:
    rows = [make_record(0, "b2.0", 2, 1.0), make_record(0, "head", 3, 1.0)]
    events = [Event(0, "b1.0", "output", 0, EventKind.UNREACHED.value),
              Event(0, "b1.1", "output", 1, EventKind.UNREACHED.value),
              Event(0, "b1.0", "weight", 0, EventKind.NO_GRAD.value)]
    found = diagnose(rows, events)
    cut = found[found["severity"] == "error"]
    assert list(cut["layer"]) == ["b2.0"]
    assert "between 'b1.1' and 'b2.0'" in cut["message"].iloc[0]
    starved = found[found["severity"] == "warning"]
    assert list(starved["layer"]) == ["b1.0"]


def test_unused_branch_downstream_is_not_a_cut() -> None:
    rows = [make_record(0, "trunk", 0, 1.0), make_record(0, "head", 2, 1.0)]
    events = [Event(0, "aux", "output", 1, EventKind.UNREACHED.value)]
    assert diagnose(rows, events).empty


def test_detached_output_is_named_instead_of_the_boundary() -> None:
    rows = [make_record(0, "b2", 2, 1.0)]
    events = [Event(0, "b0", "output", 0, EventKind.UNREACHED.value),
              Event(0, "cut", "output", 1, EventKind.DETACHED_OUTPUT.value, "detached")]
    found = diagnose(rows, events)
    assert list(found["layer"]) == ["cut"]


def test_dead_units_need_the_median_step_above_gamma() -> None:
    dead = [make_record(s, "fc", 0, 1.0, zero_frac=0.8) for s in range(5)]
    blip = [make_record(s, "fc2", 1, 1.0, zero_frac=0.9 if s == 0 else 0.1) for s in range(5)]
    found = diagnose(dead + blip)
    assert list(found["layer"]) == ["fc"]
    assert found["value"].iloc[0] == pytest.approx(0.8)


def test_entrywise_half_zero_relu_gradient_is_not_dead() -> None:
    assert diagnose([make_record(s, "fc", 0, 1.0, zero_frac=0.64) for s in range(5)]).empty


def test_thresholds_change_the_verdict() -> None:
    rows = chain(0, [500.0, 1.0])
    assert not diagnose(rows).empty
    assert diagnose(rows, exploding_ratio=1000.0).empty
