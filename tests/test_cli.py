from __future__ import annotations

import pytest

from graddebug import cli


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
    out = capsys.readouterr().out
    assert "pip install graddebug[torch]" in out


def test_tables_print_brackets_literally() -> None:
    import pandas as pd
    from rich.console import Console

    from graddebug.console import print_frame

    console = Console(width=120, record=True)
    hint = "pip install graddebug[tensorflow]"
    print_frame(console, pd.DataFrame({"layer": ["fc"], "message": [hint]}), "t")
    assert hint in console.export_text()
