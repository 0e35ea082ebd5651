"""Every ```python block of README.md and of the documentation pages (docs/**/*.md) runs, so that
neither can rot. Each block is one test, named after its file and line (``docs/guides/jax.md:5``).

A block runs as written, as a reader would copy it: in a fresh namespace that holds only
``__name__``, so it imports and builds everything it uses (its model, its data), and
``test_every_block_defines_the_names_it_uses`` says which name a block reads without defining.
An HTML comment on the line just above a block's fence says how to run it::

    <!-- readme-test: check=NAME -->         after the block, CHECKS[NAME] below checks what
                                             it left (no finding, a clip that acted); before
                                             it, a check may isolate process-wide state (a
                                             fresh plugin manager) or skip a missing package,
                                             but it returns no names: the block's namespace
                                             is not the check's to fill
    <!-- readme-test: pytest -->             the block is a test module: pytester runs it and
                                             every test in it must pass
    <!-- readme-test: slow -->               run with ``-m slow`` only (combine them:
                                             ``check=lightning_fit slow``)
    <!-- readme-test: skip: REASON -->       not run, for a block that cannot run anywhere

A block that imports tensorflow, keras or lightning is slow by itself: those imports take
seconds. Every block runs in a temporary working directory.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def documents() -> list[Path]:
    """README.md and every Markdown page of the documentation, the build output excepted."""
    pages = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [README, *pages]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()
_MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
_HEAVY = {"tensorflow", "keras", "lightning", "pytorch_lightning"}


@dataclass
class Block:
    """One ```python block of a Markdown file."""

    line: int  # of the first code line
    code: str
    check: str | None = None
    pytest: bool = False
    slow: bool = False
    skip: str | None = None
    imports: set[str] = field(default_factory=set)
    path: str = "README.md"  # relative to the repository root


def blocks(text: str, path: str = "README.md") -> list[Block]:
    """Parse the ```python blocks of a Markdown text and their readme-test comments."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        block = Block(line=i + 2, code="\n".join(lines[i + 1:end]) + "\n", path=path)
        marker = _MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        if marker is not None:
            spec = marker.group(1)
            if spec.startswith("skip"):
                block.skip = spec.partition(":")[2].strip() or "no reason given"
            for token in spec.split() if block.skip is None else ():
                key, _, value = token.partition("=")
                if key == "check":
                    block.check = value
                elif key == "setup":
                    raise ValueError(
                        f"{path}:{i}: readme-test option {token!r}: a block defines every name "
                        "it uses, nothing runs before it; check=NAME checks what it left"
                    )
                elif key in ("pytest", "slow"):
                    setattr(block, key, True)
                else:
                    raise ValueError(f"{path}:{i}: unknown readme-test option {token!r}")
        block.imports = _imports(block.code)
        block.slow = block.slow or bool(block.imports & _HEAVY)
        found.append(block)
        i = end + 1
    return found


def undefined_names(code: str) -> set[str]:
    """The names a block reads but neither binds nor imports, builtins aside.

    Scopes are not told apart: a name bound anywhere in the block counts as defined. That is
    enough to catch a block that leans on names defined out of the reader's sight.
    """
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(builtins))


