"""Step-time overhead of graddebug's JAX adapter under ``nnx.jit``, by the method of
``overhead_torch.py`` and ``overhead_tf.py``: twin models with the same weights, one plain and
one watched, trained in pairs of single steps whose order flips from pair to pair; the ratio of
a configuration is the median of the pairs' watched/plain ratios, with its 95% bootstrap
interval over the rounds.

Configurations, each an ``nnx.jit`` train step with optax Adam:

- ``floor``: no graddebug, the step also returns one ``optax.global_norm`` of the gradients,
  the least any monitor adds (one fused pass over the gradient bytes).
- ``params``: ``watch(model, optimizer=nnx.Optimizer(model, monitor(tx)), outputs=False)``:
  parameter gradients, weights and updates (target 1.10).
- ``full``: the same with ``outputs=True``: the above and every layer output
  (target 1.30).

Workloads, in two sizes:

- ``mlp-512`` and ``transformer-256``: the shapes of the torch and TF benchmarks' MLP and
  transformer, so that the three frameworks' ratios compare: 16 Linear layers of 512 units,
  batch 128; 4 post-norm encoder blocks (width 256, 4 heads, feed-forward 1024), sequence 64,
  batch 16.
- ``mlp-256`` and ``transformer-64``: steps of a few milliseconds, where the per-step costs
  (``dbg.step()``'s fixed work, ``nnx.jit``'s Python) weigh most: 8 Linear layers of 256 units,
  batch 64; 2 pre-norm blocks (width 64, 4 heads), sequence 32, batch 8.

Each step waits for its result (``block_until_ready``) and the watched one closes its graddebug
step, so both sides pay one synchronisation a step.

Where the watched step's time goes: ``close ms`` is the median time of ``dbg.step()``, of
which ``adapter ms`` is spent in the adapter's close (fetching and turning rows into records)
and the rest in the Watcher (buffer, live rules, notices); the remainder of the difference to
the plain step is inside the compiled step (the reductions and the one host callback).

Run ``python benchmarks/overhead_jax.py`` (``--rounds``, ``--pairs``, ``--workloads``,
``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import graddebug
import graddebug_jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ratios import alternate, bootstrap_interval, pairs_estimator, verdict

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "overhead_jax.json"
TARGETS = {"floor": 1.10, "params": 1.10, "full": 1.30}


class MLP(nnx.Module):
    """``depth`` Linear layers of ``width`` units with ReLU between them."""

    def __init__(self, rngs: nnx.Rngs, depth: int = 8, width: int = 256) -> None:
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class Block(nnx.Module):
    """A pre-norm transformer block: attention and an MLP, each with a residual."""

    def __init__(self, rngs: nnx.Rngs, width: int = 64, heads: int = 4) -> None:
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    """Two blocks over a sequence of width-64 vectors, and a linear head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class EncoderBlock(nnx.Module):
    """A post-norm encoder block, as torch's ``TransformerEncoderLayer`` (ReLU, no dropout)."""

    def __init__(self, rngs: nnx.Rngs, width: int = 256, heads: int = 4, ff: int = 1024) -> None:
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, ff, rngs=rngs)
        self.down = nnx.Linear(ff, width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.down(jax.nn.relu(self.up(x))))


