"""Configuration without code: ``GRADDEBUG_DISABLE``, ``GRADDEBUG_<OPTION>`` variables and
``[tool.graddebug]`` in the nearest ``pyproject.toml``, with one precedence: argument, then
environment, then ``pyproject.toml``, then the default."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

import graddebug
from graddebug.config import find_pyproject
from graddebug.errors import ConfigError


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project directory, entered one level down (the file is found by walking up)."""
    for name in ("GRADDEBUG_EVERY", "GRADDEBUG_STRICT", "GRADDEBUG_DISABLE",
                 "GRADDEBUG_VANISHING_FLOOR", "GRADDEBUG_RAISE_ON"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "src").mkdir()
    monkeypatch.chdir(tmp_path / "src")
    return tmp_path


def write(project: Path, text: str) -> Path:
    path = project / "pyproject.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_without_any_source_the_defaults_hold(project: Path) -> None:
    write(project, '[project]\nname = "x"\n')  # a pyproject without the table
    dbg = graddebug.watch()
    assert dbg.every == 1 and dbg.strict is False
    assert dbg.thresholds == graddebug.Thresholds()


def test_the_nearest_pyproject_is_found_walking_up(project: Path) -> None:
    path = write(project, "")
    assert find_pyproject() == path.resolve()


def test_pyproject_sets_options_and_thresholds(project: Path) -> None:
    write(project, "[tool.graddebug]\nevery = 5\nstrict = true\n"
                   "[tool.graddebug.thresholds]\nvanishing_floor = 1e-9\n")
    dbg = graddebug.watch()
    assert dbg.every == 5 and dbg.strict is True
    assert dbg.thresholds.vanishing_floor == 1e-9


def test_precedence_is_argument_then_environment_then_pyproject_then_default(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(project, "[tool.graddebug]\nevery = 5\n"
                   "[tool.graddebug.thresholds]\nvanishing_floor = 1e-9\nstall_floor = 1e-9\n")
    assert graddebug.watch().every == 5
    monkeypatch.setenv("GRADDEBUG_EVERY", "7")
    monkeypatch.setenv("GRADDEBUG_VANISHING_FLOOR", "1e-10")
    dbg = graddebug.watch()
    assert dbg.every == 7
    assert dbg.thresholds.vanishing_floor == 1e-10 and dbg.thresholds.stall_floor == 1e-9
    assert graddebug.watch(every=3).every == 3
    # A mapping overrides the thresholds it names; the others keep their source.
    given = graddebug.watch(thresholds={"stall_floor": 1e-7}).thresholds
    assert given.stall_floor == 1e-7 and given.vanishing_floor == 1e-10
    # A Thresholds object is complete: it wins whole.
    whole = graddebug.watch(thresholds=graddebug.Thresholds()).thresholds
    assert whole == graddebug.Thresholds()


def test_environment_flags_and_lists_are_read_from_text(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADDEBUG_STRICT", "yes")
    assert graddebug.watch().strict is True
    monkeypatch.setenv("GRADDEBUG_STRICT", "0")
    assert graddebug.watch().strict is False
    monkeypatch.setenv("GRADDEBUG_STRICT", "maybe")
    with pytest.raises(ConfigError, match="GRADDEBUG_STRICT='maybe'"):
        graddebug.watch()


@pytest.mark.parametrize(("value", "match"), [
    ("ten", r"GRADDEBUG_EVERY='ten' must be a whole number"),
    ("0", r"GRADDEBUG_EVERY: every=0 must be a positive int"),
])
def test_a_bad_environment_value_names_the_variable(
        project: Path, monkeypatch: pytest.MonkeyPatch, value: str, match: str) -> None:
    monkeypatch.setenv("GRADDEBUG_EVERY", value)
    with pytest.raises(ConfigError, match=match):
        graddebug.watch()


def test_a_bad_threshold_in_the_environment_names_the_variable(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADDEBUG_VANISHING_FLOOR", "-1")
    with pytest.raises(ConfigError, match="GRADDEBUG_VANISHING_FLOOR: threshold vanishing_floor"):
        graddebug.watch()


def test_bad_pyproject_values_name_the_file(project: Path) -> None:
    path = write(project, "[tool.graddebug]\nevry = 5\n")
    with pytest.raises(ConfigError, match=r"sets 'evry'.*Did you mean 'every'") as caught:
        graddebug.watch()
    assert str(path) in str(caught.value)
    write(project, "[tool.graddebug]\nparam_stats = 'all'\n")
    with pytest.raises(ConfigError, match=r"pyproject\.toml \[tool\.graddebug\]: "
                                          r"param_stats='all'"):
        graddebug.watch()
    write(project, "[tool.graddebug.thresholds]\ndead_fraction = 3\n")
    with pytest.raises(ConfigError, match=r"\[tool\.graddebug\.thresholds\]: .*dead_fraction"):
        graddebug.watch()
    write(project, "[tool.graddebug]\nlog_dir = 'runs'\n")  # a new directory per run
    with pytest.raises(ConfigError, match="sets 'log_dir', which is not one"):
        graddebug.watch()
    write(project, "[tool.graddebug]\nevery = \n")
    with pytest.raises(ConfigError, match="cannot be read as TOML"):
        graddebug.watch()


def test_raise_on_from_the_environment_stops_a_loop(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("GRADDEBUG_RAISE_ON", "nonfinite, exploding")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with pytest.raises(graddebug.FindingError) as caught, graddebug.watch(model) as dbg:
        for i in range(4):
            x = torch.randn(8, 4) * (math.nan if i == 2 else 1.0)
            model(x).pow(2).mean().backward()
            dbg.step()
    assert set(caught.value.findings["step"]) == {2}


def test_disable_attaches_nothing_records_nothing_and_says_so_once(
        project: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("GRADDEBUG_DISABLE", "1")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="graddebug"), \
            graddebug.watch(model, log_dir=project / "run", optimizer=opt) as dbg:
        assert not any(m._forward_hooks for m in model.modules())
        x = torch.randn(8, 4)
        assert dbg.tap(x, "x") is x
        model(x).pow(2).mean().backward()
        assert dbg.step() is None
        opt.step()
    lines = [r.getMessage() for r in caplog.records if "GRADDEBUG_DISABLE" in r.getMessage()]
    assert len(lines) == 1
    assert dbg.frame().empty and dbg.findings().empty
    assert not (project / "run").exists()
    # Training itself went on: the optimizer moved the weights.
    assert any(not torch.equal(a, b) for a, b in zip(reference, model.parameters(),
                                                     strict=True))


def test_disable_with_a_bad_value_names_the_variable(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADDEBUG_DISABLE", "perhaps")
    with pytest.raises(ConfigError, match="GRADDEBUG_DISABLE='perhaps'"):
        graddebug.watch()
