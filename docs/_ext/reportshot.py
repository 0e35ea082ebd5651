"""A screenshot of the HTML report, made by the docs build from a demo run.

At the start of each build the extension trains graddebug's demo model (the installed adapters'
``graddebug_demo`` hook, as ``graddebug demo`` does), writes the run's HTML report and renders
it in headless Chromium to ``_static/generated/report.png``, which ``docs/reports.md`` shows.
Nothing is pasted in by hand, so the picture is always the report of the code being documented.

``graddebug_report_screenshot`` says how hard to try: ``"auto"`` (the default) takes the
screenshot where a Chromium is on ``PATH`` and else puts a placeholder in its place, with a note
in the build's log, so that the strict build works on a machine without a browser;
``"require"`` (CI, ``-D graddebug_report_screenshot=require``) makes a missing browser a Sphinx
warning, which fails the strict build; ``"off"`` (or ``0``) always uses the placeholder. A demo
or a browser that fails is a warning either way.
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


def placeholder(target: Path, why: str) -> None:
    """Write a plain PNG that says why the screenshot is not there."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    target.parent.mkdir(parents=True, exist_ok=True)
    fig = plt.figure(figsize=(8, 1.2), dpi=100)
    fig.text(0.5, 0.5, f"The HTML report's screenshot is not in this build: {why}.\n"
             "Run graddebug demo --html report.html to see the page.",
             ha="center", va="center", fontsize=11)
    fig.savefig(target)
    plt.close(fig)


def _mode(value: object) -> str:
    """``"auto"``, ``"require"`` or ``"off"`` from the config value (a string from ``-D``)."""
    text = str(value).strip().lower()
    if text in ("0", "false", "off", "no"):
        return "off"
    return "require" if text in ("1", "true", "require", "required", "yes") else "auto"


def make_screenshot(app: Sphinx) -> None:
    """``builder-inited``: write the screenshot (or its placeholder) into the source tree's
    ``_static/generated``."""
    mode = _mode(app.config.graddebug_report_screenshot)
    target = Path(app.srcdir) / TARGET
    chromium = browser() if mode != "off" else None
    if chromium is None:
        if mode == "require":
            logger.warning("no Chromium on PATH for the HTML report's screenshot (%s); install "
                           "chromium, or build with -D graddebug_report_screenshot=auto",
                           TARGET)
            return
        why = "it was turned off" if mode == "off" else "no Chromium was found on this machine"
        logger.info("graddebug: %s for the HTML report's screenshot; a placeholder stands in",
                    why)
        placeholder(target, why)
        return
    try:
        screenshot(demo_page(), target, chromium)
    except Exception as exc:  # any failure is a warning: -W turns it into a failed build
        logger.warning("the HTML report's screenshot failed: %s", exc)


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the option and the build step."""
    app.add_config_value("graddebug_report_screenshot", "auto", "env", (str, bool))
    app.connect("builder-inited", make_screenshot)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
