from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import graddebug
import runs
from graddebug import cli
from graddebug.runs.writer import RunWriter


def test_demo_prints_vanishing_findings_and_the_summary(capsys) -> None:
    pytest.importorskip("torch")
    assert cli.main(["demo", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "Findings" in out
    assert "vanishing" in out
    assert "Per-layer summary" in out
    # the first layer (named "0" in the Sequential) is among those flagged
    assert "gradient vanishes at '0'" in out


def test_demo_rejects_a_non_positive_step_count(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--steps", "0"])
    assert info.value.code == 2
    assert "positive" in capsys.readouterr().err


def test_demo_findings_match_the_library(capsys) -> None:
    pytest.importorskip("torch")
    from graddebug_torch.demo import run_demo

    dbg = run_demo(steps=3)
    found = dbg.findings()
    assert set(found["issue"]) == {"vanishing"}
    assert "0" in set(found["layer"])


def test_demo_without_torch_names_the_install_command(capsys, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "graddebug_torch.demo", None)  # import now fails
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err  # errors go to stderr, so that stdout stays parseable
    assert "pip install graddebug[torch]" in err


def test_demo_comes_from_a_plugin_hook(capsys, monkeypatch) -> None:
    from graddebug import plugins

    bare = plugins.new_plugin_manager(entry_points=False)  # no adapter offers a demo
    monkeypatch.setattr(plugins, "get_plugin_manager", lambda: bare)
    assert cli.main(["demo"]) == 2
    assert "pip install graddebug[torch]" in capsys.readouterr().err

    class Fake:
        @graddebug.hookimpl
        def graddebug_demo(self, steps, seed):
            return runs.healthy()

    bare.register(Fake())
    assert cli.main(["demo", "--steps", "3"]) == 0
    assert "Per-layer summary" in capsys.readouterr().out


def test_tables_print_brackets_literally() -> None:
    import pandas as pd
    from rich.console import Console

    from graddebug.report.console import print_frame

    console = Console(width=120, record=True)
    hint = "pip install graddebug[tensorflow]"
    print_frame(console, pd.DataFrame({"layer": ["fc"], "message": [hint]}), "t")
    assert hint in console.export_text()


# -- graddebug report / compare -----------------------------------------------------------------

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Runs on disk, built in-process: healthy, broken (an error finding), corrupt, partial."""
    root = tmp_path_factory.mktemp("runs")
    paths = {name: root / name for name in ("healthy", "broken", "corrupt", "partial", "odd")}
    runs.healthy().save(paths["healthy"])
    runs.broken().save(paths["broken"])
    runs.broken().save(paths["corrupt"])
    part = paths["corrupt"] / "records" / "part-000000.parquet"
    part.write_bytes(part.read_bytes()[:-200])
    writer = RunWriter(paths["partial"], flush_every=1)
    writer.start({"model": "M"}, {})
    writer.flush(runs.records(steps=4), [], [])
    runs.report(runs.records(layers=("a|b", "<c>", "d", "e"))).save(paths["odd"])
    return paths


def graddebug_command(*args: str) -> subprocess.CompletedProcess[str]:
    script = shutil.which("graddebug")
    command = [script] if script else [sys.executable, "-m", "graddebug.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "160"})


def test_report_exits_0_for_a_healthy_run_with_a_parseable_csv(saved) -> None:
    done = graddebug_command("report", str(saved["healthy"]), "--format", "csv",
                             "--table", "summary")
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(io.StringIO(done.stdout))
    summary = runs.healthy().summary()
    assert list(table.columns) == list(summary.columns)
    assert list(table["layer"]) == list(summary["layer"])
    assert table["norm_median"].to_numpy() == pytest.approx(summary["norm_median"].to_numpy())


def test_report_exits_1_on_error_findings_with_parseable_json(saved) -> None:
    done = subprocess.run([sys.executable, "-m", "graddebug.cli", "report", str(saved["broken"]),
                           "--format", "json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    payload = json.loads(done.stdout, parse_constant=strict)  # NaN is written as null
    assert payload["run"]["status"] == "complete"
    assert [f["issue"] for f in payload["findings"]] == ["nonfinite"]
    assert payload["findings"][0]["layer"] == "block.1"
    assert payload["issues"][0] == {**payload["issues"][0], "issue": "nonfinite", "count": 1,
                                    "first_step": 5, "severity": "error"}
    assert payload["thresholds"]["exploding_norm"] == 1e4
    block = next(r for r in payload["summary"] if r["layer"] == "block.1" and r["tensor"] ==
                 "output")
    assert block["nonfinite_steps"] == 7


def test_report_exits_2_on_a_corrupt_run_naming_the_file(saved) -> None:
    done = subprocess.run([sys.executable, "-m", "graddebug.cli", "report",
                           str(saved["corrupt"])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert "part-000000.parquet" in done.stderr
    assert "truncated or corrupt" in done.stderr


def test_the_cli_never_imports_a_framework(saved, tmp_path: Path) -> None:
    code = (
        "import sys; from graddebug.cli import main; "
        f"rc = main(['report', {str(saved['broken'])!r}, '--html', {str(tmp_path / 'r.html')!r},"
        " '--format', 'markdown']); "
        f"rc2 = main(['compare', {str(saved['healthy'])!r}, {str(saved['broken'])!r}]); "
        "print('RESULT', rc, rc2, [m for m in ('torch', 'tensorflow', 'keras', 'jax') "
        "if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "RESULT 1 0 []"
    assert "<img" in (tmp_path / "r.html").read_text()


def test_text_report_shows_issues_and_worst_layers(saved, capsys) -> None:
    assert cli.main(["report", str(saved["broken"]), "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert "Findings by issue" in out
    assert "nonfinite" in out
    assert "Worst layers (top 10)" in out
    assert "1 error finding(s)" in out
    assert err == ""


def test_text_report_of_an_unfinished_run_says_what_was_recovered(saved, capsys) -> None:
    assert cli.main(["report", str(saved["partial"])]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo rich's line wrapping
    assert "incomplete" in out
    assert "recovered 4 recorded steps, up to step 3" in out
    assert "No finding" in out


def test_markdown_escapes_pipes_and_markup(saved, capsys) -> None:
    assert cli.main(["report", str(saved["odd"]), "--format", "markdown", "--table",
                     "summary"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("| layer | tensor | kind | depth |")
    assert lines[1].startswith("|---|---|---|---:|")
    assert "| a\\|b |" in out
    assert "&lt;c&gt;" in out and "<c>" not in out
    assert {line.count(" | ") for line in lines[2:]} == {lines[0].count(" | ")}


def test_compare_prints_ratios_b_over_a(saved, tmp_path: Path, capsys) -> None:
    rows = runs.records()
    runs.report([r._replace(norm=r.norm * 50) if r.layer == "head" else r for r in rows]).save(
        tmp_path / "after")
    assert cli.main(["compare", str(saved["healthy"]), str(tmp_path / "after"),
                     "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    ratio = dict(zip(table["layer"] + "." + table["tensor"], table["ratio"], strict=True))
    assert ratio["head.output"] == pytest.approx(50)
    assert ratio["embed.weight"] == pytest.approx(1)
    assert cli.main(["compare", str(saved["healthy"]), str(tmp_path / "after")]) == 0
    out = capsys.readouterr().out
    assert "ratio = B / A" in out
    assert "50" in out


def test_progress_bar_on_request_and_never_when_refused(saved, capsys) -> None:
    assert cli.main(["report", str(saved["healthy"]), "--progress", "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert "loading" in err and "100%" in err
    assert "loading" not in out  # stdout holds the CSV only
    assert cli.main(["report", str(saved["healthy"]), "--no-progress", "--format", "csv"]) == 0
    assert capsys.readouterr().err == ""


def test_missing_run_is_exit_2(tmp_path: Path, capsys) -> None:
    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_keeps_its_run_for_report_and_writes_its_page(capsys, tmp_path) -> None:
    pytest.importorskip("torch")
    run, page = tmp_path / "demo-run", tmp_path / "demo.html"
    assert cli.main(["demo", "--steps", "4", "--log-dir", str(run), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert f"graddebug report {run}" in out.replace("\n", "")
    loaded = graddebug.load(run)
    assert set(loaded.findings()["issue"]) == {"vanishing"}
    assert sorted(set(loaded.frame()["step"])) == [0, 1, 2, 3]
    assert cli.main(["report", str(run), "--format", "json"]) == 0  # warnings only
    assert json.loads(capsys.readouterr().out)["findings"]
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html") and "vanishing" in text


def test_demo_refuses_its_outputs_before_training(capsys, tmp_path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert cli.main(["demo", "--log-dir", str(taken)]) == 2
    err = capsys.readouterr()
    assert "cannot save a run" in err.err and "Findings" not in err.out
    assert cli.main(["demo", "--html", str(tmp_path / "no" / "such" / "x.html")]) == 2
    assert "folder does not exist" in capsys.readouterr().err


def test_help_is_plain_text() -> None:
    text = cli.build_parser().format_help()
    assert "graddebug demo" in text and "graddebug report RUN" in text
    assert "``" not in text and ":func:" not in text
    demo = subprocess.run([sys.executable, "-m", "graddebug.cli", "demo", "--help"],
                          capture_output=True, text=True, check=True).stdout
    assert "--log-dir DIR" in demo and "--html OUT.html" in demo and "``" not in demo
