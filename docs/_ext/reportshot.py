"""A screenshot of the HTML report, made by the docs build from a demo run.

At the start of each build the extension trains graddebug's demo model (the installed adapters'
``graddebug_demo`` hook, as ``graddebug demo`` does), writes the run's HTML report and renders
it in headless Chromium to ``_static/generated/report.png``, which ``docs/reports.md`` shows.
Nothing is pasted in by hand, so the picture is always the report of the code being documented.

A missing browser, a demo that fails or a browser that fails is a Sphinx warning, which fails the
strict build. Set ``graddebug_report_screenshot = False`` (``-D graddebug_report_screenshot=0``)
to build without it where no Chromium is installed.
"""

from __future__ import annotations

import logging as std_logging
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WIDTH, HEIGHT = 1200, 1500
TARGET = Path("_static") / "generated" / "report.png"


def browser() -> str | None:
    """The path of a headless-capable Chromium on ``PATH``, or None."""
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def demo_page(steps: int = 20, seed: int = 0) -> str:
    """The HTML report of the demo run, as ``graddebug demo`` trains it."""
    from graddebug.plugins import get_plugin_manager

    # The live finding lines of the demo's steps are for a terminal, not for the build's log.
    live = std_logging.getLogger("graddebug")
    level = live.level
    live.setLevel(std_logging.ERROR)
    try:
        report = get_plugin_manager().hook.graddebug_demo(steps=steps, seed=seed)
    finally:
        live.setLevel(level)
    if report is None:
        raise RuntimeError("no installed adapter offers a demo (install graddebug[torch])")
    return str(report.to_html())


def screenshot(page: str, target: Path, chromium: str) -> None:
    """Render the HTML text ``page`` in headless ``chromium`` into the PNG file ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "report.html"
        html.write_text(page, encoding="utf-8")
        done = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--no-first-run",
             f"--user-data-dir={Path(tmp) / 'profile'}", f"--screenshot={target}",
             f"--window-size={WIDTH},{HEIGHT}", html.as_uri()],
            capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0 or not target.is_file():
        raise RuntimeError(f"chromium exited with {done.returncode}: {done.stderr[-500:]}")


def make_screenshot(app: Sphinx) -> None:
    """``builder-inited``: write the screenshot into the source tree's ``_static/generated``."""
    if not app.config.graddebug_report_screenshot:
        return
    target = Path(app.srcdir) / TARGET
    chromium = browser()
    if chromium is None:
        logger.warning("no Chromium on PATH for the HTML report's screenshot (%s); install "
                       "chromium, or build with -D graddebug_report_screenshot=0", TARGET)
        return
    try:
        screenshot(demo_page(), target, chromium)
    except Exception as exc:  # any failure is a warning: -W turns it into a failed build
        logger.warning("the HTML report's screenshot failed: %s", exc)


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the option and the build step."""
    app.add_config_value("graddebug_report_screenshot", True, "env", bool)
    app.connect("builder-inited", make_screenshot)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
