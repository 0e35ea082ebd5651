"""The dependency rule of docs/architecture.md: import-linter's contracts hold, they break when
someone adds a backward import, every module sits in a layer, the import graph of the core and
the four adapters has no cycle, not even through type-checking imports or imports inside
functions, and no module or function of src/ or adapters/ outgrows its limit."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

grimp = pytest.importorskip("grimp")
pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "graddebug": ROOT / "src" / "graddebug",
    "graddebug_torch": ROOT / "adapters" / "torch" / "src" / "graddebug_torch",
    "graddebug_tensorflow": ROOT / "adapters" / "tensorflow" / "src" / "graddebug_tensorflow",
    "graddebug_jax": ROOT / "adapters" / "jax" / "src" / "graddebug_jax",
    "graddebug_keras": ROOT / "adapters" / "keras" / "src" / "graddebug_keras",
}
"""The core and the four adapter packages, by import name."""


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run ``lint-imports`` on the copy of the packages under ``root``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(root / path.parent.relative_to(ROOT)) for path in PACKAGES.values())}
    script = "import sys; from importlinter.cli import lint_imports; " \
             "sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the five packages and the pyproject that holds the contracts."""
    for package, path in PACKAGES.items():
        target = tmp_path / path.relative_to(ROOT)
        shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
        assert (target / "__init__.py").is_file(), package
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_line(file: Path, line: str) -> None:
    file.write_text(file.read_text(encoding="utf-8") + f"\n\ndef _added():\n    {line}\n",
                    encoding="utf-8")


def contracts() -> dict[str, dict[str, Any]]:
    """The import-linter contracts of pyproject.toml, by id."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}


def pipeline_layers() -> list[list[str]]:
    """The modules of each layer of the pipeline contract, top layer first."""
    return [[name.strip() for name in re.split(r"[|:]", layer)]
            for layer in contracts()["pipeline"]["layers"]]


# A contract's line in lint-imports' report, e.g. "Name BROKEN (2 ignored imports)".
_VERDICT = re.compile(r"^(?P<name>.+) (?P<verdict>KEPT|BROKEN)(?: \(\d+ ignored imports?\))?$")


def verdicts(stdout: str) -> dict[str, str]:
    """Each contract's name and verdict (``KEPT`` or ``BROKEN``) in lint-imports' report."""
    return {m["name"]: m["verdict"] for m in map(_VERDICT.match, stdout.splitlines()) if m}


def test_the_contracts_hold(tree: Path) -> None:
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(contracts())} kept, 0 broken" in result.stdout
    assert len(verdicts(result.stdout)) == len(contracts()) >= 4, result.stdout


@pytest.mark.parametrize(("file", "line", "contract"), [
    # storage reading back into reporting: the cycle the layout removed
    ("src/graddebug/runs/reader.py", "from graddebug.report.load import load",
     "The pipeline: a layer imports only layers below it"),
    # a detector asking the Watcher for something
    ("src/graddebug/detectors/dead.py", "from graddebug.capture.watcher import Watcher",
     "The pipeline: a layer imports only layers below it"),
    # a detector importing the plugin manager that loads it by name
    ("src/graddebug/detectors/dead.py", "from graddebug.plugins import get_plugin_manager",
     "The pipeline: a layer imports only layers below it"),
    ("src/graddebug/frames.py", "import torch", "The core imports no framework"),
    ("src/graddebug/cli.py", "from graddebug_torch.demo import run_demo",
     "The core imports no framework"),
    ("adapters/torch/src/graddebug_torch/__init__.py",
     "from graddebug.capture.buffer import RunBuffer", "Adapters use the adapter-facing core"),
    # the side door: the package reaches the Watcher, and only the demo may go through it
    ("adapters/tensorflow/src/graddebug_tensorflow/__init__.py", "import graddebug",
     "Adapters use the adapter-facing core"),
    ("adapters/tensorflow/src/graddebug_tensorflow/__init__.py", "import graddebug_torch",
     "Each adapter stands alone"),
    ("adapters/jax/src/graddebug_jax/__init__.py", "import graddebug_torch",
     "Each adapter stands alone"),
    # the Keras wing reaching back up into the TF adapter that imports it
    ("adapters/keras/src/graddebug_keras/model.py", "import graddebug_tensorflow",
     "The Keras wing sits below the TF adapter"),
])
def test_a_backward_import_breaks_a_contract(tree: Path, file: str, line: str,
                                             contract: str) -> None:
    add_line(tree / file, line)  # inside a function: those count too
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = [name for name, verdict in verdicts(result.stdout).items() if verdict == "BROKEN"]
    assert len(broken) == 1 and broken[0].startswith(contract), result.stdout


def test_no_contract_passes_by_ignoring_indirect_imports() -> None:
    assert not [i for i, c in contracts().items() if c.get("allow_indirect_imports")]


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
    assert {"graddebug.capture.watcher", "graddebug_torch.adapter", "graddebug_tensorflow.adapter",
            "graddebug_jax.adapter", "graddebug_keras.plugin"} <= modules
    cycle = find_cycle(graph, modules)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_no_import_cycle_counting_type_checking_imports() -> None:
    # The core and every adapter: a cycle that only type checking closes (v1graph <-> v1session
    # once) is still two modules that cannot be read one without the other.
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    modules = set(graph.modules)
    assert {"graddebug.hookspecs", "graddebug_tensorflow.v1session", "graddebug_jax.adapter",
            "graddebug_keras.plugin"} <= modules
    cycle = find_cycle(graph, modules)
    assert cycle is None, "import cycle through type-checking imports: " + " -> ".join(
        cycle or ())


def test_nothing_the_plugin_manager_loads_by_name_imports_it_back() -> None:
    from graddebug.plugins import DEFAULT_PLUGINS

    graph = grimp.build_graph("graddebug", exclude_type_checking_imports=True, cache_dir=None)
    back = {name: graph.find_shortest_chain(importer=name, imported="graddebug.plugins")
            for name in DEFAULT_PLUGINS}
    assert {name: chain for name, chain in back.items() if chain} == {}


def test_every_module_of_graddebug_sits_in_a_layer_of_the_pipeline() -> None:
    named = [name for layer in pipeline_layers() for name in layer]
    graph = grimp.build_graph("graddebug", exclude_type_checking_imports=False, cache_dir=None)
    outside = {m for m in graph.modules
               if not any(m == name or m.startswith(f"{name}.") for name in named)}
    # The package is the public API, above every layer: no module of graddebug imports it.
    assert not graph.find_modules_that_directly_import("graddebug")
    # A package whose __init__ imports nothing (graddebug.capture) needs no layer of its own.
    empty = {m for m in outside
             if graph.find_children(m) and not graph.find_modules_directly_imported_by(m)}
    assert outside - empty == {"graddebug"}, sorted(outside - empty - {"graddebug"})
    assert len(named) == len(set(named)), named
    assert set(named) <= set(graph.modules), sorted(set(named) - set(graph.modules))


MAX_FUNCTION_LINES = 60
"""The longest a function of the core or of an adapter may be, its docstring included."""

MAX_MODULE_LINES = 450
"""The longest a module of the core or of an adapter may be."""


def modules_of(packages: Iterable[Path]) -> list[Path]:
    """The Python files of ``packages``, in a stable order."""
    return sorted(file for package in packages for file in package.rglob("*.py"))


def long_functions(files: Iterable[Path], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (lines)`` for each function of ``files`` longer than ``limit`` lines,
    nested functions and methods included."""
    long = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    long.append(f"{_shown(file)}:{node.lineno} {node.name} ({lines})")
    return long


