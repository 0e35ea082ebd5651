"""Cost of ``watch(log_dir=...)``: step time, memory over a long run, and ``graddebug report``.

Run by hand (a benchmark, not a test)::

    python benchmarks/streaming.py                      # all three parts
    python benchmarks/streaming.py overhead --workloads mlp --rounds 9
    python benchmarks/streaming.py memory --steps 10000
    python benchmarks/streaming.py report

``overhead``: config (b) of ``overhead_torch.py`` (``watch(model)``, every step), with and without
``log_dir``. Three copies of the same model train side by side: plain, watched, and watched with
``log_dir``; each watcher is entered once for the whole benchmark, as in a real run. The three
copies take turns step by step (the order rotates), so that load from elsewhere hits them alike.
A round is ``flush_every`` steps of each, so exactly one flush falls in each logged round. Every
step is timed on its own and a round's value is the median step, plus, for the logged copy, the
measured time of that round's flush spread over its steps. The table quotes medians over rounds
of the step-time ratios over plain, and the streaming cost as the difference of the two.

``memory``: a 20-layer MLP recorded for 10,000 steps in a fresh process per mode, with
``log_dir`` and without; the resident set size (RSS) is sampled every 1,000 steps.

``report``: a synthetic run of 10,000 steps x 40 tensors, streamed in 100 parts, then
``graddebug report`` (text, JSON, ``--html``) timed as a user runs it: a new process each time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results" / "streaming.json"


# -- overhead ---------------------------------------------------------------------------------


def overhead(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """Time plain, watched and watched+log_dir steps of each workload.

    Args:
        args: The command line: ``workloads``, ``rounds`` and ``flush_every``.
        console: Where to print the rounds and the table.

    Returns:
        One summary a workload, in ``args.workloads`` order.
    """
    from graddebug.runs.writer import RunWriter

    flush_ms: list[float] = []
    original = RunWriter.flush

    def timed_flush(self: RunWriter, *a: Any) -> None:
        started = time.perf_counter()
        original(self, *a)
        flush_ms.append((time.perf_counter() - started) * 1e3)

    RunWriter.flush = timed_flush  # type: ignore[method-assign]
    try:
        out = [_overhead_workload(name, args.rounds, args.flush_every, flush_ms, console)
               for name in args.workloads.split(",")]
    finally:
        RunWriter.flush = original  # type: ignore[method-assign]
    console.print(_overhead_table(out))
    return out


def _overhead_workload(name: str, rounds: int, steps: int, flush_ms: list[float],
                       console: Console) -> dict[str, Any]:
    """Rounds of ``steps`` steps of the three copies of one workload; ``flush_ms`` collects
    the logged watcher's flushes (ms) as they happen."""
    import torch
    from torch_workloads import build_workload

    import graddebug

    flush_ms.clear()
    device = torch.device("cpu")
    works = {v: build_workload(name, device) for v in ("plain", "watched", "logged")}
    tmp = tempfile.mkdtemp(prefix="graddebug-bench-")
    watched = graddebug.watch(works["watched"].model)
    logged = graddebug.watch(works["logged"].model, log_dir=Path(tmp) / "run",
                             flush_every=steps)
    ratios: dict[str, list[float]] = {"watched": [], "logged": []}
    plain_ms: list[float] = []
    console.print(f"[bold]{name}[/bold]: {works['plain'].description}; rounds of "
                  f"{steps} steps, the three copies interleaved step by step")
    with watched, logged:
        dbgs = {"plain": None, "watched": watched, "logged": logged}
        for r in range(-1, rounds):
            flushes = len(flush_ms)
            times = _interleaved_round(works, dbgs, steps)
            if r < 0:
                continue
            # Medians resist load from elsewhere but hide the one step of the round that
            # flushed: add the measured flush time back, spread over the round's steps.
            flush_s = sum(flush_ms[flushes:]) / 1e3
            median = {v: statistics.median(t) for v, t in times.items()}
            plain = median["plain"]
            plain_ms.append(plain * 1e3)
            ratios["watched"].append(median["watched"] / plain)
            ratios["logged"].append((median["logged"] + flush_s / steps) / plain)
            console.print(f"  round {r + 1}/{rounds}: plain {plain * 1e3:.2f} ms, "
                          f"(b) {ratios['watched'][-1]:.3f}, (b)+log_dir "
                          f"{ratios['logged'][-1]:.3f}, flush {flush_s * 1e3:.1f} ms",
                          style="dim")
    added = [b - a for a, b in zip(ratios["watched"], ratios["logged"], strict=True)]
    return {
        "workload": name,
        "plain_ms": statistics.median(plain_ms),
        "ratio_watched": statistics.median(ratios["watched"]),
        "ratio_logged": statistics.median(ratios["logged"]),
        "added_by_log_dir": statistics.median(added),
        "flush_ms_median": statistics.median(flush_ms) if flush_ms else None,
        "flushes": len(flush_ms),
        "flush_every": steps,
        "rounds": rounds,
        "round_ratios": ratios,
    }


