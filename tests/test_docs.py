"""The documentation holds together: the options of ``watch`` are one set wherever they are
named, and every relative link of README.md leads to a file (and heading) that exists.

The ```python blocks of README.md and of the pages under docs/ run in tests/test_readme.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


# -- the options of watch: signature, WatchOptions' fields, its docstring --------------------


def documented(doc: str, section: str = "Attributes") -> dict[str, str]:
    """The names a section (``Attributes:``, ``Args:``) of a Google-style docstring documents,
    each with its description (continuation lines joined)."""
    text = inspect.cleandoc(doc)
    head = f"\n{section}:\n"
    if head not in text:
        return {}
    body = text.split(head, 1)[1]
    body = re.split(r"^\S", body, maxsplit=1, flags=re.MULTILINE)[0]  # up to the next section
    entries: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        if (entry := re.match(r"^ {4}(\*{0,2}\w+)(?: \([^)]*\))?: ?(.*)", line)) is not None:
            name = entry.group(1)
            entries[name] = entry.group(2)
        elif name is not None and line.strip():
            entries[name] += " " + line.strip()
    return entries


def test_the_docstring_parser_reads_one_section() -> None:
    doc = """Options.

    Attributes:
        every: Record one step in N;
            continued: not a name.
        ops (bool): Op-level capture.

    Note:
        later: not an attribute.
    """
    assert documented(doc) == {"every": "Record one step in N; continued: not a name.",
                               "ops": "Op-level capture."}
    assert documented(doc, "Args") == {}


def test_watch_its_options_object_and_its_docstring_name_the_same_options() -> None:
    import graddebug
    from graddebug.adapter import WatchOptions
    from graddebug.adapter.options import WATCH_OPTIONS

    signature = [name for name in inspect.signature(graddebug.watch).parameters
                 if name != "model"]
    fields = {f.name for f in dataclasses.fields(WatchOptions)}
    docs = documented(WatchOptions.__doc__ or "")
    # A field the Watcher derives from another option says so in its entry, and is no option.
    derived = {name for name, text in docs.items() if "not an option of its own" in text}
    assert derived <= fields, sorted(derived - fields)
    options = fields - derived
    assert set(signature) == options, (
        f"in watch() only: {sorted(set(signature) - options)}, "
        f"in WatchOptions only: {sorted(options - set(signature))}")
    assert set(docs) == fields, (
        f"fields not documented: {sorted(fields - set(docs))}, "
        f"documented but no field: {sorted(set(docs) - fields)}")
    assert list(WATCH_OPTIONS) == signature


def test_the_options_page_is_generated_from_watch_options() -> None:
    page = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert ".. autoclass:: graddebug.adapter.WatchOptions" in page
    # no list of its own, in the page or in the README
    for text in (page, README.read_text(encoding="utf-8")):
        assert not re.search(r"^\| `\w+=` \|", text, flags=re.MULTILINE)


# -- links of the README ---------------------------------------------------------------------


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub (and MyST, with ``myst_heading_anchors``) gives a file's headings."""
    found, fence = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (heading := re.match(r"#{1,6} (.*)", line)) is not None:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            found.add(text.replace(" ", "-"))
    return found


def links(markdown: str) -> list[str]:
    """The targets of the Markdown links outside code blocks and code spans."""
    targets, fence = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            line = re.sub(r"`[^`]*`", "", line)
            targets += re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", line)
    return targets


def test_the_link_parsers() -> None:
    text = ("# A `watch` title\n[a](docs/x.md#b) `[c](not/a/link)`\n```\n[d](e)\n```\n"
            "## DDP and FSDP\n")
    assert links(text) == ["docs/x.md#b"]
    assert slugs(text) == {"a-watch-title", "ddp-and-fsdp"}


def _relative_links() -> list[str]:
    return sorted({t for t in links(README.read_text(encoding="utf-8"))
                   if not re.match(r"[a-z]+:", t)})


def test_the_readme_links_to_the_docs() -> None:
    assert any(t.startswith("docs/") for t in _relative_links())


@pytest.mark.parametrize("target", _relative_links())
def test_every_relative_link_of_the_readme_resolves(target: str) -> None:
    path, _, anchor = target.partition("#")
    file = (README.parent / path).resolve() if path else README
    assert file.is_file(), f"README.md links to {target}, and {path} is no file"
    if anchor:
        assert anchor in slugs(file.read_text(encoding="utf-8")), (
            f"README.md links to {target}, and {path or 'README.md'} has no such heading")


# -- the HTML report's screenshot, made by the docs build -----------------------------------


def _reportshot():
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        return importlib.import_module("reportshot")
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))


class _App:
    def __init__(self, srcdir: Path, mode: object = "auto") -> None:
        self.srcdir = srcdir
        self.config = type("Config", (), {"graddebug_report_screenshot": mode})()


