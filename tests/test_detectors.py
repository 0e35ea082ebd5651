"""Detectors on hand-built records: no framework needed."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from conftest import make_record
from graddebug import Thresholds
from graddebug.diagnosis import diagnose as run_diagnosis
from graddebug.frames import event_frame, record_frame
from graddebug.plugins import new_plugin_manager
from graddebug.records import Event, EventKind, Record


def diagnose(records, events=(), **thresholds) -> pd.DataFrame:
    return run_diagnosis(record_frame(list(records)), event_frame(list(events)),
                         Thresholds(**thresholds),
                         plugin_manager=new_plugin_manager(entry_points=False))


def chain(step: int, norms: list[float], **kw):
    return [make_record(step, f"l{i}", i, n, **kw) for i, n in enumerate(norms)]


def test_flat_gradients_give_no_finding() -> None:
    rng = np.random.default_rng(0)
    rows = [r for s in range(30) for r in chain(s, list(rng.uniform(0.5, 2.0, size=6)))]
    assert diagnose(rows).empty


def test_gradual_vanishing_names_the_farthest_layer_and_counts_the_others() -> None:
    norms = [1e-9, 1e-7, 1e-5, 1e-2, 0.5, 1.0]
    found = diagnose([r for s in range(3) for r in chain(s, norms)])
    vanishing = found[found["issue"] == "vanishing"]
    # ratio < 1e-3 and norm < 1e-4: l0, l1, l2 (l3 is 1e-2: ratio 1e-2 >= 1e-3); the drop is
    # spread over the layers (log steps 2, 2, 3, 1.7, 0.3 of 9): no single source.
    assert list(vanishing["layer"]) == ["l0"]
    message = vanishing["message"].iloc[0]
    assert "3 layer(s)" in message and "shrinks layer by layer" in message
    assert vanishing["value"].iloc[0] == pytest.approx(1e-9)
    assert "l5" in message  # names the last layer it compared with
    assert vanishing["cause"].iloc[0] == "layer"


def test_ratios_compare_entries_not_norms_of_different_sizes() -> None:
    # A 112x112x32 activation gradient whose entries are 4x the 1000-wide last layer's: its
    # norm is 80x larger, from its size alone.
    rows = []
    for s in range(3):
        for depth, (numel, rms) in enumerate([(112 * 112 * 32, 4.0), (4_096, 1.2),
                                              (1_000, 1.0)]):
            norm = rms * np.sqrt(numel)
            rows.append(make_record(s, f"l{depth}", depth, norm)._replace(
                numel=numel, std=rms, shape=str((numel,))))
    assert rows[0].norm / rows[2].norm > 70  # the norm ratio would have fired
    assert diagnose(rows).empty


def test_a_one_off_scale_change_in_a_deep_net_is_not_exploding() -> None:
    # 200 layers whose gradient per entry is 400x the head's: the head's scale, not growth.
    norms = [400.0] * 200 + [1.0]
    assert diagnose([r for s in range(3) for r in chain(s, norms)]).empty


def test_small_ratio_alone_is_not_vanishing_when_first_norm_is_large() -> None:
    # first/last = 1e-4 but the first layer's norm is 10 > 1e-4: AUTOTRAINER needs both.
    found = diagnose(chain(0, [10.0, 1e3, 1e5]))
    assert "vanishing" not in set(found["issue"])


def test_absolute_floor_gives_one_finding_for_tiny_layers() -> None:
    found = diagnose([r for s in range(3) for r in chain(s, [1e-8, 1e-8])])
    assert list(found["layer"]) == ["l0"]
    assert set(found["issue"]) == {"vanishing"}
    assert "2 layer(s)" in found["message"].item()


def test_floor_names_where_the_gradient_collapses_and_where_it_is_restored() -> None:
    # A huge weight at l2 feeds a normalisation at l5: between them the gradient is ~1e-9,
    # above l5 and below l2 it is normal.
    norms = [1.0, 1.2, 1e-9, 2e-9, 1.5e-9, 0.8, 1.0]
    found = diagnose([r for s in range(3) for r in chain(s, norms)])
    assert list(found["issue"]) == ["vanishing"]
    assert found["layer"].item() == "l2"  # the layer whose backward restores it
    message = found["message"].item()
    assert "in the backward of 'l5'" in message  # where it collapses
    assert "3 layer(s)" in message


def test_a_collapsed_band_wider_than_the_floor_still_names_its_source() -> None:
    # As in GPT-2 with one projection x1e6: only two layers of the collapsed band fall below
    # the 1e-7 floor, the others sit near 1e-6, still a million times below both ends.
    norms = [1.0, 1.1, 2e-6, 3e-8, 1e-6, 5e-8, 2e-6, 0.9, 1.0]
    found = diagnose([r for s in range(3) for r in chain(s, norms)])
    floor = found[found["message"].str.contains("restored")]
    assert list(floor["layer"]) == ["l2"]  # its backward restores the gradient
    assert "in the backward of 'l7'" in floor["message"].item()


def test_tiny_side_branches_the_gradient_bypasses_are_not_vanishing() -> None:
    # Residual branches scaled down by design (ConvNeXt's layer scale, 1e-6 at init) alternate
    # with the trunk in forward order, and the first layer gets a healthy gradient: it reaches
    # the input, so nothing vanishes.
    norms = [1.0, 1e-9, 1.2, 2e-9, 0.9, 1e-9, 1.1, 1.0]
    assert diagnose([r for s in range(3) for r in chain(s, norms)]).empty


def test_tiny_layers_down_to_the_input_are_vanishing_without_a_source() -> None:
    # The same interleaving, but the first layer is tiny too: the gradient does not reach it.
    norms = [1e-9, 1e-9, 1.2, 2e-9, 0.9, 1e-9, 1.1, 1.0]
    found = diagnose([r for s in range(3) for r in chain(s, norms)])
    assert set(found["issue"]) == {"vanishing"}
    floor = found[found["message"].str.contains("vanishingly small")]
    assert list(floor["layer"]) == ["l0"]
    assert "restored" not in floor["message"].item()


def test_a_huge_jump_names_its_source_once() -> None:
    # A weight 1e6 too large at l4: every layer below it gets a 1e6-times larger gradient.
    norms = [1.2e6, 1.1e6, 1.3e6, 1e6, 1.0, 1.1]
    found = diagnose([r for s in range(3) for r in chain(s, norms)])
    assert list(found["issue"]) == ["exploding"]
    assert found["layer"].item() == "l4"
    message = found["message"].item()
    assert "backward of 'l4'" in message and "the output of 'l3'" in message
    assert "4 layer(s)" in message
    assert found["cause"].item() == "layer"  # a weight of l4, not the whole run


def test_gradual_explosion_names_the_farthest_layer() -> None:
    norms = [3.0 ** (9 - i) for i in range(10)]
    found = diagnose([r for s in range(3) for r in chain(s, norms)])
    assert list(found["layer"]) == ["l0"]
    assert "explodes" in found["message"].item()


def test_exploding_magnitude_without_a_depth_profile() -> None:
    found = diagnose([make_record(0, "w", 0, 5e5, kind="parameter", tensor="weight")])
    assert list(found["layer"]) == ["w"]
    assert found["value"].item() == pytest.approx(5e5 / math.sqrt(32))  # RMS of 32 entries


def test_exploding_magnitude_is_judged_per_entry() -> None:
    """A large healthy tensor's norm passes 1e4 by size alone; per entry it is small."""
    big = Record(0, "conv1", "kernel", "parameter", 0, "(7, 7, 3, 64)", 9408, 1.9e5, 0.0,
                 1.9e5 / math.sqrt(9408), 50.0, math.nan, False, False)
    assert diagnose([big]).empty
    hot = big._replace(norm=1.9e5 * 100)  # about 2e5 per entry
    assert list(diagnose([hot])["issue"]) == ["exploding"]