def _interleaved_round(works: dict[str, Any], dbgs: dict[str, Any], steps: int
                       ) -> dict[str, list[float]]:
    """``steps`` steps of each copy, taking turns step by step, the order rotating; every
    step's seconds, per copy."""
    from torch_workloads import train_step

    order = ["plain", "watched", "logged"]
    times: dict[str, list[float]] = {v: [] for v in order}
    for i in range(steps):
        for variant in order[i % 3:] + order[:i % 3]:
            work, dbg = works[variant], dbgs[variant]
            started = time.perf_counter()
            train_step(work, dbg)
            times[variant].append(time.perf_counter() - started)
    return times


def _overhead_table(out: list[dict[str, Any]]) -> Table:
    table = Table(title="config (b) with and without log_dir: step time over plain "
                        "(median of rounds)", title_justify="left")
    for col in ("workload", "plain ms/step", "(b)", "(b) + log_dir", "added", "ms per flush"):
        table.add_column(col, justify="right" if col != "workload" else "left")
    for row in out:
        table.add_row(row["workload"], f"{row['plain_ms']:.2f}", f"{row['ratio_watched']:.3f}",
                      f"{row['ratio_logged']:.3f}", f"{row['added_by_log_dir'] * 100:+.2f}%",
                      f"{row['flush_ms_median']:.1f}" if row["flush_ms_median"] else "-")
    return table


# -- memory -----------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(steps: int, log_dir: str | None) -> dict[str, Any]:
    """Train a 20-layer MLP under watch() for ``steps`` steps; sample the RSS."""
    import torch
    from torch import nn

    import graddebug

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(20):
        layers.append(nn.Linear(32, 32))
        if i < 19:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    samples: list[tuple[int, float]] = []
    options: dict[str, Any] = {"log_dir": log_dir} if log_dir else {}
    started = time.perf_counter()
    with graddebug.watch(model, **options) as dbg:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            dbg.step()
            opt.step()
            if (step + 1) % 1000 == 0 or step == 99:
                samples.append((step + 1, _rss_mb()))
        train_s = time.perf_counter() - started
        exit_started = time.perf_counter()
    exit_s = time.perf_counter() - exit_started
    return {"log_dir": bool(log_dir), "rss_mb": samples, "train_s": train_s, "exit_s": exit_s,
            "rows": len(dbg.frame()), "rss_after_exit_mb": _rss_mb()}


