"""What reading the findings after every step costs, early and late in a long run.

A torch MLP (8 x Linear 64->64 + ReLU, batch 32) trains for ``--steps`` steps (10,000 by
default) under ``graddebug.watch(model)``, and after every ``dbg.step(loss=...)`` the loop
reads the findings, as a live dashboard does: either ``dbg.findings()`` (every rule brought up
to date) or the ``findings`` of the ``StepResult`` that ``dbg.step()`` returned (the history
rules at once, the window rules every ``WINDOW_EVERY`` recorded steps). Both must cost the
same at step 10,000 as at step 100: the live rules keep a fixed window, never the whole run.

Prints, for each way of reading and each probe (steps 100-149 and the last 50 steps), the
median time of the read and of the training step itself, and writes
``benchmarks/results/live_findings.json``. Run by hand:
``python benchmarks/live_findings.py [--steps 10000] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import graddebug

PROBE = 50


def run(steps: int, read: str) -> dict[str, Any]:
    """Train ``steps`` steps, reading the findings after each; time both around two probes."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4096, 64), torch.randint(0, 10, (4096,))
    probes = {"early": range(100, 100 + PROBE), "late": range(steps - PROBE, steps)}
    reads: dict[str, list[float]] = {name: [] for name in probes}
    trains: dict[str, list[float]] = {name: [] for name in probes}
    with graddebug.watch(model) as dbg:
        for step in range(steps):
            start = time.perf_counter()
            idx = torch.randint(0, 4096, (32,))
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            result = dbg.step(loss=loss)
            middle = time.perf_counter()
            found = dbg.findings() if read == "findings()" else result.findings
            end = time.perf_counter()
            for name, where in probes.items():
                if step in where:
                    reads[name].append(end - middle)
                    trains[name].append(middle - start)
            del found
        total = len(dbg.findings())
    out: dict[str, Any] = {"read": read, "steps": steps, "findings": total}
    for name in probes:
        out[f"{name}_read_ms"] = 1e3 * statistics.median(reads[name])
        out[f"{name}_step_ms"] = 1e3 * statistics.median(trains[name])
    out["late_over_early"] = out["late_read_ms"] / out["early_read_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--json", type=Path,
                        default=Path(__file__).parent / "results" / "live_findings.json")
    args = parser.parse_args()
    if args.steps < 2 * PROBE + 100:
        parser.error(f"--steps must be at least {2 * PROBE + 100}")
    rows = [run(args.steps, read) for read in ("StepResult.findings", "findings()")]
    print(f"{'read':<22}{'step 100 read ms':>18}{'last read ms':>15}{'late/early':>12}"
          f"{'step ms':>10}{'findings':>10}")
    for r in rows:
        print(f"{r['read']:<22}{r['early_read_ms']:>18.3f}{r['late_read_ms']:>15.3f}"
              f"{r['late_over_early']:>12.2f}{r['late_step_ms']:>10.2f}{r['findings']:>10}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
