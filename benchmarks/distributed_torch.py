"""Step-time overhead of graddebug under DDP, next to the same workload without DDP.

Run by hand (it is a benchmark, not a test)::

    python benchmarks/distributed_torch.py                  # 2 gloo processes, 15 rounds x 10 steps
    python benchmarks/distributed_torch.py --rounds 9 --steps-per-round 6

The workload is the transformer of ``overhead_torch.py`` (``nn.TransformerEncoder`` d256, 4
heads, 4 layers, ff 1024), its global batch of 16 sequences split between the ranks. Config (b):
``watch(model)`` with the defaults, parameters and every leaf layer's output, every step.

``DDP``: two processes on the CPU, joined in a gloo group, train ``DistributedDataParallel`` of
the model on their halves of the batch. ``no DDP``: in the same two processes, at the same
time, a copy of the model that is not wrapped trains on the same half batch, alone: the
single-process workload, under the same load from the other process as DDP's. (graddebug sees
two ranks there too and measures parameter gradients when the step closes, not in the
accumulation hook; one ``_foreach_norm`` pass, 0.4% of this workload's step in one process.)

Each process follows the method of ``overhead_torch.py``: plain and watched rounds interleaved,
each round the median of its steps, the watcher entered around each watched round and its
enter/exit time kept apart, the ratio of a round watched over plain. Each round times both
setups in turn; the order of the setups and of plain and watched flips every round. DDP keeps
the ranks in step, so rank 0's times stand for both. The difference of the two median ratios is
what distribution adds to graddebug's cost: DDP's gradients are not sharded, so graddebug adds
no collective (the target is <= 0.02).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch_results import environment
from torch_timing import time_steps
from torch_workloads import Workload, build_workload

import graddebug

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "distributed_torch.json"
WORKLOAD = "transformer"
TARGET = 0.02
"""The largest acceptable difference of median ratios, DDP over no DDP."""


@dataclass
class Measurement:
    """One setup's rounds.

    Attributes:
        setup: ``"DDP"`` or ``"no DDP"``.
        description: Processes, threads and batch, in words.
        plain_ms: Median over rounds of the plain step time (ms).
        watched_ms: Median over rounds of the watched step time (ms).
        ratio: Median over rounds of watched / plain.
        ratio_q1: First quartile of the round ratios.
        ratio_q3: Third quartile of the round ratios.
        ratio_best: Fastest watched round over fastest plain round.
        rows_per_step: Frame rows per watched step.
        findings: Findings over the run (a healthy model gives 0).
        enter_exit_ms: Median time to enter and leave the ``with`` block (not in the ratio).
        round_ratios: Every round's ratio.
        plain_round_ms: Every plain round's median step time (ms).
        watched_round_ms: Every watched round's median step time (ms).
    """

    setup: str
    description: str
    plain_ms: float = float("nan")
    watched_ms: float = float("nan")
    ratio: float = float("nan")
    ratio_q1: float = float("nan")
    ratio_q3: float = float("nan")
    ratio_best: float = float("nan")
    rows_per_step: float = float("nan")
    findings: int = 0
    enter_exit_ms: float = float("nan")
    round_ratios: list[float] = field(default_factory=list)
    plain_round_ms: list[float] = field(default_factory=list)
    watched_round_ms: list[float] = field(default_factory=list)


def half_batch(work: Workload, rank: int, world: int) -> Workload:
    """``work`` on rank ``rank``'s share of its batch."""
    n = work.inputs.shape[0] // world
    rows = slice(rank * n, (rank + 1) * n)
    return Workload(work.name, work.description, work.model, work.optimizer,
                    work.inputs[rows], work.target[rows], work.loss_fn)


def _round(work: Workload, watcher: graddebug.Watcher, steps: int, flip: bool
           ) -> tuple[float, float, float]:
    """One plain and one watched round of ``work`` (watched first when ``flip``); return the
    median seconds per plain and per watched step, and the ms spent entering plus leaving."""
    device = torch.device("cpu")
    plain = watched = enter_exit = 0.0
    for side in ("watched", "plain") if flip else ("plain", "watched"):
        if side == "plain":
            plain = time_steps(work, steps, None, device)
            continue
        start = time.perf_counter()
        with watcher as dbg:
            entered = time.perf_counter()
            watched = time_steps(work, steps, dbg, device)
            leaving = time.perf_counter()
        enter_exit = (entered - start + time.perf_counter() - leaving) * 1e3
    return plain, watched, enter_exit