def memory(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """Run :func:`memory_child` in a fresh process, with and without log_dir."""
    out = []
    for logged in (True, False):
        with tempfile.TemporaryDirectory(prefix="graddebug-bench-") as tmp:
            command = [sys.executable, __file__, "memory-child", "--steps", str(args.steps)]
            if logged:
                command += ["--log-dir", str(Path(tmp) / "run")]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            out.append(json.loads(done.stdout.splitlines()[-1]))
    table = Table(title=f"RSS (MB) of a 20-layer MLP (79 rows/step) over {args.steps} recorded "
                        "steps", title_justify="left")
    table.add_column("step", justify="right")
    for row in out:
        table.add_column("with log_dir" if row["log_dir"] else "in memory", justify="right")
    for i, (step, _) in enumerate(out[0]["rss_mb"]):
        table.add_row(str(step), *(f"{row['rss_mb'][i][1]:.0f}" for row in out))
    console.print(table)
    for row in out:
        console.print(f"{'log_dir' if row['log_dir'] else 'in memory'}: {row['rows']:,} rows, "
                      f"train {row['train_s']:.1f} s, leaving the with block {row['exit_s']:.2f} "
                      f"s, RSS after it {row['rss_after_exit_mb']:.0f} MB")
    return out


# -- report -----------------------------------------------------------------------------------


def build_run(path: Path, steps: int, layers: int) -> None:
    """Stream a synthetic run as a Watcher would: ``layers`` x (output, weight), 100 parts."""
    import math

    from graddebug import Thresholds
    from graddebug.diagnosis import diagnose
    from graddebug.records import Record
    from graddebug.runs.writer import RunWriter

    writer = RunWriter(path, flush_every=100)
    thresholds = Thresholds()
    writer.start({"framework": "synthetic", "model": "Bench"}, thresholds.as_dict())
    names = [f"encoder.layers.{i}.linear" for i in range(layers)]
    chunk: list[Record] = []
    for step in range(steps):
        for depth, layer in enumerate(names):
            for kind, tensor in (("activation", "output"), ("parameter", "weight")):
                norm = (1 + 0.05 * depth) * (1 + 0.1 * math.sin(step / 50 + depth))
                bad = layer == names[layers // 2] and step >= steps - 500 and kind == "activation"
                norm = math.nan if bad else norm
                chunk.append(Record(step, layer, tensor, kind, depth, "(64, 256)", 16384, norm,
                                    0.0, norm / 128, norm / 10, 0.0, bad, False))
        if (step + 1) % 100 == 0:
            writer.flush(chunk, [], [])
            chunk = []
    records, events = writer.read([], [])
    writer.finish(records, events, diagnose(records, events, thresholds),
                  {"framework": "synthetic", "model": "Bench"}, thresholds.as_dict())


def report(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Time ``graddebug report`` on a run of ``--report-steps`` x 40 tensors."""
    import graddebug

    with tempfile.TemporaryDirectory(prefix="graddebug-bench-") as tmp:
        run = Path(tmp) / "run"
        started = time.perf_counter()
        build_run(run, args.report_steps, 20)
        console.print(f"built {args.report_steps} steps x 40 tensors in "
                      f"{time.perf_counter() - started:.1f} s")
        started = time.perf_counter()
        loaded = graddebug.load(run)
        load_s = time.perf_counter() - started
        size = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
        commands = {
            "report (text)": ["report", str(run)],
            "report --format json": ["report", str(run), "--format", "json"],
            "report --html": ["report", str(run), "--html", str(Path(tmp) / "r.html")],
            "compare": ["compare", str(run), str(run)],
        }
        timings: dict[str, float] = {}
        for label, argv in commands.items():
            walls = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "graddebug.cli", *argv],
                                      capture_output=True, text=True)
                walls.append(time.perf_counter() - started)
                if done.returncode not in (0, 1):
                    raise RuntimeError(done.stderr)
            timings[label] = statistics.median(walls)
    table = Table(title=f"graddebug on a run of {len(loaded.frame()):,} rows "
                        f"({args.report_steps} steps x 40 tensors, 100 parts, "
                        f"{size / 2**20:.1f} MB): wall seconds, a new process each, median of "
                        f"{args.repeat}", title_justify="left")
    table.add_column("command")
    table.add_column("seconds", justify="right")
    table.add_row("graddebug.load() in-process", f"{load_s:.2f}")
    for label, wall in timings.items():
        table.add_row(f"graddebug {label}", f"{wall:.2f}")
    console.print(table)
    return {"rows": len(loaded.frame()), "bytes": size, "load_s": load_s, "cli_s": timings}


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    """Parse the command line and run the chosen parts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", default="all",
                        choices=("all", "overhead", "memory", "report", "memory-child"))
    parser.add_argument("--workloads", default="mlp,cnn", help="for overhead (default mlp,cnn)")
    parser.add_argument("--rounds", type=int, default=9, help="overhead rounds (default 9)")
    parser.add_argument("--flush-every", type=int, default=100,
                        help="log_dir flush interval and round length (default 100)")
    parser.add_argument("--steps", type=int, default=10_000, help="memory: recorded steps")
    parser.add_argument("--report-steps", type=int, default=10_000, help="report: run length")
    parser.add_argument("--repeat", type=int, default=3, help="report: runs per command")
    parser.add_argument("--log-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write results")
    args = parser.parse_args()
    if args.part == "memory-child":
        print(json.dumps(memory_child(args.steps, args.log_dir)))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(f"{os.cpu_count()} CPUs; {os.uname().sysname} {os.uname().release}")
    results: dict[str, Any] = {}
    if args.part in ("all", "overhead"):
        results["overhead"] = overhead(args, console)
    if args.part in ("all", "memory"):
        results["memory"] = memory(args, console)
    if args.part in ("all", "report"):
        results["report"] = report(args, console)
    previous = json.loads(args.json.read_text()) if args.json.is_file() else {}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**previous, **results,
                                     "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")},
                                    indent=1) + "\n")
    console.print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