def long_modules(files: Iterable[Path], limit: int = MAX_MODULE_LINES) -> list[str]:
    """``file (lines)`` for each of ``files`` longer than ``limit`` lines."""
    counts = {file: len(file.read_text(encoding="utf-8").splitlines()) for file in files}
    return [f"{_shown(file)} ({n})" for file, n in counts.items() if n > limit]


def _shown(file: Path) -> str:
    return str(file.relative_to(ROOT)) if file.is_relative_to(ROOT) else str(file)


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_function_is_longer_than_sixty_lines(package: str) -> None:
    assert long_functions(modules_of([PACKAGES[package]])) == []


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_module_is_longer_than_450_lines(package: str) -> None:
    assert long_modules(modules_of([PACKAGES[package]])) == []


def test_the_size_guards_cover_every_package_of_src_and_adapters() -> None:
    found = {init.parent for init in [*(ROOT / "src").glob("*/__init__.py"),
                                      *(ROOT / "adapters").glob("*/src/*/__init__.py")]}
    assert found == set(PACKAGES.values())


def test_the_size_guards_find_a_long_function_and_a_long_module(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    file = tmp_path / "big.py"
    file.write_text(f"def short():\n    pass\n\n\nclass C:\n    def method(self):\n{body}\n"
                    + "\n" * MAX_MODULE_LINES, encoding="utf-8")
    assert long_functions([file]) == [f"{file}:6 method ({MAX_FUNCTION_LINES + 1})"]
    assert long_modules([file]) == [f"{file} ({MAX_MODULE_LINES + MAX_FUNCTION_LINES + 6})"]
    assert long_functions([file], limit=MAX_FUNCTION_LINES + 1) == []


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
