"""What training callbacks share: stop_on=, the non-finite check and the stop reason."""

from __future__ import annotations

import math

import pytest

from conftest import make_record
from graddebug.adapter import StepResult
from graddebug.errors import ConfigError
from graddebug.frames import finding_frame
from graddebug.integrations.stopping import (
    check_watch_options,
    nonfinite,
    parse_stop_on,
    stop_reason,
)
from graddebug.records import Event, EventKind, Finding


def test_parse_stop_on_accepts_nonfinite_and_names_the_caller_otherwise():
    assert parse_stop_on("nonfinite", "cb") == frozenset({"nonfinite"})
    assert parse_stop_on((), "cb") == frozenset()
    with pytest.raises(ConfigError, match=r"'nonfinit'.*nonfinite.*cb stops on"):
        parse_stop_on(["nonfinit"], "cb")


def test_nonfinite_sees_nan_inf_and_forward_events():
    healthy = StepResult(records=[make_record(0, "a", 0, 1.0)])
    assert not nonfinite(healthy)
    assert nonfinite(StepResult(records=[make_record(0, "a", 0, 1.0, nan=True)]))
    assert nonfinite(StepResult(records=[make_record(0, "a", 0, math.inf)]))
    forward = Event(0, "log", "output", 1, EventKind.FORWARD_NONFINITE.value, "NaN")
    assert nonfinite(StepResult(records=healthy.records, events=[forward]))


def test_a_step_the_loss_scaler_skipped_stops_only_on_a_forward_nan():
    skipped = Event(0, "", "", -1, EventKind.SKIPPED_STEP.value, "scale=65536.0")
    overflowed = [make_record(0, "a", 0, math.inf, inf=True)]
    assert not nonfinite(StepResult(records=overflowed, events=[skipped]))
    forward = Event(0, "log", "output", 1, EventKind.FORWARD_NONFINITE.value, "NaN")
    assert nonfinite(StepResult(records=overflowed, events=[skipped, forward]))


def test_stop_reason_quotes_the_finding_or_names_the_first_bad_gradient():
    result = StepResult(records=[make_record(3, "a", 0, 1.0, nan=True),
                                 make_record(3, "b", 1, 1.0, nan=True)])
    found = finding_frame([Finding(3, "a", "output", "nonfinite", "error", math.nan, math.nan,
                                   "born in 'a'")])
    assert stop_reason(found, 3, result) == "graddebug stopped training at step 3: born in 'a'"
    none = finding_frame([])
    assert "'b.output'" in stop_reason(none, 3, result)  # backward order: b comes first


def test_unknown_watch_option_is_named_with_a_suggestion():
    check_watch_options({"every": 2, "layers": ["x"]}, "cb", ("log",))
    with pytest.raises(ConfigError, match=r"cb got an unknown option 'evry'.*'every'.*log"):
        check_watch_options({"evry": 2}, "cb", ("log",))
