"""Output reaches terminals, spreadsheets and matplotlib: user strings (layer names, run
metadata) are shown as they are, never executed as escape sequences, formulas or mathtext."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import warnings
from pathlib import Path

import pandas as pd
import pytest

import graddebug
import runs
from graddebug import cli
from graddebug.errors import (
    ConfigError,
    GradDebugWarning,
    UnknownNameError,
    printable,
)
from graddebug.report.console import csv_text
from graddebug.report.verdict import findings_table

pytest_plugins = ["pytester"]

HOSTILE = ("clear\x1b[2J\x1b[H", "title\x1b]0;pwned\x07", "csi\x9b31m", "rtl\u202eevil",
           "cr\rover")
"""Layer names holding what a terminal acts on: a clear-screen, an OSC window title, a C1
CSI, a right-to-left override, a carriage return."""

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def assert_no_control(text: str) -> None:
    found = sorted({repr(c) for c in CONTROL.findall(text)})
    assert not found, f"control characters reach the terminal: {found}"


def hostile_run(path: Path, layers: tuple[str, ...] = HOSTILE, **metadata: str) -> Path:
    rows = runs.records(steps=6, layers=layers, nan_at=(3, layers[1]))
    report = runs.report(rows, metadata={"framework": "synthetic", "model": "Handmade",
                                         **metadata})
    report.save(path)
    return path


# -- item: mathtext in plots ------------------------------------------------------------------


DOLLAR_NAMES = ("cost$x", "loss$\\frac{a$", "$$", "price_$_usd")


def test_layer_names_with_dollars_are_drawn_as_they_are() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    report = runs.report(runs.records(steps=4, layers=DOLLAR_NAMES, nan_at=(2, "$$")))
    flow, heatmap = report.plot_flow(), report.plot_heatmap()
    for figure, labels in ((flow, lambda ax: ax.get_xticklabels()),
                           (heatmap, lambda ax: ax.get_yticklabels())):
        FigureCanvasAgg(figure).draw()  # mathtext raised ValueError here
        texts = labels(figure.axes[0])
        assert set(DOLLAR_NAMES) <= {t.get_text() for t in texts}
        assert all(not t.get_parse_math() and not t.get_usetex() for t in texts)


def test_html_report_and_cli_html_with_dollar_names(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("pyarrow")
    report = runs.report(runs.records(steps=4, layers=DOLLAR_NAMES))
    page = report.to_html()
    assert "cost$x" in page
    report.save(tmp_path / "run")
    code = cli.main(["report", str(tmp_path / "run"), "--html", str(tmp_path / "out.html"),
                     "--no-progress"])
    assert code == 0
    assert "loss$\\frac{a$" in (tmp_path / "out.html").read_text(encoding="utf-8")


# -- item: control characters never reach a terminal ------------------------------------------


def test_printable_escapes_controls_and_keeps_the_rest() -> None:
    assert printable("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert printable("t\x1b]0;x\x07") == "t\\x1b]0;x\\x07"
    assert printable("c\x9bd\x7f") == "c\\x9bd\\x7f"
    assert printable("r\u202el") == "r\\u202el"
    assert printable("tab\tnew\nline é 层 ∑") == "tab\tnew\nline é 层 ∑"


def test_compare_shows_hostile_layer_names_escaped(tmp_path: Path, capsys) -> None:
    pytest.importorskip("pyarrow")
    a, b = hostile_run(tmp_path / "a"), hostile_run(tmp_path / "b\x1b[31m")
    assert cli.main(["compare", str(a), str(b), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert_no_control(out)
    assert "clear\\x1b[2J\\x1b[H" in out and "title\\x1b]0;pwned\\x07" in out
    assert "b\\x1b[31m" in out  # the run path in the title too
    assert cli.main(["compare", str(a), str(b), "--format", "markdown"]) == 0
    assert_no_control(capsys.readouterr().out)


def test_report_shows_hostile_names_and_metadata_escaped(tmp_path: Path, capsys) -> None:
    pytest.importorskip("pyarrow")
    run = hostile_run(tmp_path / "run", model="Net\x1b]0;owned\x07", host="h\x1b[2J")
    assert cli.main(["report", str(run), "--no-progress"]) == 1  # the NaN finding is an error
    out = capsys.readouterr().out
    assert_no_control(out)
    assert "Net\\x1b]0;owned\\x07" in out and "title\\x1b]0;pwned\\x07" in out
    for table in ("findings", "summary", "worst", "issues"):
        cli.main(["report", str(run), "--format", "markdown", "--table", table])
        assert_no_control(capsys.readouterr().out)


def test_cli_errors_show_paths_escaped(tmp_path: Path, capsys) -> None:
    assert cli.main(["report", str(tmp_path / "gone\x1b[2J"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert_no_control(err)
    assert "gone\\x1b[2J" in err


def test_json_output_keeps_names_exact(tmp_path: Path, capsys) -> None:
    pytest.importorskip("pyarrow")
    run = hostile_run(tmp_path / "run")
    cli.main(["report", str(run), "--format", "json", "--table", "summary"])
    out = capsys.readouterr().out
    assert_no_control(out)  # JSON escapes them itself
    assert set(HOSTILE) <= {row["layer"] for row in json.loads(out)["summary"]}


def test_assertion_text_escapes_hostile_names() -> None:
    report = runs.report(runs.records(steps=6, layers=HOSTILE, nan_at=(3, HOSTILE[0])))
    with pytest.raises(AssertionError) as caught:
        report.assert_healthy()
    text = str(caught.value)
    assert_no_control(text)
    assert "clear\\x1b[2J\\x1b[H" in text
    assert_no_control(findings_table(report.findings()))


def test_errors_and_warnings_escape_hostile_names() -> None:
    assert_no_control(str(ConfigError("bad layer 'x\x1b[2J'")))
    assert str(UnknownNameError("no layer 'x\x1b]0;t\x07'")) == "no layer 'x\\x1b]0;t\\x07'"
    dbg = graddebug.watch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dbg._hooks.internal_error(RuntimeError("boom\x1b[2J"), "layer\x1b]0;t\x07")
    [warning] = [w for w in caught if issubclass(w.category, GradDebugWarning)]
    text = warnings.formatwarning(warning.message, warning.category, warning.filename,
                                  warning.lineno)
    assert_no_control(text)
    assert "layer\\x1b]0;t\\x07" in text


def test_strict_pytest_failure_text_escapes_model_names(pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    graddebug.check(torch.nn.Linear(2, 1), torch.ones(1, 2), lambda out: out.sum())
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "graddebug.integrations.pytest_plugin")
    pytester.makepyfile(test_strict='''
        import torch

        def test_named(graddebug):
            net = type("Net\\x1b]0;owned\\x07", (torch.nn.Sequential,), {})(
                torch.nn.Linear(2, 2), torch.nn.Sigmoid(), torch.nn.Linear(2, 1))
            with torch.no_grad():
                net[0].weight.fill_(float("nan"))
            graddebug.check(net, torch.ones(3, 2), lambda out: out.sum())
    ''')
    result = pytester.runpytest("--graddebug-strict")
    result.assert_outcomes(passed=1, errors=1)  # fails at teardown, as --graddebug-strict does
    text = result.stdout.str()
    assert "Net\\x1b]0;owned\\x07" in text
    assert "\x1b]0;owned" not in text


# -- item: CSV cells are not formulas ----------------------------------------------------------


FORMULAS = ('=HYPERLINK("http://evil.example","click")', "+1+2", "-2+3", "@SUM(A1:A9)",
            "\tTAB", "plain")


def test_csv_text_cells_that_start_a_formula_get_a_quote() -> None:
    frame = pd.DataFrame({
        "layer": list(FORMULAS),
        "value": [-1.5, 2.0, -3.25, 0.0, math.nan, -7.0],
        "depth": [-1, 0, 1, 2, 3, -4],
        "nan": [True, False, True, False, True, False],
    })
    rows = list(csv.DictReader(io.StringIO(csv_text(frame))))
    assert [r["layer"] for r in rows] == [
        '\'=HYPERLINK("http://evil.example","click")', "'+1+2", "'-2+3", "'@SUM(A1:A9)",
        "'\tTAB", "plain"]
    # Numbers are numbers, also negative ones: nothing is prefixed in numeric columns.
    assert [r["value"] for r in rows] == ["-1.5", "2.0", "-3.25", "0.0", "", "-7.0"]
    assert [r["depth"] for r in rows] == ["-1", "0", "1", "2", "3", "-4"]
    assert [r["nan"] for r in rows] == ["True", "False", "True", "False", "True", "False"]


def test_report_and_compare_csv_are_safe_and_json_stays_raw(tmp_path: Path, capsys) -> None:
    pytest.importorskip("pyarrow")
    run = hostile_run(tmp_path / "run", layers=FORMULAS)
    for argv in (["report", str(run), "--format", "csv"],
                 ["report", str(run), "--format", "csv", "--table", "summary"],
                 ["compare", str(run), str(run), "--format", "csv"]):
        cli.main([*argv, "--no-progress"])
        rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
        assert rows
        for row in rows:
            for column in ("layer", "message"):
                cell = row.get(column) or ""
                assert not cell.startswith(("=", "+", "-", "@", "\t", "\r")), (column, cell)
        layers = {r["layer"] for r in rows}
        assert layers <= {"'" + n if n[0] in "=+-@\t" else n for n in FORMULAS}
    cli.main(["report", str(run), "--format", "json", "--table", "summary"])
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert {row["layer"] for row in summary} == set(FORMULAS)  # JSON keeps names raw
    loaded = graddebug.load(run)
    assert set(loaded.frame()["layer"]) == set(FORMULAS)  # and so does the run on disk
