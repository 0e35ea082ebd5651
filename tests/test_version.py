"""One version for the five distributions: each has one source (its ``_version.py``), which its
pyproject.toml reads, the changelog's newest release names it, and ``graddebug --version``
prints it with the installed adapters."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from pathlib import Path

import pytest
import tomllib

import graddebug
from graddebug.cli import main

ROOT = Path(__file__).resolve().parent.parent
PROJECTS = {"graddebug": ROOT, **{f"graddebug-{name}": ROOT / "adapters" / name
                                   for name in ("torch", "tensorflow", "jax", "keras")}}


def _pyproject(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("distribution", sorted(PROJECTS))
def test_each_distribution_reads_its_version_from_its_one_source(distribution: str) -> None:
    config = _pyproject(PROJECTS[distribution])
    assert "version" not in config["project"]
    assert config["project"]["dynamic"] == ["version"]
    attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    package = distribution.replace("-", "_")
    assert attr == f"{package}._version.__version__"
    module = importlib.import_module(f"{package}._version")
    assert module.__version__ == graddebug.__version__
    # the package itself exports the same object
    assert importlib.import_module(package).__version__ == module.__version__


@pytest.mark.parametrize("distribution", sorted(PROJECTS))
def test_each_distribution_ships_the_licence_and_a_readme(distribution: str) -> None:
    folder = PROJECTS[distribution]
    project = _pyproject(folder)["project"]
    assert project["license-files"] == ["LICENSE"]
    assert (folder / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert (folder / project["readme"]).is_file()
    assert project["description"] and project["classifiers"] and project["urls"]
    # an adapter asks for a core (and the Keras wing, for TF) of its own release series
    major_minor = ".".join(graddebug.__version__.split(".")[:2])
    for requirement in project.get("dependencies", []):
        if requirement.startswith("graddebug"):
            name = requirement.split(">=")[0]
            assert name in ("graddebug", "graddebug-keras"), requirement
            assert requirement == f"{name}>={major_minor}"


def test_the_changelog_names_the_version_as_its_newest_release() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, re.MULTILINE)
    assert releases and releases[0] == graddebug.__version__
    assert "## [Unreleased]" in text.split(f"## [{releases[0]}]")[0]
    # keep-a-changelog: each release links to its comparison or tag
    for release in ["Unreleased", *releases]:
        assert re.search(rf"^\[{re.escape(release)}\]: \S+$", text, re.MULTILINE), release


def test_version_option_prints_graddebug_and_each_installed_adapter(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"graddebug {graddebug.__version__}"
    adapters = {ep.dist.name: ep.dist.version
                for ep in importlib.metadata.entry_points(group="graddebug") if ep.dist}
    assert adapters, "no adapter is installed"
    assert {tuple(line.split()) for line in lines[1:]} == set(adapters.items())
