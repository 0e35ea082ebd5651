"""The dependency rule of the README's Architecture section: import-linter's contracts hold, they
break when someone adds a backward import, and the import graph has no cycle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")
pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "graddebug": ROOT / "src" / "graddebug",
    "graddebug_torch": ROOT / "adapters" / "torch" / "src" / "graddebug_torch",
    "graddebug_tensorflow": ROOT / "adapters" / "tensorflow" / "src" / "graddebug_tensorflow",
}


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run ``lint-imports`` on the copy of the packages under ``root``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(path.parent) for path in (root / "src" / "graddebug",
                                      root / "adapters/torch/src/graddebug_torch",
                                      root / "adapters/tensorflow/src/graddebug_tensorflow"))}
    script = "import sys; from importlinter.cli import lint_imports; " \
             "sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the three packages and the pyproject that holds the contracts."""
    for package, path in PACKAGES.items():
        target = tmp_path / path.relative_to(ROOT)
        shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
        assert (target / "__init__.py").is_file(), package
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_line(file: Path, line: str) -> None:
    file.write_text(file.read_text(encoding="utf-8") + f"\n\ndef _added():\n    {line}\n",
                    encoding="utf-8")


def test_the_contracts_hold(tree: Path) -> None:
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("file", "line", "contract"), [
    # storage reading back into reporting: the cycle the layout removed
    ("src/graddebug/runs/reader.py", "from graddebug.report.load import load",
     "The pipeline: a layer imports only layers below it"),
    # a detector asking the Watcher for something
    ("src/graddebug/detectors/dead.py", "from graddebug.capture.watcher import Watcher",
     "The pipeline: a layer imports only layers below it"),
    ("src/graddebug/frames.py", "import torch", "The core imports no framework"),
    ("src/graddebug/cli.py", "from graddebug_torch.demo import run_demo",
     "The core imports no framework"),
    ("adapters/torch/src/graddebug_torch/lightning.py",
     "from graddebug.capture.buffer import RunBuffer", "Adapters use the adapter-facing core"),
    ("adapters/tensorflow/src/graddebug_tensorflow/stats.py",
     "import graddebug_torch.stats", "Each adapter stands alone"),
])
def test_a_backward_import_breaks_a_contract(tree: Path, file: str, line: str,
                                             contract: str) -> None:
    add_line(tree / file, line)  # inside a function: those count too
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = [row for row in result.stdout.splitlines() if row.endswith("BROKEN")]
    assert len(broken) == 1 and broken[0].startswith(contract), result.stdout


def test_type_checking_imports_do_not_count(tree: Path) -> None:
    file = tree / "src/graddebug/runs/reader.py"
    text = file.read_text(encoding="utf-8")
    file.write_text(text.replace("from typing import Any",
                                 "from typing import TYPE_CHECKING, Any\n\nif TYPE_CHECKING:\n"
                                 "    from graddebug.report.report import Report", 1),
                    encoding="utf-8")
    assert "graddebug.report.report import Report" in file.read_text(encoding="utf-8")
    assert lint_imports(tree).returncode == 0


def find_cycle(graph: object, modules: set[str]) -> list[str] | None:
    """A cycle of direct imports among ``modules`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.find_modules_directly_imported_by(module)):
            if target not in modules:
                continue
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[module] = 2
        path.pop()
        return None

    for module in sorted(modules):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_import_cycle_counting_imports_inside_functions() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    modules = set(graph.modules)
    assert "graddebug.capture.watcher" in modules and "graddebug_torch.adapter" in modules
    assert find_cycle(graph, modules) is None


def test_the_cycle_check_finds_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from cyclic import b\n")
    (package / "b.py").write_text("from cyclic import c\n")
    (package / "c.py").write_text("import cyclic.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclic", cache_dir=None)
    assert find_cycle(graph, set(graph.modules)) == ["cyclic.a", "cyclic.b", "cyclic.c",
                                                      "cyclic.a"]
