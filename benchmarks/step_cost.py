"""The host time of ``dbg.step()``, split into its three places: the adapter's close, the
history rules, and the rest of the Watcher.

A recorded step's ``dbg.step()`` does three things on the host: the adapter closes the step
(reads the statistics and turns them into records: ``adapter.close_step``), the history rules
judge the step's rows (``LiveFindings.observe``: the step's rows as arrays, then
``History.observe``), and the Watcher does the rest (the buffer, tiers, notices, plugin
hooks). A step that ``every=`` skips closes in the adapter and opens the next step.

For the torch benchmark MLP (``torch_workloads.py``'s ``mlp``: 16 x Linear 512 + ReLU, batch
128, SGD) and the Flax NNX MLP of ``overhead_jax.py`` (``mlp-512``: the same shape, optax Adam
through ``graddebug_jax.monitor``), each under three configurations:

- ``params``: ``watch(model, outputs=False)``, every step recorded;
- ``full``: ``watch(model)``, parameters and every layer output, every step recorded;
- ``every``: ``params`` with ``every=10``: the skipped steps, 9 in 10.

the script trains ``--warmup`` recorded steps (and the steps skipped between them), then
``--steps`` timed steps. It times ``dbg.step()``
itself and, by wrapping the bound methods of the live objects (nothing in ``src/`` changes),
``adapter.close_step``, ``LiveFindings.observe`` and, inside it, ``History.observe``, each with
``time.perf_counter_ns``. The rest of the Watcher is the step's total less the close and the
live rules. The table gives, per piece, the median over the steps and the interquartile range
in microseconds; the wrappers' own cost (about a microsecond each) is in the totals. The
training step itself is not timed. A run's first ``history_window`` steps take the full rules
(nothing is calm yet): the warm-up should pass them so that the timed steps show a healthy
run's usual step.

Run ``python benchmarks/step_cost.py`` (``--frameworks torch,jax``, ``--configs
params,full,every``, ``--steps``, ``--warmup``, ``--json PATH``; the default JSON is
``benchmarks/results/step_cost.json``). With ``--profile`` it also runs ``cProfile`` over the
``dbg.step()`` calls of the timed steps of each configuration (the times it prints are then
the profiled ones) and prints the functions under it that take the most time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import graddebug

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours, also loaded by path
from ratios import quartiles

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "step_cost.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "params": {"outputs": False},
    "full": {"outputs": True},
    "every": {"outputs": False, "every": 10},
}
PIECES = ("total", "adapter", "history", "history.observe", "watcher")
"""The columns: ``dbg.step()``, the adapter's close, ``LiveFindings.observe``, of which
``History.observe``, and the rest (total - adapter - history)."""


@dataclass
class Piece:
    """Median and interquartile range of one piece over the timed steps, in microseconds."""

    median_us: float
    q1_us: float
    q3_us: float


@dataclass
class Result:
    """One configuration of one framework: recorded and skipped steps apart."""

    framework: str
    workload: str
    config: str
    kind: str  # "recorded" or "skipped"
    steps: int
    pieces: dict[str, Piece] = field(default_factory=dict)


class Probe:
    """Wraps ``dbg.step()`` and the bound methods behind it, and keeps each step's times.

    Args:
        dbg: An entered Watcher.
    """

    def __init__(self, dbg: Any) -> None:
        self._now: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []
        live = dbg._live  # the Watcher's LiveFindings; a benchmark may look inside
        self._wrap(dbg.adapter, "close_step", "adapter")
        self._wrap(live, "observe", "history")
        self._wrap(live._history, "observe", "history.observe")
        self._step = dbg.step
        self.every: int = dbg._options.every
        self.enabled = False
        self.profile: cProfile.Profile | None = None

    def _wrap(self, owner: Any, name: str, piece: str) -> None:
        method = getattr(owner, name)
        now = self._now
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                now[piece] = now.get(piece, 0) + clock() - start

        setattr(owner, name, timed)

    def step(self) -> Any:
        """Call ``dbg.step()``, timing it and its pieces when enabled."""
        self._now.clear()
        if self.profile is not None:
            self.profile.enable()
        start = time.perf_counter_ns()
        result = self._step()
        total = time.perf_counter_ns() - start
        if self.profile is not None:
            self.profile.disable()
        if self.enabled:
            self.steps.append({**self._now, "total": total})
        return result


def summarize(framework: str, workload: str, config: str, steps: list[dict[str, int]]
              ) -> list[Result]:
    """One result for the recorded steps and one for the skipped ones, where there are any."""
    out = []
    for kind in ("recorded", "skipped"):
        chosen = [s for s in steps if ("history" in s) == (kind == "recorded")]
        if not chosen:
            continue
        result = Result(framework, workload, config, kind, len(chosen))
        for piece in PIECES:
            if piece == "watcher":
                values = [s["total"] - s.get("adapter", 0) - s.get("history", 0)
                          for s in chosen]
            else:
                values = [s.get(piece, 0) for s in chosen]
            micro = [v / 1e3 for v in values]
            q1, q3 = quartiles(micro)
            result.pieces[piece] = Piece(statistics.median(micro), q1, q3)
        out.append(result)
    return out


@contextmanager
def profiled(probe: Probe, enabled: bool, console: Console, title: str, top: int
             ) -> Iterator[None]:
    """cProfile the ``dbg.step()`` calls of the block when ``enabled``, then print its ``top``
    functions by their own time."""
    if not enabled:
        yield
        return
    probe.profile = cProfile.Profile()
    try:
        yield
    finally:
        text = io.StringIO()
        pstats.Stats(probe.profile, stream=text).sort_stats("tottime").print_stats(top)
        probe.profile = None
        console.print(f"[bold]{title}[/bold]")
        console.print(text.getvalue(), markup=False, highlight=False)


def run_torch(config: str, steps: int, warmup: int, profile: bool, console: Console,
              top: int) -> list[Result]:
    """Train the torch benchmark MLP under one configuration, timing each ``dbg.step()``."""
    import torch
    from torch_workloads import build_workload

    work = build_workload("mlp", torch.device("cpu"))
    with graddebug.watch(work.model, **CONFIGS[config]) as dbg:
        probe = Probe(dbg)

        def one() -> None:
            work.optimizer.zero_grad(set_to_none=True)
            loss = work.loss_fn(work.model(work.inputs), work.target)
            torch.autograd.backward(loss)
            probe.step()
            work.optimizer.step()

        _loop(one, probe, steps, warmup, profile, console, top, f"torch mlp {config}")
    return summarize("torch", "mlp", config, probe.steps)


def run_jax(config: str, steps: int, warmup: int, profile: bool, console: Console,
            top: int) -> list[Result]:
    """Train the Flax NNX benchmark MLP under one configuration, timing each ``dbg.step()``."""
    import jax
    import optax
    from flax import nnx
    from overhead_jax import WORKLOADS, make_step

    import graddebug_jax

    build, shape = WORKLOADS["mlp-512"]
    model = build(nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), shape)
    optimizer = nnx.Optimizer(model, graddebug_jax.monitor(optax.adam(1e-4)), wrt=nnx.Param)
    train = make_step(False)
    with graddebug.watch(model, optimizer=optimizer, **CONFIGS[config]) as dbg:
        probe = Probe(dbg)

        def one() -> None:
            jax.block_until_ready(train(model, optimizer, x))
            probe.step()

        _loop(one, probe, steps, warmup, profile, console, top, f"jax mlp-512 {config}")
    return summarize("jax", "mlp-512", config, probe.steps)


def _loop(one: Callable[[], None], probe: Probe, steps: int, warmup: int, profile: bool,
          console: Console, top: int, title: str) -> None:
    for _ in range(warmup * probe.every):  # warmup recorded steps
        one()
    probe.enabled = True
    with profiled(probe, profile, console, title, top):
        for _ in range(steps):
            one()
    probe.enabled = False


RUNNERS = {"torch": run_torch, "jax": run_jax}


def results_table(results: list[Result]) -> Table:
    """The results as a table: median [q1-q3] of each piece, in microseconds."""
    table = Table(title="host time of dbg.step(), us: median (interquartile range)")
    for column in ("framework", "config", "steps", "n", *PIECES):
        table.add_column(column)
    for r in results:
        cells = [f"{p.median_us:.0f} ({p.q1_us:.0f}-{p.q3_us:.0f})"
                 for p in (r.pieces[name] for name in PIECES)]
        table.add_row(r.framework, r.config, r.kind, str(r.steps), *cells)
    return table


def main(argv: list[str] | None = None) -> list[Result]:
    """Run every framework and configuration; print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=400, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=60,
                        help="untimed recorded steps first (past history_window, 20 by "
                             "default), times every= for the skipping configuration")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile the timed steps and print the top functions")
    parser.add_argument("--top", type=int, default=30, help="functions listed by --profile")
    args = parser.parse_args(argv)
    frameworks, configs = args.frameworks.split(","), args.configs.split(",")
    if unknown := [f for f in frameworks if f not in RUNNERS] + \
            [c for c in configs if c not in CONFIGS]:
        parser.error(f"unknown {unknown!r}: frameworks {', '.join(RUNNERS)}, configs "
                     f"{', '.join(CONFIGS)}")
    console = Console(width=None if sys.stdout.isatty() else 150)
    results: list[Result] = []
    for framework in frameworks:
        for config in configs:
            results += RUNNERS[framework](config, args.steps, args.warmup, args.profile,
                                          console, args.top)
    console.print(results_table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "benchmark": "step_cost",
        "when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "graddebug": graddebug.__version__, "steps": args.steps, "warmup": args.warmup,
        "results": [asdict(r) for r in results]}, indent=2), encoding="utf-8")
    console.print(f"results: {args.json}")
    return results


if __name__ == "__main__":
    main()
