"""The self-contained HTML report, read as text and rendered by a real browser."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import graddebug
import runs
from graddebug.runs.writer import RunWriter

pytest.importorskip("matplotlib")
pytest.importorskip("pyarrow")

EVIL = "<script>alert('x')</script>"
LAYERS = ("embed", EVIL, "block & co", "head")


@pytest.fixture(scope="module")
def page() -> str:
    report = runs.report(runs.records(layers=LAYERS, nan_at=(5, EVIL)),
                         metadata={"model": "My<Model>", "framework": "torch"})
    return report.to_html()


def test_page_embeds_both_figures_as_png(page: str) -> None:
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [alt.split()[0] for alt, _ in images] == ["gradient", "heatmap"]
    for _, data in images:
        png = base64.b64decode(data)
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(png) > 10_000  # a real plot, not a placeholder


def test_page_is_self_contained(page: str) -> None:
    assert "<script" not in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<link" not in page


def test_user_strings_are_escaped(page: str) -> None:
    assert EVIL not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "block &amp; co" in page
    assert "My&lt;Model&gt;" in page


def test_page_lists_findings_and_metadata(page: str) -> None:
    assert "Findings by issue" in page
    issues = page[page.index("Findings by issue"):page.index("<h2>Gradient flow")]
    assert "<td>nonfinite</td><td>error</td>" in issues
    everything = page[page.index("<h2>All findings"):page.index("<h2>Per-layer summary")]
    assert everything.count('<tr class="error">') == 1
    assert "gradient" in everything and "&lt;script&gt;" in everything
    assert "1 error finding(s)" in page
    assert "<h2>Metadata</h2>" in page and "vanishing_ratio" in page


def test_an_unfinished_run_says_so(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path / "run", flush_every=1)
    writer.start({"model": "M"}, graddebug.Thresholds().as_dict())
    writer.flush(runs.records(steps=3), [], [])
    page = graddebug.load(tmp_path / "run").to_html()
    assert "This run did not finish" in page
    assert "recovered 3 recorded steps, up to step 2" in page


CHROMIUM = "/usr/bin/chromium"


def _browser() -> str:
    if Path(CHROMIUM).is_file():
        return CHROMIUM
    if os.environ.get("GRADDEBUG_REQUIRE_BROWSER") or os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing, and this environment requires the browser test "
                    "(GRADDEBUG_REQUIRE_BROWSER or CI is set); install the Debian packages "
                    "chromium and chromium-driver.")
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium chromium-driver); "
                "CI installs it and runs this test")


def _screenshot(tmp_path: Path, page: str, width: int, height: int) -> np.ndarray:
    """Render ``page`` in headless chromium; return the screenshot's RGB pixels."""
    browser = _browser()
    html = tmp_path / "report.html"
    html.write_text(page, encoding="utf-8")
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         f"--screenshot={shot}", f"--window-size={width},{height}", html.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    from matplotlib.image import imread

    return imread(shot)[..., :3]


@pytest.mark.slow
def test_a_real_browser_renders_the_page(tmp_path: Path, page: str) -> None:
    pixels = _screenshot(tmp_path, page, 1200, 1600)
    assert pixels.shape[:2] == (1600, 1200)
    non_white = np.any(pixels < 0.95, axis=-1).mean()
    colours = len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert non_white > 0.10, f"only {non_white:.1%} of the page is not white"
    assert colours > 500, f"only {colours} distinct colours: the plots did not render"
    # the viridis heatmap shows up in the lower half of the first screen
    lower = pixels[800:]
    viridis_like = (lower[..., 2] > lower[..., 0] + 0.15) & (lower[..., 1] > 0.2)
    assert viridis_like.mean() > 0.02


# -- the notebook view (_repr_html_) ------------------------------------------------------------


@pytest.fixture(scope="module")
def notebook() -> str:
    return runs.report(runs.records(layers=LAYERS, nan_at=(5, EVIL)))._repr_html_()


def test_notebook_view_lists_findings_and_a_flow_plot(notebook: str) -> None:
    assert "<script" not in notebook and EVIL not in notebook
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in notebook
    assert "12 recorded step(s), 8 tensor(s)" in notebook
    assert '<tr class="error">' in notebook and "<td>nonfinite</td>" in notebook
    (data,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', notebook)
    assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")


def test_notebook_view_of_a_healthy_run_has_no_table() -> None:
    view = runs.healthy()._repr_html_()
    assert "no finding: the gradients look healthy" in view
    assert "<table" not in view and "data:image/png" in view


def test_a_watcher_shows_the_run_so_far() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with graddebug.watch(model) as dbg:
        assert "0 recorded step(s)" in dbg._repr_html_()
        model(torch.randn(2, 3)).sum().backward()
        dbg.step()
        view = dbg._repr_html_()
    assert "1 recorded step(s), 7 tensor(s)" in view
    assert "data:image/png" in view


@pytest.mark.slow
def test_a_real_browser_renders_the_notebook_view(tmp_path: Path, notebook: str) -> None:
    page = f'<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>{notebook}</body></html>'
    pixels = _screenshot(tmp_path, page, 900, 700)
    assert pixels.shape[:2] == (700, 900)
    non_white = np.any(pixels < 0.95, axis=-1).mean()
    colours = len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert non_white > 0.04, f"only {non_white:.1%} of the view is not white"
    assert colours > 100, f"only {colours} distinct colours: the plot did not render"
    # the flow plot's blue activation line and band are on screen
    blue = pixels[..., 2] > pixels[..., 0] + 0.1
    assert blue.mean() > 0.003
