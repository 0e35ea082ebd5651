"""The per-step cost of graddebug's one collective under DDP, tensor parallelism and FSDP2, next
to the step, on 2 and 4 gloo processes on the CPU.

Run by hand (it is a benchmark, not a test)::

    python benchmarks/distributed.py                          # 2 and 4 processes, every setup
    python benchmarks/distributed.py --worlds 2 --setups tp --rounds 5 --steps-per-round 4

The workload is an MLP of ``--blocks`` residual blocks (Linear ``W -> 4W``, GELU, Linear
``4W -> W``, ``W = --width``) with an MSE loss, on a global batch of ``--batch`` rows:

- ``DDP``: ``DistributedDataParallel`` of the model, each rank on its share of the batch;
- ``TP``: each block's first Linear column-wise and its second row-wise
  (``parallelize_module`` on a 1-D mesh), every rank on the whole batch;
- ``FSDP2``: ``fully_shard`` on each block and on the model, each rank on its share.

Config: ``watch(model)`` with the defaults (parameters and every leaf layer's output, every
step). Each round times ``--steps-per-round`` plain steps and as many watched steps (the
watcher entered around its round), in turn; the order of plain and watched flips every round,
and the setups run one after another in each round, so that load from elsewhere hits them
alike. A round's time is the median of its steps; a setup's, the median over its rounds.

Inside each watched step the script also times ``dbg.step()`` (the close) and, within it, every
``torch.distributed`` call that graddebug's own code makes (its caller's module starts with
``graddebug``): that is the collective that combines the ranks' rows, with the wait for the
slowest rank it includes, and the count of such calls per recorded step (1 in the steady state;
the first step may exchange the rows' layout once). Times come from rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch import nn
from torch_results import environment

import graddebug

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "distributed.json"
SETUPS = ("ddp", "tp", "fsdp2")
LABELS = {"ddp": "DDP", "tp": "TP", "fsdp2": "FSDP2"}
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
                "all_reduce", "broadcast", "reduce_scatter_tensor")


@dataclass
class Measurement:
    """One setup on one number of processes.

    Attributes:
        setup: ``"DDP"``, ``"TP"`` or ``"FSDP2"``.
        world: Processes.
        description: Threads and batch per process, in words.
        plain_ms: Median over rounds of the plain step time (ms).
        watched_ms: Median over rounds of the watched step time (ms).
        ratio: Median over rounds of watched / plain.
        close_ms: Median over watched steps of the time in ``dbg.step()`` (ms).
        collective_ms: Median over watched steps of the time in graddebug's collectives (ms).
        collectives_per_step: Median over watched steps of graddebug's collective calls.
        first_step_collectives: graddebug's collective calls in the first recorded step.
        rows_per_step: Frame rows per watched step.
        findings: Findings over the run (a healthy model gives 0).
        round_ratios: Every round's ratio.
    """

    setup: str
    world: int
    description: str
    plain_ms: float = float("nan")
    watched_ms: float = float("nan")
    ratio: float = float("nan")
    close_ms: float = float("nan")
    collective_ms: float = float("nan")
    collectives_per_step: float = float("nan")
    first_step_collectives: int = -1
    rows_per_step: float = float("nan")
    findings: int = 0
    round_ratios: list[float] = field(default_factory=list)


class Block(nn.Module):
    """Linear ``W -> 4W``, GELU, Linear ``4W -> W``, around a residual connection (without it
    four blocks of torch's default initialisation vanish at the first: a finding a healthy
    workload must not give)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def build(setup: str, width: int, blocks: int) -> nn.Module:
    """The model of ``setup``, the same weights on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(blocks)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if setup == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {f"{i}.{name}": style for i in range(blocks)
                for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}
        return parallelize_module(model, mesh, plan)
    from torch.distributed.fsdp import fully_shard

    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextlib.contextmanager
def graddebug_collectives() -> Iterator[list[float]]:
    """The seconds of each ``torch.distributed`` call that graddebug's code makes in the
    block (DDP's, FSDP's and DTensor's own ones are not counted)."""
    spent: list[float] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def timed(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not str(sys._getframe(1).f_globals.get("__name__", "")).startswith("graddebug"):
                return real(*args, **kwargs)
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)
        return call

    for name, real in saved.items():
        setattr(dist, name, timed(real))
    try:
        yield spent
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


@dataclass
class Run:
    """One setup's model, optimizer, batch and watcher, and what its watched steps spent."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    target: torch.Tensor
    watcher: graddebug.Watcher
    closes: list[float] = field(default_factory=list)
    collectives: list[list[float]] = field(default_factory=list)

    def step(self, dbg: graddebug.Watcher | None) -> float:
        """One training step; return its seconds."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(self.model(self.inputs), self.target).backward()
        if dbg is not None:
            closing = time.perf_counter()
            with graddebug_collectives() as spent:
                dbg.step()
            self.closes.append(time.perf_counter() - closing)
            self.collectives.append(spent)
        self.optimizer.step()
        return time.perf_counter() - start

    def round(self, steps: int, watched: bool) -> float:
        """The median seconds of ``steps`` steps, watched or plain."""
        if not watched:
            return statistics.median(self.step(None) for _ in range(steps))
        with self.watcher as dbg:
            return statistics.median(self.step(dbg) for _ in range(steps))


def make_run(setup: str, settings: dict[str, Any]) -> Run:
    """The :class:`Run` of ``setup`` on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    width, rows = settings["width"], settings["batch"]
    model = build(setup, width, settings["blocks"])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    if setup != "tp":  # data parallel: this rank's share of the global batch
        n = rows // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    return Run(model, optimizer, x, y, graddebug.watch(model))


def summarize(run: Run, setup: str, world: int, description: str, plain: list[float],
              watched: list[float], recorded: int) -> Measurement:
    """The medians of one setup's rounds and watched steps."""
    ratios = [w / p for p, w in zip(plain, watched, strict=True)]
    steady = run.collectives[1:] or run.collectives
    return Measurement(
        setup=LABELS[setup], world=world, description=description,
        plain_ms=statistics.median(plain) * 1e3, watched_ms=statistics.median(watched) * 1e3,
        ratio=statistics.median(ratios), close_ms=statistics.median(run.closes) * 1e3,
        collective_ms=statistics.median(sum(s) for s in steady) * 1e3,
        collectives_per_step=statistics.median(len(s) for s in steady),
        first_step_collectives=len(run.collectives[0]),
        rows_per_step=len(run.watcher.frame()) / recorded,
        findings=len(run.watcher.findings()), round_ratios=ratios)


def measure(settings: dict[str, Any]) -> list[Measurement]:
    """Interleave plain and watched rounds of every setup on this rank; return the medians.

    Every rank calls it with the same settings, so that the ranks run the same steps in the
    same order.
    """
    world = dist.get_world_size()
    runs = {setup: make_run(setup, settings) for setup in settings["setups"]}
    times: dict[str, tuple[list[float], list[float]]] = {s: ([], []) for s in runs}
    steps = settings["steps_per_round"]
    for r in range(-settings["warmup"], settings["rounds"]):
        for setup, run in runs.items():
            order = (False, True) if r % 2 == 0 else (True, False)
            for watched in order:
                seconds = run.round(steps, watched)
                if r >= 0:
                    times[setup][watched].append(seconds)
    out = []
    recorded = (settings["warmup"] + settings["rounds"]) * steps
    for setup, run in runs.items():
        share = settings["batch"] if setup == "tp" else settings["batch"] // world
        description = f"{settings['threads']} thr, b={share}"
        out.append(summarize(run, setup, world, description, *times[setup], recorded))
    return out


# -- the processes ------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, settings: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(settings["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        results = measure(settings)
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
    settings = {**settings, "threads": settings["threads"] or max(1, (os.cpu_count() or 1)
                                                                   // world)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        mp.start_processes(_worker, args=(world, _free_port(), settings, str(out)),
                           nprocs=world, start_method="spawn")
        return [Measurement(**r) for r in json.loads(out.read_text())]


# -- output -------------------------------------------------------------------------------------


def results_table(results: Sequence[Measurement], title: str) -> Table:
    """One row per (setup, processes)."""
    table = Table(title=title, title_justify="left")
    for col in ("setup", "processes", "per process"):
        table.add_column(col)
    for col in ("plain ms/step", "watched ms/step", "ratio", "dbg.step() ms", "collective ms",
                "collective / step", "collectives/step", "first step", "rows/step",
                "findings"):
        table.add_column(col, justify="right")
    for res in results:
        share = res.collective_ms / res.watched_ms
        table.add_row(res.setup, str(res.world), res.description, f"{res.plain_ms:.2f}",
                      f"{res.watched_ms:.2f}", f"{res.ratio:.3f}", f"{res.close_ms:.2f}",
                      f"{res.collective_ms:.3f}", f"{share:.1%}",
                      f"{res.collectives_per_step:g}", str(res.first_step_collectives),
                      f"{res.rows_per_step:.0f}", str(res.findings))
    return table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="The per-step cost of graddebug's collective under DDP, TP and FSDP2 on "
                    "gloo processes on the CPU, next to the step.")
    parser.add_argument("--worlds", default="2,4", help="numbers of processes, comma-separated")
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help=f"setups, comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds")
    parser.add_argument("--steps-per-round", type=int, default=6, help="steps in each round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--width", type=int, default=256, help="the MLP's width W")
    parser.add_argument("--blocks", type=int, default=4, help="the MLP's blocks")
    parser.add_argument("--batch", type=int, default=64, help="the global batch")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per process (default: CPU cores / processes)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.setups = [s.strip() for s in args.setups.split(",")]
    if any(s not in SETUPS for s in args.setups):
        parser.error(f"--setups takes {', '.join(SETUPS)}, not {args.setups}")
    if any(w < 2 or args.batch % w or 4 * args.width % w for w in args.worlds):
        parser.error("each of --worlds must be >= 2 and divide --batch and 4 x --width")
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup < 0:
        parser.error("--rounds and --steps-per-round must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run every setup on every number of processes, print the table, write the JSON; return 0."""
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 180)
    settings = {"rounds": args.rounds, "steps_per_round": args.steps_per_round,
                "warmup": args.warmup, "threads": args.threads, "width": args.width,
                "blocks": args.blocks, "batch": args.batch, "setups": args.setups,
                "worlds": args.worlds, "config": "b"}
    results = [res for world in args.worlds for res in run(settings, world)]
    console.print(results_table(results, "graddebug's collective next to the step, median of "
                                f"{args.rounds} rounds x {args.steps_per_round} steps"))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "distributed",
        "method": "per setup and number of processes, plain and watched rounds interleaved "
                  "(order flipped every round), a round's time the median of its steps, the "
                  "medians over rounds; in each watched step, the time in dbg.step() and in "
                  "the torch.distributed calls graddebug's code makes; times from rank 0",
        "settings": settings, "environment": environment(),
        "results": [asdict(r) for r in results],
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
