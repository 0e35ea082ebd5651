"""The DataFrame contract: columns, dtypes, order; the summary."""

from __future__ import annotations

import math
import random

import pytest

from conftest import make_record
from graddebug.adapter import StepResult
from graddebug.capture.buffer import RunBuffer
from graddebug.frames import SUMMARY_COLUMNS, finding_frame, record_frame, summary_frame
from graddebug.records import RECORD_COLUMNS, Finding, Record


def test_record_frame_columns_and_dtypes() -> None:
    frame = record_frame([make_record(0, "a", 0, 1.0)])
    assert tuple(frame.columns) == RECORD_COLUMNS
    assert frame["step"].dtype == "int64"
    assert frame["norm"].dtype == "float64"
    assert frame["nan"].dtype == bool


def test_pre_norm_column_only_where_an_intervention_acted() -> None:
    plain = make_record(0, "a", 0, 1.0)
    clipped = make_record(0, "b", 1, 1.0)._replace(pre_norm=5.0)
    assert "pre_norm" not in record_frame([plain]).columns
    frame = record_frame([plain, clipped])
    # pre_norm comes before rank; the columns appended after rank stay after it
    assert list(frame.columns)[-5:] == ["pre_norm", "rank", "weight_norm", "update_norm",
                                        "clipped_norm"]
    assert math.isnan(frame["pre_norm"][0])
    assert frame["pre_norm"][1] == 5.0


def test_empty_frames_keep_their_columns() -> None:
    assert tuple(record_frame([]).columns) == RECORD_COLUMNS
    assert list(finding_frame([]).columns) == list(Finding._fields)
    assert tuple(summary_frame(record_frame([]), finding_frame([])).columns) == SUMMARY_COLUMNS


def test_summary_aggregates_per_layer_in_depth_order() -> None:
    records = [make_record(s, name, depth, norm * (s + 1))
               for s in range(3) for name, depth, norm in (("deep", 1, 2.0), ("first", 0, 1.0))]
    records.append(make_record(1, "first", 0, math.nan, nan=True))
    findings = finding_frame([Finding(0, "deep", "output", "dead", "warning", 0.9, 0.7, "m")])
    summary = summary_frame(record_frame(records), findings)
    assert list(summary["layer"]) == ["first", "deep"]
    first = summary.iloc[0]
    assert first["steps"] == 3
    assert first["norm_min"] == 1.0
    assert first["norm_max"] == 3.0
    assert first["nonfinite_steps"] == 1
    assert summary.iloc[1]["issues"] == "dead"
    assert summary.iloc[1]["norm_last"] == 6.0


def test_findings_are_ordered_by_step_then_severity() -> None:
    rows = [Finding(1, "a", "", "dead", "warning", 0.0, 0.0, ""),
            Finding(1, "b", "", "nonfinite", "error", 0.0, 0.0, ""),
            Finding(0, "c", "", "vanishing", "warning", 0.0, 0.0, "")]
    assert list(finding_frame(rows)["layer"]) == ["c", "b", "a"]


def test_a_one_entry_gradient_has_no_spread() -> None:
    # norm**2 / 1 - mean**2 leaves rounding error (1.2e-5 seen on a sharded bias) instead of 0.
    value = 0.1 + 0.2
    one = Record.from_sums(0, "b", "bias", "parameter", 0, "(1,)", 1, norm=abs(value),
                           total=value, absmax=abs(value), zero_frac=math.nan, nan=False,
                           inf=False)
    assert one.std == 0.0 and one.mean == value


@pytest.mark.parametrize("unknown_depth", [False, True])
def test_a_steps_rows_are_stored_activations_ops_parameters_each_in_forward_order(
        unknown_depth: bool) -> None:
    rows = [("w", "parameter", 2, "weight"), ("w", "parameter", 2, "bias"),
            ("b", "activation", 1, "output"), ("a", "activation", 0, "output.1"),
            ("a", "activation", 0, "output.0"), ("b", "op", 1, "torch.log@m.py:3"),
            ("a", "parameter", 0, "weight")]
    if unknown_depth:  # a layer that never ran forward goes last within its kind
        rows.append(("never", "parameter", -1, "weight"))
        rows.append(("tap", "activation", -1, "output"))
    expected = [("a", "output.0"), ("a", "output.1"), ("b", "output")]
    expected += [("tap", "output")] if unknown_depth else []
    expected += [("b", "torch.log@m.py:3"), ("a", "weight"), ("w", "bias"), ("w", "weight")]
    expected += [("never", "weight")] if unknown_depth else []
    for seed in range(5):
        shuffled = [make_record(0, layer, depth, 1.0, kind=kind, tensor=tensor)
                    for layer, kind, depth, tensor in rows]
        random.Random(seed).shuffle(shuffled)
        buffer = RunBuffer(None, 1, lambda: ({}, {}), lambda exc, where: None)
        buffer.add(0, StepResult(records=shuffled))
        assert [(r[1], r[2]) for r in buffer.records] == expected