def test_without_a_browser_the_build_shows_a_placeholder_unless_one_is_required(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shot = _reportshot()
    warned: list[str] = []
    monkeypatch.setattr(shot, "browser", lambda: None)
    monkeypatch.setattr(shot.logger, "warning", lambda msg, *args: warned.append(msg % args))
    shot.make_screenshot(_App(tmp_path, "require"))  # CI: a missing browser fails the build
    assert len(warned) == 1 and "no Chromium" in warned[0]
    assert not (tmp_path / shot.TARGET).exists()
    for mode in ("auto", "0", False):  # a machine without one: a placeholder, and no warning
        (tmp_path / shot.TARGET).unlink(missing_ok=True)
        shot.make_screenshot(_App(tmp_path, mode))
        assert len(warned) == 1
        from matplotlib.image import imread

        pixels = imread(tmp_path / shot.TARGET)[..., :3]
        assert (pixels < 0.5).any(), "the placeholder says nothing"


def test_a_failing_browser_is_a_warning_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shot = _reportshot()
    warned: list[str] = []
    monkeypatch.setattr(shot, "browser", lambda: "/bin/false")
    monkeypatch.setattr(shot, "demo_page", lambda: "<html><body>a page</body></html>")
    monkeypatch.setattr(shot.logger, "warning", lambda msg, *args: warned.append(msg % args))
    shot.make_screenshot(_App(tmp_path))
    assert len(warned) == 1 and "chromium exited with 1" in warned[0]


@pytest.mark.slow
def test_the_screenshot_shows_the_demo_runs_report(tmp_path: Path) -> None:
    import os

    shot = _reportshot()
    chromium = shot.browser()
    if chromium is None:
        if os.environ.get("GRADDEBUG_REQUIRE_BROWSER") or os.environ.get("CI"):
            pytest.fail("no Chromium on PATH, and this environment requires the browser")
        pytest.skip("no Chromium on PATH (apt-get install chromium)")
    page = shot.demo_page(steps=5)
    assert "vanishing" in page  # the demo's finding is on the page that is shot
    target = tmp_path / "report.png"
    shot.screenshot(page, target, chromium)
    from matplotlib.image import imread

    pixels = imread(target)[..., :3]
    assert pixels.shape[:2] == (shot.HEIGHT, shot.WIDTH)
    assert (pixels < 0.95).any(axis=-1).mean() > 0.10, "the screenshot is mostly blank"


@pytest.mark.slow
def test_the_reference_documents_every_public_name(tmp_path: Path) -> None:
    import subprocess
    import sys

    import graddebug

    out = tmp_path / "html"
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-b", "html", "-D",
         "graddebug_report_screenshot=0", str(ROOT / "docs"), str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (out / "reference" / "graddebug.html").read_text(encoding="utf-8")
    missing = [name for name in graddebug.__all__ if f'id="graddebug.{name}"' not in page]
    assert not missing, f"not in the API reference: {missing}"


# -- the graddebug commands of the docs' shell blocks --------------------------------------


def _documented_commands() -> list[tuple[str, str]]:
    """Every ``graddebug ...`` line of a ```bash block of the README and the docs pages, its
    comment stripped, with the file it is in."""
    from test_readme import _name, documents

    found = []
    for path in documents():
        text = path.read_text(encoding="utf-8")
        for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
            for line in block.splitlines():
                command = line.split("#", 1)[0].strip()
                if command.startswith("graddebug "):
                    found.append((_name(path), command))
    return found


def test_the_docs_show_graddebug_commands() -> None:
    commands = {command.split()[1] for _, command in _documented_commands()}
    assert {"demo", "report", "compare"} <= commands


@pytest.mark.parametrize(("where", "command"), _documented_commands())
def test_every_documented_graddebug_command_runs(
        where: str, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    import runs
    from graddebug.cli import main

    pytest.importorskip("pyarrow")
    args = shlex.split(command)[1:]
    monkeypatch.chdir(tmp_path)
    for token in args:  # the runs a command reads: small recorded runs saved there
        if token.startswith("runs/"):
            runs.report(runs.records(steps=3, layers=("embed", "head"))).save(tmp_path / token)
    code = main(args)
    out = capsys.readouterr()
    # 0: healthy, 1: the run has error findings; 2 would be a bad run or a bad argument
    assert code in (0, 1), f"{where}: `{command}` exited with {code}: {out.err[-2000:]}"
    for token in args:
        if token.endswith((".html", ".csv", ".json")):
            assert (tmp_path / token).stat().st_size > 0, f"{where}: {token} not written"


# -- the defaults the docs quote ----------------------------------------------------------


def _quoted_defaults(text: str) -> list[tuple[str, str]]:
    """The ``name=value`` code spans of ``text`` whose name is a field of ``Thresholds``."""
    import graddebug

    fields = {f.name for f in dataclasses.fields(graddebug.Thresholds)}
    return [(name, value) for name, value in re.findall(r"`(\w+)=([-+.\w]+)`", text)
            if name in fields]


@pytest.mark.parametrize("page", ["README.md", "docs/diagnoses.md"])
def test_the_defaults_the_diagnoses_tables_quote_are_the_thresholds_defaults(page: str) -> None:
    import graddebug

    defaults = graddebug.Thresholds()
    quoted = _quoted_defaults((ROOT / page).read_text(encoding="utf-8"))
    assert len(quoted) >= 12, f"{page} quotes only {quoted}"
    wrong = [(name, value, getattr(defaults, name)) for name, value in quoted
             if float(value) != float(getattr(defaults, name))]
    assert not wrong, f"{page} quotes defaults that are not Thresholds': {wrong}"


def test_each_default_line_of_the_diagnoses_page_names_its_thresholds() -> None:
    # "**Default:** `100`, `5`" leaves the reader to match values to names by position, which
    # went wrong once; every value is written as name=value.
    page = (ROOT / "docs" / "diagnoses.md").read_text(encoding="utf-8")
    lines = re.findall(r"\*\*Default:\*\* (.*?)\. \*\*Why", page)
    assert len(lines) >= 10
    for line in lines:
        spans = re.findall(r"`([^`]*)`", line)
        assert line.strip() == "-" or (spans and all("=" in span for span in spans)), line