def measure(works: dict[str, tuple[Workload, str]], rounds: int, steps: int,
            warmup: int) -> list[Measurement]:
    """Interleave plain and watched rounds of each workload (config (b)); return their medians.

    Each round times every setup in turn, plain and watched, so that load from elsewhere hits
    them alike; the order of the setups and of plain and watched flips every round. Every rank
    of a DDP run calls it with the same arguments, so that the ranks run the same steps in the
    same order.

    Args:
        works: Per setup name, the workload and its description.
        rounds: Timed rounds.
        steps: Steps per round.
        warmup: Untimed rounds first.
    """
    watchers = {name: graddebug.watch(work.model) for name, (work, _) in works.items()}
    out = {name: Measurement(name, description) for name, (_, description) in works.items()}
    enter_exit: dict[str, list[float]] = {name: [] for name in works}
    for r in range(-warmup, rounds):
        names = list(works) if r % 2 == 0 else list(works)[::-1]
        for name in names:
            gc.collect()
            plain, watched, entering = _round(works[name][0], watchers[name], steps, r % 2 == 1)
            if r < 0:
                continue
            res = out[name]
            res.plain_round_ms.append(plain * 1e3)
            res.watched_round_ms.append(watched * 1e3)
            res.round_ratios.append(watched / plain)
            enter_exit[name].append(entering)
    for name, res in out.items():
        res.plain_ms = statistics.median(res.plain_round_ms)
        res.watched_ms = statistics.median(res.watched_round_ms)
        res.ratio = statistics.median(res.round_ratios)
        if len(res.round_ratios) > 1:
            q = statistics.quantiles(res.round_ratios, n=4, method="inclusive")
            res.ratio_q1, res.ratio_q3 = q[0], q[2]
        else:
            res.ratio_q1 = res.ratio_q3 = res.ratio
        res.ratio_best = min(res.watched_round_ms) / min(res.plain_round_ms)
        res.rows_per_step = len(watchers[name].frame()) / ((warmup + rounds) * steps)
        res.findings = len(watchers[name].findings())
        res.enter_exit_ms = statistics.median(enter_exit[name])
    return list(out.values())


# -- the processes ------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, settings: dict[str, Any], out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(settings["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        device = torch.device("cpu")
        work = build_workload(WORKLOAD, device)  # the same weights on every rank
        model = DDP(work.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        ddp = half_batch(Workload(work.name, work.description, model, optimizer,
                                  work.inputs, work.target, work.loss_fn), rank, world)
        alone = half_batch(build_workload(WORKLOAD, device), rank, world)
        each = (f"{settings['threads']} thread(s) per process, b={ddp.inputs.shape[0]} "
                "per process")
        results = measure({"DDP": (ddp, f"{world} x gloo, {each}"),
                           "no DDP": (alone, f"{world} x alone, {each}")},
                          settings["rounds"], settings["steps_per_round"], settings["warmup"])
        if rank == 0:
            Path(out).write_text(json.dumps([asdict(r) for r in results]))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run(settings: dict[str, Any], world: int) -> list[Measurement]:
    """Measure in ``world`` spawned processes; return rank 0's measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        mp.start_processes(_worker, args=(world, _free_port(), settings, str(out)),
                           nprocs=world, start_method="spawn")
        return [Measurement(**r) for r in json.loads(out.read_text())]


# -- output -------------------------------------------------------------------------------------


def results_table(results: Sequence[Measurement], title: str) -> Table:
    """One row per setup."""
    table = Table(title=title, title_justify="left")
    table.add_column("setup")
    table.add_column("processes, threads, batch")
    for col in ("plain ms/step", "watched ms/step", "ratio", "ratio IQR", "best/best",
                "rows/step", "findings"):
        table.add_column(col, justify="right")
    for res in results:
        table.add_row(res.setup, res.description, f"{res.plain_ms:.2f}", f"{res.watched_ms:.2f}",
                      f"{res.ratio:.3f}", f"{res.ratio_q1:.2f}-{res.ratio_q3:.2f}",
                      f"{res.ratio_best:.3f}", f"{res.rows_per_step:.0f}", str(res.findings))
    return table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="graddebug's step-time overhead under DDP (2 gloo processes on the CPU) "
                    "and without it, config (b).")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds")
    parser.add_argument("--steps-per-round", type=int, default=10, help="steps in each round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--world-size", type=int, default=2, help="DDP processes")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: CPU cores / world size)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup < 0 or args.world_size < 2:
        parser.error("--rounds and --steps-per-round must be >= 1, --warmup >= 0, "
                     "--world-size >= 2")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run both setups, print the table and write the JSON file; return 0."""
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 132)
    settings = {"rounds": args.rounds, "steps_per_round": args.steps_per_round,
                "warmup": args.warmup, "threads": args.threads, "world_size": args.world_size,
                "workload": WORKLOAD, "config": "b"}
    env = environment()
    console.print(f"torch {env['torch']}; {args.rounds} rounds x {args.steps_per_round} steps, "
                  f"{args.warmup} warm-up round(s); workload {WORKLOAD}, config (b)")
    ddp, single = run(settings, args.world_size)
    difference = ddp.ratio - single.ratio
    console.print(results_table([ddp, single], "graddebug overhead under DDP, median of "
                                f"{args.rounds} rounds x {args.steps_per_round} steps"))
    verdict = "[green]within[/green]" if difference <= TARGET else "[red]over[/red]"
    console.print(f"difference of median ratios, DDP - no DDP: {difference:+.3f} "
                  f"({verdict} the target of {TARGET:+.2f}); of best/best: "
                  f"{ddp.ratio_best - single.ratio_best:+.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "distributed_torch",
        "method": "per setup, median over rounds of watched/plain step time, a round's time "
                  "being the median of its steps; setups and plain/watched rounds "
                  "interleaved, order flipped every round; times from rank 0",
        "settings": settings, "environment": env,
        "results": [asdict(ddp), asdict(single)],
        "difference": difference, "difference_best": ddp.ratio_best - single.ratio_best,
        "target": TARGET,
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