class Encoder(nnx.Module):
    """Four encoder blocks of width 256, the torch and TF benchmarks' transformer."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([EncoderBlock(rngs) for _ in range(4)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


WORKLOADS: dict[str, tuple[Callable[[nnx.Rngs], nnx.Module], tuple[int, ...]]] = {
    "mlp-512": (lambda rngs: MLP(rngs, depth=16, width=512), (128, 512)),
    "transformer-256": (Encoder, (16, 64, 256)),
    "mlp-256": (MLP, (64, 256)),
    "transformer-64": (Transformer, (8, 32, 64)),
}


@dataclass
class Result:
    """One configuration of one workload."""

    workload: str
    config: str
    ratio: float
    ratio_low: float
    ratio_high: float
    plain_ms: float
    target: float
    result: str
    watched_ms: float = float("nan")
    close_ms: float = float("nan")
    adapter_ms: float = float("nan")


def make_step(norms: bool) -> Callable[..., Any]:
    """An ``nnx.jit`` train step; with ``norms`` it also returns ``optax.global_norm``."""

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, x: jax.Array) -> Any:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return (loss, optax.global_norm(grads)) if norms else loss

    return step


def bench(workload: str, config: str, rounds: int, pairs: int) -> Result:
    """Time ``rounds`` rounds of ``pairs`` plain/watched pairs of one configuration."""
    build, shape = WORKLOADS[workload]
    plain, watched = build(nnx.Rngs(0)), build(nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), shape)
    plain_opt = nnx.Optimizer(plain, optax.adam(1e-4), wrt=nnx.Param)
    tx = graddebug_jax.monitor(optax.adam(1e-4)) if config != "floor" else optax.adam(1e-4)
    watched_opt = nnx.Optimizer(watched, tx, wrt=nnx.Param)
    plain_step, watched_step = make_step(False), make_step(config == "floor")
    watch = (graddebug.watch(watched, optimizer=watched_opt, outputs=config == "full")
             if config != "floor" else None)
    dbg = watch.__enter__() if watch is not None else None
    closes: list[float] = []
    adapter_closes: list[float] = []
    if dbg is not None:
        adapter = dbg.adapter
        close_step = adapter.close_step

        def timed_close(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return close_step(*args, **kwargs)
            finally:
                adapter_closes.append(time.perf_counter() - start)

        adapter.close_step = timed_close

    def timed(step: Callable[..., Any], model: nnx.Module, opt: nnx.Optimizer,
              close: bool) -> float:
        start = time.perf_counter()
        jax.block_until_ready(step(model, opt, x))
        if close and dbg is not None:
            closing = time.perf_counter()
            dbg.step()
            closes.append(time.perf_counter() - closing)
        return time.perf_counter() - start

    try:
        for _ in range(3):  # trace and warm both
            timed(plain_step, plain, plain_opt, False)
            timed(watched_step, watched, watched_opt, True)
        watched_rounds, plain_rounds = [], []
        for r in range(rounds):
            p, w = alternate(lambda: timed(plain_step, plain, plain_opt, False),
                             lambda: timed(watched_step, watched, watched_opt, True),
                             pairs, watched_first=r % 2 == 1)
            plain_rounds.append(p)
            watched_rounds.append(w)
    finally:
        if watch is not None:
            watch.__exit__(None, None, None)
    estimate = pairs_estimator(watched_rounds, plain_rounds)
    ratio = estimate(list(range(rounds)))
    low, high = bootstrap_interval(estimate, rounds)
    plain_ms = 1e3 * statistics.median(t for rnd in plain_rounds for t in rnd)
    watched_ms = 1e3 * statistics.median(t for rnd in watched_rounds for t in rnd)
    close_ms = 1e3 * statistics.median(closes) if closes else float("nan")
    adapter_ms = 1e3 * statistics.median(adapter_closes) if adapter_closes else float("nan")
    return Result(workload, config, ratio, low, high, plain_ms, TARGETS[config],
                  verdict(low, high, TARGETS[config]), watched_ms, close_ms, adapter_ms)


def main(argv: list[str] | None = None) -> list[Result]:
    """Run every workload and configuration; print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=list(WORKLOADS))
    args = parser.parse_args(argv)
    results = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("benchmarking", total=3 * len(args.workloads))
        for w in args.workloads:
            for c in ("floor", "params", "full"):
                progress.update(task, description=f"{w} {c}")
                results.append(bench(w, c, args.rounds, args.pairs))
                progress.advance(task)
    table = Table(title="graddebug JAX overhead (watched / plain step time, nnx.jit)")
    for column in ("workload", "config", "ratio", "95% interval", "plain ms", "watched ms",
                   "close ms", "adapter ms", "target", "result"):
        table.add_column(column)
    for r in results:
        table.add_row(r.workload, r.config, f"{r.ratio:.3f}",
                      f"{r.ratio_low:.3f}-{r.ratio_high:.3f}", f"{r.plain_ms:.2f}",
                      f"{r.watched_ms:.2f}", f"{r.close_ms:.2f}", f"{r.adapter_ms:.2f}",
                      f"{r.target:.2f}", r.result)
    Console(width=140).print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "benchmark": "overhead_jax",
        "when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
        "flax": version("flax"), "optax": version("optax"), "graddebug": graddebug.__version__,
        "rounds": args.rounds, "pairs": args.pairs,
        "results": [asdict(r) for r in results]}, indent=2), encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