def test_nonfinite_steps_give_no_dead_or_ratio_findings() -> None:
    rows = []
    for s in range(5):
        bad = s >= 2  # from step 2 the run is NaN: victims are zeroed or huge
        rows += [make_record(s, "l0", 0, float("nan") if bad else 1.0, nan=bad),
                 make_record(s, "l1", 1, 1e-12 if bad else 1.0, zero_frac=1.0 if bad else 0.1),
                 make_record(s, "l2", 2, 1e9 if bad else 1.0, zero_frac=1.0 if bad else 0.1),
                 make_record(s, "l3", 3, 1.0)]
    found = diagnose(rows)
    assert list(found["issue"]) == ["nonfinite"]


def test_exploding_growth_across_steps_on_smoothed_total() -> None:
    rows = [r for s in range(20) for r in chain(s, [1.0 * 3.0**s, 1.0])]
    found = diagnose(rows, exploding_norm=1e30, exploding_ratio=1e30)
    growth = found[found["message"].str.contains("grew")]
    assert len(growth) == 1
    assert growth["layer"].iloc[0] == "l0"
    assert growth["value"].iloc[0] > 100
    assert growth["cause"].iloc[0] == "optimizer"  # the whole run diverges


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
    assert found["cause"].iloc[0] == "numerics"


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
    assert set(found["cause"]) == {"graph"}
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
    assert list(found["cause"]) == ["layer"]
    assert found["value"].iloc[0] == pytest.approx(0.8)


def test_entrywise_half_zero_relu_gradient_is_not_dead() -> None:
    assert diagnose([make_record(s, "fc", 0, 1.0, zero_frac=0.64) for s in range(5)]).empty


def test_thresholds_change_the_verdict() -> None:
    rows = chain(0, [500.0, 1.0])
    assert not diagnose(rows).empty
    assert diagnose(rows, exploding_ratio=1000.0).empty
    assert diagnose(rows, exploding_gain=600.0).empty


def test_every_built_in_finding_names_a_cause() -> None:
    """Each diagnosis says where to look first; only graddebug's own bugs name none."""
    rows = [r for s in range(3) for r in chain(s, [1e-9, 1e-7, 1e-5, 1e-2, 0.5, 1.0])]
    rows += [make_record(s, "fc", 9, 1.0, zero_frac=0.9) for s in range(3)]
    rows += [make_record(3, "l0", 0, float("nan"), nan=True)]
    events = [Event(0, "cut", "output", 10, EventKind.DETACHED_OUTPUT.value, "detached")]
    found = diagnose(rows, events)
    assert set(found["issue"]) == {"vanishing", "dead", "nonfinite", "cut_graph"}
    assert (found["cause"] != "").all(), found[["issue", "cause"]]
