"""Per-layer and per-row costs of graddebug on PyTorch: a model of many tiny layers.

Run by hand (it is a benchmark, not a test)::

    python benchmarks/many_layers_torch.py                    # 10,000 layers, 7 rounds
    python benchmarks/many_layers_torch.py --layers 2000 --rounds 3
    python benchmarks/many_layers_torch.py --profile          # cProfile of the watched steps

The model is ``--layers`` modules ``Linear(8, 8)`` in an ``nn.Sequential``, on a batch of 4. Each
layer costs the framework almost nothing, so what graddebug does per layer (a forward hook, a
tensor hook, a record) and per row (building the frame) dominates: anything that is not O(1) per
layer or per row shows up here long before it shows up on a real model.

It measures:

- ``attach``: entering and leaving ``watch(model)`` (hooks registered and removed), median of
  the rounds;
- the step ratio: a step is ``zero_grad``, forward, loss, ``backward()``, ``dbg.step()`` (watched
  only), ``SGD.step()``; plain and watched rounds are interleaved and alternate in order, a
  round's time is the median of its steps, and the ratio is the median over rounds of watched
  over plain from the same pair;
- the same ratio for steps that ``every=`` skips: a third round in each pair, under a Watcher
  with ``every=10**9`` that recorded its first step in the warm-up round and none after;
- ``frame()`` and ``findings()`` of the recorded run, about ``3 * layers`` rows a step (one
  activation and two parameters per layer), built from scratch, after ``--frame-steps`` steps
  (default: enough for 100,000 rows).

It prints a table and writes ``benchmarks/results/many_layers_torch.json`` (``--json PATH``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import graddebug

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "many_layers_torch.json"
STEP_TARGET = 2.0
"""The largest acceptable median step ratio, watched over plain."""
FRAME_TARGET_S = 1.0
"""The longest acceptable time for ``frame()`` plus ``findings()`` of about 100,000 rows."""


@dataclass
class Result:
    """The measurements, as written to the JSON file.

    Attributes:
        layers: Number of ``Linear(8, 8)`` layers.
        attach_s: Median time to enter and leave ``watch(model)``.
        plain_ms: Median plain step time (ms).
        watched_ms: Median watched step time (ms).
        ratio: Median over rounds of the per-round ratio watched / plain.
        round_ratios: Every round's ratio.
        skipped_ms: Median time of a step ``every=`` skips (ms).
        skipped_ratio: Median over rounds of the per-round ratio skipped / plain.
        rows: Rows of the frame that ``frame()`` built.
        frame_s: Time of ``frame()`` (built from the buffer, not cached).
        findings_s: Time of ``findings()`` right after (diagnosis of the whole run).
        findings: How many findings the healthy model produced.
    """

    layers: int
    attach_s: float = 0.0
    plain_ms: float = 0.0
    watched_ms: float = 0.0
    ratio: float = 0.0
    round_ratios: list[float] = field(default_factory=list)
    skipped_ms: float = 0.0
    skipped_ratio: float = 0.0
    rows: int = 0
    frame_s: float = 0.0
    findings_s: float = 0.0
    findings: int = 0


def build(layers: int, seed: int = 0) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model of ``layers`` tiny Linear layers, a batch and its target."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    with torch.no_grad():  # orthogonal weights keep activations and gradients of order 1
        for layer in model:
            assert isinstance(layer, nn.Linear)
            layer.weight.copy_(torch.linalg.qr(torch.randn(8, 8))[0])
            layer.bias.zero_()
    return model, torch.randn(4, 8), torch.randn(4, 8)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
          dbg: graddebug.Watcher | None) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if dbg is not None:
        dbg.step()
    opt.step()
    return time.perf_counter() - start


def measure(layers: int, rounds: int, steps: int, frame_steps: int,
            profile: Callable[[Callable[[], None]], None] | None = None) -> Result:
    """Run the measurements of the module docstring."""
    model, x, y = build(layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    result = Result(layers)
    attach = []
    plain_rounds, watched_rounds, skipped_rounds = [], [], []
    skipper = graddebug.watch(model, every=10**9)  # records step 0 (warm-up) only
    for r in range(rounds + 1):  # round 0 warms up
        def plain() -> None:
            plain_rounds.append(statistics.median(
                _step(model, opt, x, y, None) for _ in range(steps)))

        def watched() -> None:
            start = time.perf_counter()
            with graddebug.watch(model) as dbg:
                attached = time.perf_counter() - start
                times = [_step(model, opt, x, y, dbg) for _ in range(steps)]
                start = time.perf_counter()
            attach.append(attached + time.perf_counter() - start)
            watched_rounds.append(statistics.median(times))

        def skipped() -> None:
            with skipper as dbg:
                skipped_rounds.append(statistics.median(
                    _step(model, opt, x, y, dbg) for _ in range(steps)))

        for run in ((plain, watched, skipped) if r % 2 == 0 else (skipped, watched, plain)):
            run()
        if r == 0:
            plain_rounds.clear()
            watched_rounds.clear()
            skipped_rounds.clear()
            attach.clear()
    ratios = [w / p for w, p in zip(watched_rounds, plain_rounds, strict=True)]
    result.skipped_ms = statistics.median(skipped_rounds) * 1e3
    result.skipped_ratio = statistics.median(
        s / p for s, p in zip(skipped_rounds, plain_rounds, strict=True))
    result.attach_s = statistics.median(attach)
    result.plain_ms = statistics.median(plain_rounds) * 1e3
    result.watched_ms = statistics.median(watched_rounds) * 1e3
    result.ratio = statistics.median(ratios)
    result.round_ratios = ratios

    with graddebug.watch(model) as dbg:
        if profile is not None:
            profile(lambda: [_step(model, opt, x, y, dbg) for _ in range(steps)])
        else:
            for _ in range(frame_steps):
                _step(model, opt, x, y, dbg)
    start = time.perf_counter()
    frame = dbg.frame()
    result.frame_s = time.perf_counter() - start
    start = time.perf_counter()
    result.findings = len(dbg.findings())
    result.findings_s = time.perf_counter() - start
    result.rows = len(frame)
    return result


def _table(result: Result) -> Table:
    table = Table(title=f"graddebug on {result.layers:,} Linear(8, 8) layers (torch, CPU)")
    for column in ("measure", "value", "target"):
        table.add_column(column)
    table.add_row("enter + exit watch(model)", f"{result.attach_s:.3f} s", "")
    table.add_row("plain step", f"{result.plain_ms:.1f} ms", "")
    table.add_row("watched step", f"{result.watched_ms:.1f} ms", "")
    table.add_row("step ratio (median of rounds)", f"{result.ratio:.2f}x",
                  f"<= {STEP_TARGET:.1f}x")
    table.add_row("step every= skips", f"{result.skipped_ms:.1f} ms", "")
    table.add_row("its ratio to plain (median of rounds)", f"{result.skipped_ratio:.2f}x", "")
    table.add_row(f"frame() of {result.rows:,} rows", f"{result.frame_s:.3f} s", "")
    table.add_row("findings() right after", f"{result.findings_s:.3f} s", "")
    table.add_row("frame() + findings()", f"{result.frame_s + result.findings_s:.3f} s",
                  f"< {FRAME_TARGET_S:.0f} s (100k rows)")
    table.add_row("findings on this healthy model", str(result.findings), "0")
    return table


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--frame-steps", type=int, default=0,
                        help="steps recorded before frame() (default: 100,000 rows' worth)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--profile", action="store_true",
                        help="profile the watched steps instead of timing frame()")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    frame_steps = args.frame_steps or max(1, -(-100_000 // (3 * args.layers)))
    profile = None
    if args.profile:
        def profile(run: Callable[[], None]) -> None:
            profiler = cProfile.Profile()
            profiler.runcall(run)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)

    result = measure(args.layers, args.rounds, args.steps_per_round, frame_steps, profile)
    Console().print(_table(result))
    payload: dict[str, Any] = {
        "benchmark": "many_layers_torch",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "graddebug": graddebug.__version__,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "settings": {"layers": args.layers, "rounds": args.rounds,
                     "steps_per_round": args.steps_per_round, "frame_steps": frame_steps},
        "targets": {"step_ratio": STEP_TARGET, "frame_plus_findings_s": FRAME_TARGET_S},
        "result": asdict(result),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
