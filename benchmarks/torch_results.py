"""What ``overhead_torch.py`` measures of one (workload, config) pair, and how it reports it:
the table, the environment and the JSON file."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from ratios import BOOTSTRAP_RESAMPLES
from rich.table import Table

import graddebug

__all__ = ["Result", "environment", "results_table", "write_json"]


@dataclass
class Result:
    """The measurements of one (workload, config) pair.

    Attributes:
        workload: Workload name.
        config: Config key.
        label: Config label.
        target: The ratio the config must stay under.
        plain_ms: Median over the rounds paired with this config of the plain step time (ms).
        watched_ms: Median over rounds of the watched step time (ms).
        ratio: Median over every pair of (watched / plain) step time; with ``every=N``, the
            :func:`position_ratio` over the positions of a round.
        ratio_q1: First quartile of the per-round ratios.
        ratio_q3: Third quartile of the per-round ratios.
        ratio_low: Lower end of the 95% bootstrap interval of ``ratio`` (the rounds resampled
            with replacement, ``ratio`` taken again from each resample).
        ratio_high: Its upper end.
        ratio_best: Fastest watched round over fastest plain round (round medians; with
            ``every=N``, round means); on a busy machine it shows
            the overhead with the least interference.
        passed: ``ratio <= target``.
        verdict: ``"pass"`` when the whole interval lies under the target, ``"FAIL"`` when it
            lies above, ``"within noise"`` when it holds the target.
        rows_per_step: Frame rows (recorded tensors) per watched step.
        findings: Findings the watcher raised over the run (a healthy model should give 0).
        enter_exit_ms: Median time to enter and leave the ``with`` block (not in the ratio).
        round_ratios: Every round's ratio, in round order: the median of its pairs' ratios;
            with ``every=N``, its mean watched step over its mean plain step.
        plain_round_ms: Every plain round's median step time (ms).
        watched_round_ms: Every watched round's median step time (ms); with ``every=N``,
            the rounds' means (ms).
        plain_steps_ms: Every plain step's time (ms), per round, in pair order.
        watched_steps_ms: Every watched step's time (ms), per round: its k-th step ran
            right before or after the k-th plain step of the round.
        compiled: Both sides ran under ``torch.compile``.
        graph_breaks_plain: Graph breaks over the census steps of the plain compiled model
            (-1 when not compiled).
        graph_breaks_watched: The same, watched under this config.
        graphs_plain: Graphs dynamo compiled over the census steps, plain (-1: not compiled).
        graphs_watched: The same, watched under this config.
    """

    workload: str
    config: str
    label: str
    target: float
    plain_ms: float = math.nan
    watched_ms: float = math.nan
    ratio: float = math.nan
    ratio_q1: float = math.nan
    ratio_q3: float = math.nan
    ratio_low: float = math.nan
    ratio_high: float = math.nan
    ratio_best: float = math.nan
    passed: bool = False
    verdict: str = ""
    rows_per_step: float = math.nan
    findings: int = 0
    enter_exit_ms: float = math.nan
    round_ratios: list[float] = field(default_factory=list)
    plain_round_ms: list[float] = field(default_factory=list)
    watched_round_ms: list[float] = field(default_factory=list)
    plain_steps_ms: list[list[float]] = field(default_factory=list)
    watched_steps_ms: list[list[float]] = field(default_factory=list)
    compiled: bool = False
    graph_breaks_plain: int = -1
    graph_breaks_watched: int = -1
    graphs_plain: int = -1
    graphs_watched: int = -1


def results_table(results: Sequence[Result], title: str) -> Table:
    """Build the summary table.

    Args:
        results: One result per (workload, config).
        title: The table's title.

    Returns:
        A rich table with one row per result.
    """
    table = Table(title=title, title_justify="left")
    table.add_column("workload")
    table.add_column("config")
    compiled = any(res.compiled for res in results)
    columns = ["plain ms/step", "watched ms/step", "ratio", "95% interval", "best/best",
               "target", "rows/step"]
    if compiled:
        columns += ["breaks plain/watched", "graphs plain/watched"]
    for col in columns:
        table.add_column(col, justify="right")
    table.add_column("result")
    for res in results:
        colour = {"pass": "green", "FAIL": "red"}.get(res.verdict, "yellow")
        verdict = f"[{colour}]{res.verdict}[/{colour}]"
        cells = [res.workload, res.label, f"{res.plain_ms:.2f}", f"{res.watched_ms:.2f}",
                 f"{res.ratio:.3f}", f"{res.ratio_low:.3f}-{res.ratio_high:.3f}",
                 f"{res.ratio_best:.3f}", f"<={res.target:.2f}", f"{res.rows_per_step:.0f}"]
        if compiled:
            cells += [f"{res.graph_breaks_plain}/{res.graph_breaks_watched}",
                      f"{res.graphs_plain}/{res.graphs_watched}"]
        table.add_row(*cells, verdict)
    return table


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def environment() -> dict[str, Any]:
    """Describe the machine, the library versions and the commit measured, for the JSON file."""
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        # Uncommitted changes to the library make the commit alone an incomplete description.
        "library_modified": bool(_git("status", "--porcelain", "--", "../src", "../adapters")),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "graddebug": graddebug.__version__,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: Path, results: Sequence[Result], settings: dict[str, Any]) -> None:
    """Write the settings, the environment and every measurement to ``path``.

    Args:
        path: Output file; its folder is created.
        results: One result per (workload, config).
        settings: The command-line settings of the run.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "overhead_torch",
        "method": "twin models in one process; single steps timed in pairs (one plain, one "
                  "watched, back to back, the order flipping from pair to pair and round to "
                  "round); ratio: the median over every pair of watched/plain (with every=N: "
                  "for each position in the round, the median over the rounds of its pairs' "
                  "ratios, averaged over the positions); configs take turns round by round; "
                  "enter/exit of the with block not in the steps; ratio_low/ratio_high: 95% "
                  f"percentile bootstrap interval over {BOOTSTRAP_RESAMPLES} resamples of the "
                  "rounds (seed 0)",
        "settings": settings,
        "environment": environment(),
        "results": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
