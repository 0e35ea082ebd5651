"""Report.assert_healthy on hand-built runs: the verdict, the table, ignore= and thresholds."""

from __future__ import annotations

import math

import pytest

from conftest import make_record
from graddebug import ConfigError, Report, Thresholds
from graddebug.diagnosis import diagnose
from graddebug.frames import event_frame, finding_frame, record_frame
from graddebug.records import Finding
from graddebug.report.verdict import findings_table

FLAT = [0.5, 0.8, 1.3, 2.0, 0.9, 1.0]
# By the vanishing rule (ratio to the last layer < 1e-3 and norm < 1e-4): l0, l1, l2, named
# in one finding at l0, the farthest from the loss.
VANISHING = [1e-9, 1e-7, 1e-5, 1e-2, 0.5, 1.0]


def run(norms: list[float], steps: int = 3, dead: str | None = None) -> Report:
    rows = [make_record(s, f"l{i}", i, n, zero_frac=0.9 if f"l{i}" == dead else 0.0)
            for s in range(steps) for i, n in enumerate(norms)]
    records, events = record_frame(rows), event_frame([])
    return Report(records, events, diagnose(records, events, Thresholds()),
                  thresholds=Thresholds())


def table_lines(error: pytest.ExceptionInfo[AssertionError]) -> list[str]:
    return str(error.value).splitlines()


def test_a_healthy_run_passes_and_a_stricter_threshold_fails_it() -> None:
    report = run(FLAT)
    assert report.findings().empty
    report.assert_healthy()
    # The first/last ratio is 0.5 here, 0.87 per layer: below 0.4 and 0.8 that is "exploding".
    with pytest.raises(AssertionError, match="exploding"):
        report.assert_healthy(exploding_ratio=0.4, exploding_gain=0.8)
    assert report.findings().empty  # thresholds= never changes the Report


def test_the_message_is_a_table_naming_step_layer_issue_and_message() -> None:
    report = run(VANISHING, dead="l4")
    with pytest.raises(AssertionError) as error:
        report.assert_healthy()
    lines = table_lines(error)
    assert lines[0] == "graddebug found 2 problems in the gradients:"
    header = lines[1]
    assert header.split() == ["step", "layer", "tensor", "issue", "cause", "severity",
                              "value", "threshold", "message"]
    assert set(lines[2]) == {"-", " "}
    rows = lines[3:]
    assert len(rows) == 2
    assert sorted(row.split()[3] for row in rows) == ["dead", "vanishing"]
    for row in rows:
        cells = row.split()
        layer = "l0"
        if cells[3] == "dead":
            assert cells[:6] == ["0", "l4", "output", "dead", "layer", "warning"]
            continue
        assert cells[:6] == ["0", layer, "output", "vanishing", "layer", "warning"]
        assert f"gradient vanishes at '{layer}'" in row
        # Columns line up under the header, the message last.
        assert row.index("vanishing") == header.index("issue")
        assert row.index("gradient vanishes") == header.index("message")


def test_ignore_takes_issue_names_and_issue_colon_layer_globs() -> None:
    report = run(VANISHING, dead="l4")
    report.assert_healthy(ignore=("vanishing", "dead"))
    report.assert_healthy(ignore=["*:l?"])
    report.assert_healthy(ignore=("vanishing:l[0-2]", "dead:l4"))
    with pytest.raises(AssertionError) as error:
        report.assert_healthy(ignore=("vanishing:l[01]", "vanishing:l4"))
    lines = table_lines(error)
    assert lines[0].startswith("graddebug found 1 problem in the gradients (1 more ignored by")
    assert [line.split()[1] for line in lines[3:]] == ["l4"]
    # An issue that is not present but exists is fine; the glob is case-sensitive.
    with pytest.raises(AssertionError):
        report.assert_healthy(ignore=("exploding", "*:L*"))


@pytest.mark.parametrize("entry", ["vanishng", "Vanishing", "nan:l0"])
def test_unknown_issue_names_raise_config_error(entry: str) -> None:
    with pytest.raises(ConfigError, match="unknown issue") as error:
        run(FLAT).assert_healthy(ignore=(entry,))
    assert repr(entry.partition(":")[0]) in str(error.value)
    if entry == "vanishng":
        assert "Did you mean 'vanishing'" in str(error.value)


@pytest.mark.parametrize("ignore", [("",), ("vanishing:",), (":l0",), (3,), (None,), 7])
def test_malformed_ignore_entries_raise_config_error(ignore: object) -> None:
    with pytest.raises(ConfigError, match="ignore"):
        run(FLAT).assert_healthy(ignore=ignore)  # type: ignore[arg-type]


def test_issues_from_other_detectors_can_be_ignored_once_they_appear() -> None:
    base = run(FLAT)
    custom = Finding(2, "l3", "output", "slow_layer", "warning", 3.0, 1.0, "l3 is slow.")
    report = Report(base.frame(), base.events(), finding_frame([custom]),
                    thresholds=Thresholds())
    with pytest.raises(AssertionError, match="slow_layer"):
        report.assert_healthy()
    report.assert_healthy(ignore=("slow_layer",))


def test_thresholds_are_rediagnosed_and_unknown_ones_raise() -> None:
    report = run(VANISHING)
    # No layer is below 1e-12 of the last, nor (l0: 1e-9) below the absolute floor 1e-10.
    report.assert_healthy(vanishing_ratio=1e-12, vanishing_floor=1e-10)
    with pytest.raises(AssertionError, match="vanishingly small"):
        report.assert_healthy(vanishing_ratio=1e-12)  # the default floor, 1e-7, catches l0
    with pytest.raises(AssertionError) as error:
        report.assert_healthy(vanishing_ratio=1e-6)
    assert "thresholds vanishing_ratio=1e-06" in table_lines(error)[0]
    assert [line.split()[1] for line in table_lines(error)[3:]] == ["l0"]
    assert "2 layer(s)" in table_lines(error)[3]  # l0 and l1, counted in one finding
    with pytest.raises(ConfigError, match="unknown threshold 'vanishing_rate'"):
        report.assert_healthy(vanishing_rate=1e-3)


def test_the_table_is_capped_and_each_finding_stays_on_one_line() -> None:
    found = [Finding(s, f"layer{s}", "", "dead", "warning", 0.9, 0.7, "many\nlines  here")
             for s in range(45)]
    text = findings_table(finding_frame(found))
    lines = text.splitlines()
    assert len(lines) == 2 + 40 + 1
    assert lines[-1] == "... and 5 more findings (Report.findings())."
    assert lines[2].split() == ["0", "layer0", "-", "dead", "warning", "0.9", "0.7",
                                "many", "lines", "here"]
    assert lines[2].endswith("  many lines here")
    assert findings_table(finding_frame([])) == "no findings"


def test_values_are_formatted_for_reading() -> None:
    found = [Finding(0, "a", "", "exploding", "warning", 123456.0, math.nan, "m")]
    row = findings_table(finding_frame(found)).splitlines()[2].split()
    assert row == ["0", "a", "-", "exploding", "warning", "1.23e+05", "-", "m"]
