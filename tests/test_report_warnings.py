"""Rendering and loading runs prints nothing but what the user asked for: no matplotlib warning
from graddebug's own figures (CJK layer names, collapsed layouts), no unclosed file when a
run's JSON file is malformed, and the user's matplotlib settings left as they were."""

from __future__ import annotations

import gc
import io
import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import graddebug
import runs
from graddebug.errors import CorruptRunError
from graddebug.report.fonts import fallback_families
from graddebug.report.plots import figure_png, flow_figure, heatmap_figure

matplotlib = pytest.importorskip("matplotlib")
pytest.importorskip("pyarrow")

CJK = ("层1", "注意力")


def _saved_run(path: Path, layers: tuple[str, ...], steps: int) -> Path:
    """A run of ``layers`` over ``steps`` steps, saved to ``path`` as ``graddebug report`` reads
    it."""
    runs.report(runs.records(steps=steps, layers=layers)).save(path)
    return path


@pytest.fixture(scope="module")
def cjk_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_run(tmp_path_factory.mktemp("runs") / "cjk", CJK, steps=3)


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_run(tmp_path_factory.mktemp("runs") / "one", CJK[:1], steps=1)


@pytest.fixture
def no_warning() -> Iterator[None]:
    """Every warning raised in the block is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _render(run: Path) -> str:
    report = graddebug.load(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return report.to_html()


def test_the_html_of_a_run_with_cjk_layer_names_emits_no_warning(cjk_run: Path) -> None:
    page = _render(cjk_run)
    for name in CJK:
        assert name in page


def test_a_run_of_one_step_and_one_layer_renders_without_warning(one_step_run: Path) -> None:
    page = _render(one_step_run)
    assert "1 recorded steps" in page
    assert CJK[0] in page


def test_names_too_long_for_the_figure_render_without_warning(no_warning: None) -> None:
    long = "encoder." + "very_long_module_name." * 14 + "proj"
    report = runs.report(runs.records(layers=(long, "head")))
    page = report.to_html()
    assert long in page  # the tables keep the whole name; the figures shorten it


def test_a_run_whose_gradients_are_all_zero_renders(no_warning: None) -> None:
    rows = [r._replace(norm=0.0, mean=0.0, std=0.0, absmax=0.0, zero_frac=1.0)
            for r in runs.records(steps=2)]
    page = runs.report(rows).to_html()
    assert page.count("data:image/png;base64,") == 2


def test_the_command_line_html_report_prints_no_warning(cjk_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-W", "default", "-m", "graddebug.cli", "report", str(cjk_run),
         "--html", str(out), "--no-progress"],
        capture_output=True, text=True, encoding="utf-8", timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    assert "Glyph" not in done.stderr, done.stderr
    assert CJK[1] in out.read_text(encoding="utf-8")


def test_labels_fall_back_to_an_installed_font_that_has_their_glyphs() -> None:
    # U+210A SCRIPT SMALL G: not in DejaVu Sans, in STIXGeneral (shipped with matplotlib).
    name = "gain_\u210a"
    report = runs.report(runs.records(steps=2, layers=(name, "head")))
    family = fallback_families([name])
    assert family is not None and family[0] == matplotlib.rcParams["font.family"][0]
    for fig in (flow_figure(report.frame(), report.findings()),
                heatmap_figure(report.frame(), report.findings())):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # outside graddebug's render: nothing is filtered
            fig.savefig(io.BytesIO(), format="png")


def test_labels_with_no_missing_glyph_keep_the_users_font() -> None:
    assert fallback_families(["embed", "block.0", "é"]) is None


def _rc() -> dict[str, object]:
    # Reading "backend" would resolve matplotlib's automatic backend, a change of its own.
    return {k: matplotlib.rcParams[k] for k in matplotlib.rcParams if k != "backend"}


def test_rendering_leaves_the_users_rcparams_and_warning_filters_as_they_were(
        cjk_run: Path) -> None:
    report = graddebug.load(cjk_run)
    filters = list(warnings.filters)
    with matplotlib.rc_context({"font.family": ["serif"]}):
        before = _rc()
        report.to_html()
        figure_png(report.plot_flow())
        assert _rc() == before
        assert matplotlib.rcParams["font.family"] == ["serif"]
    assert _rc() != before  # the test's own rc_context was undone
    assert warnings.filters == filters


def _load_malformed(run: Path) -> CorruptRunError:
    with pytest.raises(CorruptRunError) as info:
        graddebug.load(run)
    return info.value


@pytest.mark.parametrize("content", [b'{"format": "graddebug-run", "status": ', b"\xff\xfe{",
                                     b""], ids=["truncated", "not-utf8", "empty"])
def test_a_malformed_json_file_raises_the_typed_error_and_leaves_no_file_open(
        tmp_path: Path, content: bytes) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "graddebug.json").write_bytes(content)
    with warnings.catch_warnings(record=True) as seen:
        # "error" would not fail the test: a ResourceWarning is raised from a finaliser, where
        # Python reports an exception instead of raising it. Recording catches it either way.
        warnings.simplefilter("always", ResourceWarning)
        error = _load_malformed(run)
        assert type(error) is CorruptRunError
        assert "is truncated or corrupt" in str(error)
        assert error.path == str(run / "graddebug.json")
        assert error.recoverable == "the Parquet parts, with default thresholds and no metadata"
        del error
        gc.collect()
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []


def test_a_malformed_json_file_is_readable_with_skip_damaged(tmp_path: Path) -> None:
    run = tmp_path / "run"
    runs.healthy().save(run)
    (run / "graddebug.json").write_text(json.dumps({"format": "graddebug-run"})[:-3],
                                        encoding="utf-8")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        loaded = graddebug.load(run, skip_damaged=True)
        gc.collect()
    assert loaded.metadata["run"]["damaged"] == [str(run / "graddebug.json")]
    assert [w for w in seen if issubclass(w.category, ResourceWarning)] == []
