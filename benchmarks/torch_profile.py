"""``overhead_torch.py --profile``: cProfile over the watched steps of one workload, and
graddebug's share of them."""

from __future__ import annotations

import cProfile
import gc
import pstats
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch_configs import Config
from torch_timing import sync, time_steps
from torch_workloads import build_workload, train_step

import graddebug

__all__ = ["ENTRY_POINTS", "GRADDEBUG_DIRS", "profile_workload"]

GRADDEBUG_DIRS: tuple[str, ...] = ("/graddebug/", "/graddebug_torch/")
# The functions through which graddebug's work enters a training step: its hooks
# (graddebug_torch.watching) and Watcher.step.
ENTRY_POINTS: tuple[str, ...] = ("on_forward", "on_grad", "on_param_grad", "step")

# pstats' raw table: (file, line, function) -> (primitive calls, calls, tottime, cumtime,
# callers).
_Raw = dict[Any, Any]


def _is_graddebug(filename: str) -> bool:
    return any(d in filename.replace("\\", "/") for d in GRADDEBUG_DIRS)


def _short(filename: str, line: int, func: str) -> str:
    if filename == "~":
        return func
    parts = Path(filename).parts
    return f"{'/'.join(parts[-2:])}:{line}({func})"


def profile_workload(
    name: str, config: Config, steps: int, warmup_steps: int, device: torch.device, top: int,
    console: Console, dump: Path | None,
) -> None:
    """Run cProfile over the watched steps of one workload and print the hot spots.

    Prints the top ``top`` functions by own time, then graddebug's share of the step: the
    cumulative time of its entry points (hooks and ``Watcher.step``, torch kernels they launch
    included) and the own Python time of all its functions.

    Args:
        name: Workload name.
        config: The watch configuration to profile.
        steps: Profiled steps.
        warmup_steps: Unprofiled watched steps before them.
        device: Where to run.
        top: How many functions to list.
        console: Where to print.
        dump: Where to save the raw stats (for snakeviz), or None.
    """
    work = build_workload(name, device)
    plain = time_steps(work, max(steps // 2, 1), None, device) * 1e3
    with graddebug.watch(work.model, **config.options) as dbg:
        for _ in range(warmup_steps):
            train_step(work, dbg)
        sync(device)
        gc.collect()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            train_step(work, dbg)
        sync(device)
        profiler.disable()
    stats = pstats.Stats(profiler)
    if dump is not None:
        dump.parent.mkdir(parents=True, exist_ok=True)
        stats.dump_stats(str(dump))
    raw: _Raw = stats.stats  # type: ignore[attr-defined]
    total: float = stats.total_tt  # type: ignore[attr-defined]

    console.rule(f"cProfile: {name}, config {config.label}, {steps} steps")
    console.print(f"profiled watched step: {total / steps * 1e3:.2f} ms (cProfile inflates "
                  f"Python calls); unprofiled plain step: {plain:.2f} ms")
    console.print(_top_table(raw, total, steps, top))
    _print_entry_points(raw, total, steps, console)
    console.print(_callees_table(raw, total, steps, top))


def _top_table(raw: _Raw, total: float, steps: int, top: int) -> Table:
    """The ``top`` functions by own time, graddebug's in bold."""
    table = Table(title=f"top {top} functions by tottime", title_justify="left")
    for col in ("tottime ms/step", "% of step", "cumtime ms/step", "calls/step"):
        table.add_column(col, justify="right")
    table.add_column("function")
    rows = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in rows:
        where = _short(filename, line, func)
        style = "bold" if _is_graddebug(filename) else ""
        table.add_row(f"{tottime / steps * 1e3:.3f}", f"{100 * tottime / total:.1f}",
                      f"{cumtime / steps * 1e3:.3f}", f"{ncalls / steps:.0f}",
                      f"[{style}]{where}[/{style}]" if style else where)
    return table


def _print_entry_points(raw: _Raw, total: float, steps: int, console: Console) -> None:
    """Print graddebug's entry points, their inclusive time and graddebug's own Python time."""
    entries = Table(title="graddebug entry points (cumulative, kernels they launch included)",
                    title_justify="left")
    for col in ("cumtime ms/step", "% of step", "calls/step"):
        entries.add_column(col, justify="right")
    entries.add_column("function")
    inclusive = 0.0
    for (filename, line, func), (_cc, ncalls, _tt, cumtime, _callers) in raw.items():
        if _is_graddebug(filename) and func in ENTRY_POINTS:
            inclusive += cumtime
            entries.add_row(f"{cumtime / steps * 1e3:.3f}", f"{100 * cumtime / total:.1f}",
                            f"{ncalls / steps:.0f}", _short(filename, line, func))
    own = sum(v[2] for k, v in raw.items() if _is_graddebug(k[0]))
    console.print(entries)
    console.print(f"graddebug inclusive: {inclusive / steps * 1e3:.2f} ms/step "
                  f"({100 * inclusive / total:.1f}% of the profiled step); own Python "
                  f"(tottime in graddebug files): {own / steps * 1e3:.2f} ms/step "
                  f"({100 * own / total:.1f}%)")


def _callees_table(raw: _Raw, total: float, steps: int, top: int) -> Table:
    """The ``top`` functions outside graddebug by the time graddebug's calls spent in them."""
    callees = Table(title="graddebug's heaviest callees (tottime inside graddebug callers)",
                    title_justify="left")
    for col in ("ms/step", "% of step", "calls/step"):
        callees.add_column(col, justify="right")
    callees.add_column("function")
    callees.add_column("called from")
    inner: list[tuple[float, float, str, str]] = []
    for (filename, line, func), (_cc, _n, _tt, _ct, callers) in raw.items():
        if _is_graddebug(filename):
            continue
        for caller, (_ccc, nc, tt, _ctt) in callers.items():
            if _is_graddebug(caller[0]):
                inner.append((tt, nc, _short(filename, line, func), caller[2]))
    for tt, nc, where, caller_name in sorted(inner, reverse=True)[:top]:
        callees.add_row(f"{tt / steps * 1e3:.3f}", f"{100 * tt / total:.1f}",
                        f"{nc / steps:.0f}", where, caller_name)
    return callees
