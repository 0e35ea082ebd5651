"""The "Tested on" table of the README: every model of the zoo, its findings at initialisation
and its step-time overhead, as Markdown and JSON.

Run by hand (it is a benchmark, not a test)::

    python benchmarks/zoo.py                          # every model, both frameworks
    python benchmarks/zoo.py --frameworks torch --rounds 5 --out benchmarks/results

The models are those of ``tests/zoo.py`` (transformers architectures from tiny configs, Keras
applications with ``weights=None`` and 32x32 inputs), each trained from the same seeded init
for ``--steps`` SGD steps, plain and watched, in ``--rounds`` alternating rounds
(plain-watched, watched-plain, ...) so that drift of the machine favours neither. A round's
time is the median of its steps after the first (which pays for lazy set-up on both sides);
the overhead is the median over rounds of the per-round ratio watched / plain. Findings at
initialisation are those of the first watched run, by issue and layer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the zoo's model definitions live with its tests

import zoo  # noqa: E402


def _by_issue(findings: Any) -> dict[str, list[str]]:
    """The layers of each issue's findings, in the order the findings come."""
    issues: dict[str, list[str]] = {}
    for issue, layer in zip(findings["issue"], findings["layer"], strict=True):
        layers = issues.setdefault(str(issue), [])
        if layer not in layers:
            layers.append(str(layer))
    return issues


def _findings_summary(issues: dict[str, list[str]], count: int) -> str:
    """``0``, or the count with each issue's first layers: ``3: cut_graph at `a`; ...``."""
    if not count:
        return "0"
    parts = []
    for issue, layers in issues.items():
        shown = ", ".join(f"`{layer}`" for layer in layers[:2])
        more = f" and {len(layers) - 2} more" if len(layers) > 2 else ""
        parts.append(f"{issue} at {shown}{more}")
    return f"{count}: " + "; ".join(parts)


def _measure(run: Callable[[bool], Any], rounds: int) -> tuple[Any, float, float, float]:
    """Alternate plain and watched runs; return the first watched run, the median plain and
    watched step times (ms) and the median per-round ratio."""
    first = None
    ratios, plains, watcheds = [], [], []
    for i in range(rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        times = {}
        for watch in order:
            result = run(watch)
            times[watch] = statistics.median(result.times[1:] or result.times)
            if watch and first is None:
                first = result
        plains.append(times[False])
        watcheds.append(times[True])
        ratios.append(times[True] / times[False])
    return (first, 1000 * statistics.median(plains), 1000 * statistics.median(watcheds),
            statistics.median(ratios))


def measure_all(frameworks: list[str], rounds: int, steps: int) -> list[dict[str, Any]]:
    """One row per model (and per Keras loop)."""
    rows: list[dict[str, Any]] = []
    if "torch" in frameworks:
        for case in zoo.TORCH_CASES:
            first, plain, watched, ratio = _measure(
                lambda watch, case=case: zoo.train_torch(case, watch=watch, steps=steps),
                rounds)
            rows.append(_row(case.name, "torch", case.family, first.watcher.findings(),
                             plain, watched, ratio))
            print(rows[-1], flush=True)
    if "tensorflow" in frameworks:
        for kcase in zoo.KERAS_CASES:
            for mode in ("fit", "tape"):
                first, plain, watched, ratio = _measure(
                    lambda watch, kcase=kcase, mode=mode: zoo.train_keras(
                        kcase, mode=mode, watch=watch, steps=steps), rounds)
                name = f"{kcase.name} ({'model.fit' if mode == 'fit' else 'GradientTape'})"
                rows.append(_row(name, "tensorflow", kcase.family, first.watcher.findings(),
                                 plain, watched, ratio))
                print(rows[-1], flush=True)
    return rows


def _row(model: str, framework: str, family: str, findings: Any, plain: float,
         watched: float, ratio: float) -> dict[str, Any]:
    return {"model": model, "framework": framework, "family": family,
            "findings_at_init": len(findings), "issues": _by_issue(findings),
            "plain_ms": round(plain, 2), "watched_ms": round(watched, 2),
            "overhead": round(ratio, 3)}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The README table."""
    lines = ["| model | framework | family | findings at init | step time plain → watched |",
             "|---|---|---|---|---|"]
    for r in rows:
        found = _findings_summary(r["issues"], r["findings_at_init"])
        lines.append(f"| {r['model']} | {r['framework']} | {r['family']} | {found} | "
                     f"{r['plain_ms']:.1f} → {r['watched_ms']:.1f} ms ({r['overhead']:.2f}×) |")
    return "\n".join(lines) + "\n"


def versions(frameworks: list[str]) -> dict[str, str]:
    """The versions of Python, graddebug and the libraries of the measured frameworks."""
    import graddebug

    found = {"python": platform.python_version(), "graddebug": graddebug.__version__}
    if "torch" in frameworks:
        import torch
        import transformers

        found |= {"torch": torch.__version__, "transformers": transformers.__version__}
    if "tensorflow" in frameworks:
        import keras
        import tensorflow as tf

        found |= {"tensorflow": tf.__version__, "keras": keras.__version__}
    return found


def main(argv: list[str] | None = None) -> int:
    """Measure, then write ``zoo.md`` and ``zoo.json`` to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="+", default=["torch", "tensorflow"],
                        choices=["torch", "tensorflow"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=zoo.STEPS + 2,
                        help="SGD steps per run (the first is not timed)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared 2-core machine, "
                             "two threads wait on each other's stragglers and the times scatter)")
    args = parser.parse_args(argv)
    if "torch" in args.frameworks:
        import torch

        torch.set_num_threads(args.threads)
    rows = measure_all(args.frameworks, args.rounds, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    (args.out / "zoo.md").write_text(table, encoding="utf-8")
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(), "cpus": os.cpu_count(), "rounds": args.rounds,
            "steps": args.steps, "torch_threads": args.threads,
            "frameworks": args.frameworks, "versions": versions(args.frameworks)}
    payload = {"benchmark": "zoo", "meta": meta, "rows": rows}
    (args.out / "zoo.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
