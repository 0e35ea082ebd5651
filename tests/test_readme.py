"""Every ```python block of README.md and of the documentation pages (docs/**/*.md) runs, so that
neither can rot. Each block is one test, named after its file and line (``docs/guides/jax.md:5``).

An HTML comment on the line just above a block's fence says how to run it::

    <!-- readme-test: setup=torch_mlp -->    run after a prelude from PRELUDES below, which
                                             defines the names the block uses; a prelude may
                                             also check what the block left behind
    <!-- readme-test: pytest -->             the block is a test module: pytester runs it and
                                             every test in it must pass
    <!-- readme-test: slow -->               run with ``-m slow`` only (combine them:
                                             ``setup=lightning slow``)
    <!-- readme-test: skip: REASON -->       not run, for a block that cannot run anywhere

A block without a comment runs on its own, in a fresh namespace, and imports what it needs. A
block that imports tensorflow, keras or lightning is slow by itself: those imports take seconds.
Every block runs in a temporary working directory. To run a new kind of block, add a prelude.
"""

from __future__ import annotations

import ast
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
    setup: str | None = None
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
                if key == "setup":
                    block.setup = value
                elif key in ("pytest", "slow"):
                    setattr(block, key, True)
                else:
                    raise ValueError(f"{path}:{i}: unknown readme-test option {token!r}")
        block.imports = _imports(block.code)
        block.slow = block.slow or bool(block.imports & _HEAVY)
        found.append(block)
        i = end + 1
    return found


def _imports(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return {name.split(".")[0] for name in names} | {n for n in names if "." in n}


# -- preludes: set-up before a block, and a check of what it left --------------------------


@dataclass
class Context:
    """What a prelude may use."""

    monkeypatch: pytest.MonkeyPatch
    tmp_path: Path


Check = Callable[[dict[str, Any]], None]


def torch_mlp(ctx: Context) -> tuple[dict[str, Any], Check]:
    """``model`` (a healthy He-initialised ReLU MLP), ``opt``/``optimizer`` (SGD),
    ``data``/``loader`` (5 batches of 32), ``loss_fn`` (cross-entropy), ``graddebug``."""
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch.nn import functional as F

    import graddebug

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(3):
        linear = nn.Linear(32 if i == 0 else 64, 64)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        layers += [linear, nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
            for _ in range(5)]
    names = {"graddebug": graddebug, "torch": torch, "model": model, "opt": opt,
             "optimizer": opt, "data": data, "loader": data, "loss_fn": F.cross_entropy}

    def check(ns: dict[str, Any]) -> None:
        dbg = ns["dbg"]
        assert sorted(dbg.frame()["step"].unique()) == list(range(len(data)))
        assert dbg.findings().empty, dbg.findings()["message"].tolist()

    return names, check


def torch_taps(ctx: Context) -> tuple[dict[str, Any], Check]:
    """``W``, ``b`` (leaf parameters), ``x``, ``y0`` for a model-free tap."""
    torch = pytest.importorskip("torch")

    import graddebug

    g = torch.Generator().manual_seed(0)
    names = {
        "graddebug": graddebug, "torch": torch,
        "W": torch.randn(4, 3, generator=g).requires_grad_(),
        "b": torch.zeros(3).requires_grad_(),
        "x": torch.randn(8, 4, generator=g), "y0": torch.randn(8, 3, generator=g) * 20,
    }

    def check(ns: dict[str, Any]) -> None:
        frame = ns["dbg"].frame()
        assert set(frame["layer"]) == {"h", "W", "b"}
        h = frame[frame["layer"] == "h"].iloc[0]
        assert h["norm"] <= 1.0 + 1e-6 < h["pre_norm"]  # the clip acted, as the comment says

    return names, check


def fresh_plugins(ctx: Context) -> tuple[dict[str, Any], Check]:
    """``graddebug`` whose ``get_plugin_manager()`` is a fresh manager, so that a block that
    registers a plugin leaves the process-wide one alone."""
    import graddebug
    from graddebug.plugins import new_plugin_manager

    pm = new_plugin_manager(entry_points=False)
    ctx.monkeypatch.setattr(graddebug, "get_plugin_manager", lambda: pm)

    def check(ns: dict[str, Any]) -> None:
        assert any(type(p).__name__ == "Slow" for p in pm.get_plugins())

    return {"graddebug": graddebug}, check


def lightning(ctx: Context) -> tuple[dict[str, Any], Check]:
    """``lit_module`` (a LightningModule around a small MLP) and ``train_loader``."""
    torch = pytest.importorskip("torch")
    pl = pytest.importorskip("lightning.pytorch")
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    class LitMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,))),
                        batch_size=8)

    def check(ns: dict[str, Any]) -> None:
        assert ns["trainer"].global_step == 20
        assert sorted(ns["callback"].frame()["step"].unique()) == list(range(20))

    return {"lit_module": LitMLP(), "train_loader": loader}, check


PRELUDES: dict[str, Callable[[Context], tuple[dict[str, Any], Check]]] = {
    "torch_mlp": torch_mlp,
    "torch_taps": torch_taps,
    "fresh_plugins": fresh_plugins,
    "lightning": lightning,
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
    namespace: dict[str, Any] = {"__name__": "readme"}
    check: Check | None = None
    if block.setup is not None:
        prelude = PRELUDES.get(block.setup)
        assert prelude is not None, (
            f"{block.path}:{block.line}: setup={block.setup!r} is not a prelude of "
            f"tests/test_readme.py; known: {', '.join(PRELUDES)}."
        )
        names, check = prelude(Context(monkeypatch, tmp_path))
        namespace.update(names)
    try:
        exec(compile(source, str(ROOT / block.path), "exec"), namespace)
    except Exception as exc:
        if block.setup is None:
            raise AssertionError(
                f"{block.path}:{block.line}: the block failed ({type(exc).__name__}: {exc}). "
                "It has no readme-test comment, so it ran alone: make it self-contained, or give "
                "it a setup= prelude (see the docstring of tests/test_readme.py)."
            ) from exc
        raise
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
        "<!-- readme-test: setup=torch_mlp slow -->", "```python", "import keras", "```",
        "<!-- readme-test: skip: needs a GPU -->", "```python", "y = 2", "```",
        "<!-- readme-test: pytest -->", "```python", "from torch import nn", "```",
        "```bash", "pip install x", "```",
    ])
    parsed = blocks(text, "docs/page.md")
    assert {b.path for b in parsed} == {"docs/page.md"}
    assert [b.line for b in parsed] == [3, 7, 11, 15]
    assert (parsed[0].setup, parsed[0].slow, parsed[0].code) == (None, False, "x = 1\n")
    assert (parsed[1].setup, parsed[1].slow, parsed[1].imports) == ("torch_mlp", True, {"keras"})
    assert parsed[2].skip == "needs a GPU"
    assert parsed[3].pytest and parsed[3].imports == {"torch"} and not parsed[3].slow
    with pytest.raises(ValueError, match=r"README\.md:1: unknown readme-test option 'sertup=x'"):
        blocks("<!-- readme-test: sertup=x -->\n```python\npass\n```")


def test_the_documents_have_the_blocks_this_module_is_written_for() -> None:
    parsed = [b for path in documents()
              for b in blocks(path.read_text(encoding="utf-8"), _name(path))]
    assert len(documents()) > 1, "no page under docs/"
    assert {b.setup for b in parsed} >= set(PRELUDES)
    assert sum(b.pytest for b in parsed) >= 1