def _imports(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return {name.split(".")[0] for name in names} | {n for n in names if "." in n}


# -- checks: what a block left behind ------------------------------------------------------


@dataclass
class Context:
    """What a check may use before the block runs: never the block's namespace."""

    monkeypatch: pytest.MonkeyPatch
    tmp_path: Path


Check = Callable[[dict[str, Any]], None]


def healthy_torch_run(ctx: Context) -> Check:
    """``dbg`` recorded one step per batch of ``loader`` and found nothing."""
    pytest.importorskip("torch")

    def check(ns: dict[str, Any]) -> None:
        dbg = ns["dbg"]
        assert sorted(dbg.frame()["step"].unique()) == list(range(len(ns["loader"])))
        assert dbg.findings().empty, dbg.findings()["message"].tolist()

    return check


def clipped_tap(ctx: Context) -> Check:
    """``dbg`` recorded the tap ``h`` and the parameters ``W``, ``b``; the clip acted on ``h``,
    and ``W.grad`` is ``x.T @`` the clipped gradient that ``dbg`` kept."""
    torch = pytest.importorskip("torch")

    def check(ns: dict[str, Any]) -> None:
        frame = ns["dbg"].frame()
        assert set(frame["layer"]) == {"h", "W", "b"}
        h = frame[frame["layer"] == "h"].iloc[0]
        assert h["norm"] <= 1.0 + 1e-6 < h["pre_norm"]  # the clip acted, as the comment says
        kept = torch.from_numpy(ns["dbg"].tensors(0)["h"])
        torch.testing.assert_close(ns["W"].grad, ns["x"].T @ kept)

    return check


def fresh_plugins(ctx: Context) -> Check:
    """``graddebug.get_plugin_manager()`` is a fresh manager while the block runs, so that the
    plugin it registers leaves the process-wide one alone; the block registered ``Slow``."""
    import graddebug
    from graddebug.plugins import new_plugin_manager

    pm = new_plugin_manager(entry_points=False)
    ctx.monkeypatch.setattr(graddebug, "get_plugin_manager", lambda: pm)

    def check(ns: dict[str, Any]) -> None:
        assert any(type(p).__name__ == "Slow" for p in pm.get_plugins())

    return check


def lightning_fit(ctx: Context) -> Check:
    """``trainer`` ran its 20 steps and ``callback`` recorded each of them."""
    pytest.importorskip("torch")
    pytest.importorskip("lightning.pytorch")

    def check(ns: dict[str, Any]) -> None:
        assert ns["trainer"].global_step == 20
        assert sorted(ns["callback"].frame()["step"].unique()) == list(range(20))

    return check


CHECKS: dict[str, Callable[[Context], Check]] = {
    "healthy_torch_run": healthy_torch_run,
    "clipped_tap": clipped_tap,
    "fresh_plugins": fresh_plugins,
    "lightning_fit": lightning_fit,
}


# -- the tests ------------------------------------------------------------------------------


def _params() -> list[Any]:
    params = []
    for path in documents():
        for block in blocks(path.read_text(encoding="utf-8"), _name(path)):
            marks: list[Any] = [pytest.mark.slow] if block.slow else []
            if block.skip is not None:
                marks.append(pytest.mark.skip(reason=f"{block.path}:{block.line}: {block.skip}"))
            params.append(pytest.param(block, id=f"{block.path}:{block.line}", marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_readme_block_runs(block: Block, request: pytest.FixtureRequest,
                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = "\n" * (block.line - 1) + block.code  # tracebacks point at the file's lines
    if block.pytest:
        _run_as_test_module(block, request.getfixturevalue("pytester"), monkeypatch)
        return
    monkeypatch.chdir(tmp_path)  # files a block writes (log_dir="runs/...") land there
    check: Check | None = None
    if block.check is not None:
        make_check = CHECKS.get(block.check)
        assert make_check is not None, (
            f"{block.path}:{block.line}: check={block.check!r} is not a check of "
            f"tests/test_readme.py; known: {', '.join(CHECKS)}."
        )
        check = make_check(Context(monkeypatch, tmp_path))
    namespace: dict[str, Any] = {"__name__": "readme"}  # what a reader's fresh script has
    try:
        exec(compile(source, str(ROOT / block.path), "exec"), namespace)
    except Exception as exc:
        raise AssertionError(
            f"{block.path}:{block.line}: the block failed ({type(exc).__name__}: {exc}). It "
            "runs as written, alone: it must import and build everything it uses."
        ) from exc
    if check is not None:
        check(namespace)


def _run_as_test_module(block: Block, pytester: pytest.Pytester,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The inner session runs in this process with graddebug's plugin alone. Modules it imports
    # for the first time would be dropped after it (pytester restores sys.modules), and torch
    # cannot be imported twice: import them here first.
    for name in sorted(block.imports):
        importlib.import_module(name)
    if "torch" in sys.modules:
        _warm_up_torch()
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "graddebug.integrations.pytest_plugin")
    pytester.makepyfile(test_readme_block=block.code)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 1 and set(outcomes) <= {"passed", "warnings"}, (
        f"{block.path}:{block.line}: {outcomes}\n{result.stdout.str()}"
    )


def _warm_up_torch() -> None:
    """Run what torch imports lazily on first use (graddebug's Watcher, an optimizer step)."""
    import torch

    import graddebug

    model = torch.nn.Linear(2, 1)
    graddebug.check(model, torch.ones(1, 2), lambda out: out.sum(),
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_block_parser_reads_markers_and_imports() -> None:
    text = "\n".join([
        "intro", "```python", "x = 1", "```",
        "<!-- readme-test: check=healthy_torch_run slow -->", "```python", "import keras", "```",
        "<!-- readme-test: skip: needs a GPU -->", "```python", "y = 2", "```",
        "<!-- readme-test: pytest -->", "```python", "from torch import nn", "```",
        "```bash", "pip install x", "```",
    ])
    parsed = blocks(text, "docs/page.md")
    assert {b.path for b in parsed} == {"docs/page.md"}
    assert [b.line for b in parsed] == [3, 7, 11, 15]
    assert (parsed[0].check, parsed[0].slow, parsed[0].code) == (None, False, "x = 1\n")
    assert (parsed[1].check, parsed[1].slow, parsed[1].imports) == (
        "healthy_torch_run", True, {"keras"})
    assert parsed[2].skip == "needs a GPU"
    assert parsed[3].pytest and parsed[3].imports == {"torch"} and not parsed[3].slow
    with pytest.raises(ValueError, match=r"README\.md:1: unknown readme-test option 'sertup=x'"):
        blocks("<!-- readme-test: sertup=x -->\n```python\npass\n```")
    with pytest.raises(ValueError, match=r"'setup=torch_mlp': a block defines every name"):
        blocks("<!-- readme-test: setup=torch_mlp -->\n```python\nmodel\n```")


def test_the_documents_have_the_blocks_this_module_is_written_for() -> None:
    parsed = [b for path in documents()
              for b in blocks(path.read_text(encoding="utf-8"), _name(path))]
    assert len(documents()) > 1, "no page under docs/"
    assert {b.check for b in parsed} >= set(CHECKS)
    assert sum(b.pytest for b in parsed) >= 1


def test_every_block_defines_the_names_it_uses() -> None:
    # Nothing runs before a block: a name it reads and does not define is a NameError for the
    # reader who copies it. A skipped block is an excerpt and may lean on its page's prose.
    undefined = {
        f"{b.path}:{b.line}": sorted(names)
        for path in documents()
        for b in blocks(path.read_text(encoding="utf-8"), _name(path))
        if b.skip is None and (names := undefined_names(b.code))
    }
    assert not undefined, f"blocks that read names they do not define: {undefined}"


def test_the_name_check_sees_what_a_block_leaves_undefined() -> None:
    code = "\n".join([
        "import torch.nn as nn", "from graddebug import watch", "x = nn.Linear(2, 1)",
        "def f(a, *rest, key=None):", "    return [a + i for i in rest], key, loader",
        "try:", "    pass", "except ValueError as err:", "    print(err)",
        "with watch(model) as dbg:", "    dbg.step()",
    ])
    assert undefined_names(code) == {"loader", "model"}
