"""Step-time overhead of graddebug on TensorFlow/Keras: watched over plain, interleaved rounds.

Run by hand (it is a benchmark, not a test)::

    python benchmarks/overhead_tf.py                         # both workloads, both loops
    python benchmarks/overhead_tf.py --workloads mlp --loops function --rounds 21

Three ways of training are measured for each workload:

- ``function``: a custom ``tf.function`` train step (forward, loss, ``tape.gradient``,
  ``optimizer.apply_gradients``) with ``dbg.step(grads)`` after it when watched;
- ``function_opt``: the same step, watched with ``watch(model, optimizer=opt)``, so that the
  parameter statistics are computed inside the compiled step, and ``dbg.step()`` after it;
- ``fit``: ``model.fit`` on an in-memory dataset, with ``dbg.callback()`` when watched.

Configurations: (a) parameters only, (b) parameters and every layer output, and (f) the floor
of parameter capture without graddebug (each gradient's norm inside the compiled step, read in
one transfer; the tf.function loops only). The table gives each row's distance to the floor.

Plain and watched run in one process, on two copies of the model with the same weights, batch
and optimizer settings, and alternate round by round (plain-watched, watched-plain, ...) so that
slow drift of the machine favours neither. Each watched configuration enters its Watcher once, as
a real run would; its train step is traced inside the ``with`` block, the plain one outside it,
so the plain graph holds no graddebug op at all. A round's time is the median of its steps; in
``fit``, a step is the time from one batch end to the next, read by a clock callback that both
sides carry (so both sync per batch). The table quotes the median over rounds of the per-round
ratio watched / plain.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np
import tensorflow as tf
from rich.console import Console
from rich.table import Table

import graddebug

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "overhead_tf.json"
WORKLOADS: tuple[str, ...] = ("mlp", "cnn")
LOOPS: tuple[str, ...] = ("function", "function_opt", "fit")


@dataclass(frozen=True)
class Config:
    """One way of watching a model: ``graddebug.watch(model, **options)``; ``target`` is the
    largest acceptable median ratio."""

    key: str
    label: str
    options: dict[str, Any]
    target: float


CONFIGS: tuple[Config, ...] = (
    Config("a", "(a) params", {"outputs": False}, 1.10),
    Config("b", "(b) params+outputs", {}, 1.25),
    # The floor of parameter capture: the norm of every parameter gradient, computed inside
    # the compiled step (tf.linalg.global_norm of each), read to the host in one transfer; no
    # graddebug. The table gives each row's distance to it. fit has no row of its own.
    Config("f", "(f) floor: global_norm", {"floor": True}, math.inf),
)


@dataclass
class Result:
    """One (workload, loop, config) measurement."""

    workload: str
    loop: str
    config: str
    plain_ms: float
    watched_ms: float
    ratio: float
    q1: float
    q3: float
    target: float
    rounds: int
    recorded_steps: int


def build_model(name: str, seed: int = 0) -> tuple[keras.Model, np.ndarray, np.ndarray, Any]:
    """The model, one batch and the loss of a workload.

    ``mlp``: 16 x (Dense 512 + ReLU), MSE, batch 128 x 512. ``cnn``: 3 x (Conv3x3 + BatchNorm +
    ReLU), 3->32->64->64, max-pool, global average pool, Dense 10, cross-entropy, batch
    64 x 32 x 32 x 3. The same shapes as the PyTorch benchmark.
    """
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    if name == "mlp":
        layers: list[Any] = [keras.Input((512,))]
        for i in range(16):
            layers += [keras.layers.Dense(512, name=f"fc{i}"), keras.layers.ReLU(name=f"act{i}")]
        model = keras.Sequential(layers, name="mlp")
        x = rng.standard_normal((128, 512)).astype(np.float32)
        y = rng.standard_normal((128, 512)).astype(np.float32)
        return model, x, y, keras.losses.MeanSquaredError()
    if name == "cnn":
        layers = [keras.Input((32, 32, 3))]
        for i, width in enumerate((32, 64, 64)):
            layers += [
                keras.layers.Conv2D(width, 3, padding="same", name=f"conv{i}"),
                keras.layers.BatchNormalization(name=f"bn{i}"),
                keras.layers.ReLU(name=f"relu{i}"),
            ]
            if i == 0:
                layers.append(keras.layers.MaxPooling2D(name="pool"))
        layers += [keras.layers.GlobalAveragePooling2D(name="gap"),
                   keras.layers.Dense(10, name="head")]
        model = keras.Sequential(layers, name="cnn")
        x = rng.standard_normal((64, 32, 32, 3)).astype(np.float32)
        y = rng.integers(0, 10, 64)
        return model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def make_step(model: keras.Model, loss_fn: Any, optimizer: Any,
              norms: bool = False) -> Callable[..., Any]:
    """A compiled train step returning the gradients (traced on its first call); with
    ``norms``, also, last, the norm of every parameter gradient (the floor (f): the cheapest
    parameter capture, one reduction a gradient, inside the compiled step)."""

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if norms:
            return [*grads, tf.stack([tf.linalg.global_norm([g]) for g in grads])]
        return grads

    return step


def time_function_round(step: Callable[..., Any], x: tf.Tensor, y: tf.Tensor, steps: int,
                        dbg: graddebug.Watcher | None, hand_over: bool) -> float:
    """Median seconds per step of ``steps`` calls (``dbg.step`` included); ``hand_over``
    passes the gradients to ``dbg.step``."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        grads = step(x, y)
        if dbg is not None:
            dbg.step(grads if hand_over else None)
        else:
            grads[-1].numpy()  # the watched side syncs in dbg.step; so does the plain one
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _BatchClock(keras.callbacks.Callback):
    """Times each batch of ``fit`` from one batch end to the next (both sides get one, so both
    sync per batch and Keras' per-call set-up stays out of the median)."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[float] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.ends.append(time.perf_counter())


def time_fit_round(model: keras.Model, data: tf.data.Dataset, steps: int,
                   callbacks: list[Any]) -> float:
    """Median seconds per batch of one ``fit`` call over ``steps`` batches (the callbacks run
    before the clock reads, so graddebug's work counts)."""
    clock = _BatchClock()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
              callbacks=[*callbacks, clock])
    return statistics.median(b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False))


def twin(name: str) -> tuple[keras.Model, keras.Model, np.ndarray, np.ndarray, Any]:
    """Two copies of a workload's model with equal weights, and its batch and loss."""
    plain, x, y, loss = build_model(name)
    watched, _, _, _ = build_model(name)
    watched.set_weights(plain.get_weights())
    return plain, watched, x, y, loss


def bench(workload: str, loop: str, config: Config, rounds: int, steps: int,
          fit_steps: int) -> Result:
    """Measure one configuration."""
    plain, watched, x, y, loss = twin(workload)
    ratios, plain_times, watched_times = [], [], []
    optimizer = keras.optimizers.SGD(1e-4)
    floor = bool(config.options.get("floor"))
    options = {**config.options, **({"optimizer": optimizer} if loop == "function_opt" else {})}
    with (contextlib.nullcontext() if floor else graddebug.watch(watched, **options)) as dbg:
        if loop in ("function", "function_opt"):
            xs, ys = tf.constant(x), tf.constant(y)
            plain_step = make_step(plain, loss, keras.optimizers.SGD(1e-4))
            watched_step = make_step(watched, loss, optimizer, norms=floor)
            plain_step(xs, ys)
            grads = watched_step(xs, ys)  # trace both before timing
            if dbg is not None:
                dbg.step(grads)
            hand_over = loop == "function"

            def run(side: str) -> float:
                if side == "plain":
                    return time_function_round(plain_step, xs, ys, steps, None, hand_over)
                return time_function_round(watched_step, xs, ys, steps, dbg, hand_over)
        else:
            data = tf.data.Dataset.from_tensors((x, y)).repeat()
            for model in (plain, watched):
                model.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss)
            assert dbg is not None, "the floor has no fit row"
            callback = dbg.callback()
            plain.fit(data, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)
            watched.fit(data, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False,
                        callbacks=[callback])

            def run(side: str) -> float:
                if side == "plain":
                    return time_fit_round(plain, data, fit_steps, [])
                return time_fit_round(watched, data, fit_steps, [callback])

        run("plain")
        run("watched")  # warm-up round
        for r in range(rounds):
            order = ("plain", "watched") if r % 2 == 0 else ("watched", "plain")
            got = {side: run(side) for side in order}
            plain_times.append(got["plain"])
            watched_times.append(got["watched"])
            ratios.append(got["watched"] / got["plain"])
    recorded = 0 if dbg is None else int(dbg.frame()["step"].nunique())
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return Result(workload, loop, config.key, 1e3 * statistics.median(plain_times),
                  1e3 * statistics.median(watched_times), statistics.median(ratios), q1, q3,
                  config.target, rounds, recorded)


def results_table(results: Sequence[Result]) -> Table:
    """A rich table of the results."""
    table = Table(title="graddebug overhead on TensorFlow/Keras (median of rounds)")
    for column in ("workload", "loop", "config", "plain ms", "watched ms", "ratio", "IQR",
                   "over floor", "target", "met"):
        table.add_column(column, justify="right" if column not in ("workload", "loop") else "left")
    labels = {c.key: c.label for c in CONFIGS}
    floors = {(r.workload, r.loop): r.ratio for r in results if r.config == "f"}
    for r in results:
        floor = floors.get((r.workload, r.loop))
        table.add_row(
            r.workload, r.loop, labels[r.config], f"{r.plain_ms:.2f}", f"{r.watched_ms:.2f}",
            f"{r.ratio:.3f}", f"{r.q1:.2f}-{r.q3:.2f}",
            f"{r.ratio - floor:+.3f}" if floor is not None and r.config != "f" else "",
            f"<= {r.target:.2f}" if math.isfinite(r.target) else "",
            ("yes" if r.ratio <= r.target else "no") if math.isfinite(r.target) else "")
    return table


def environment() -> dict[str, Any]:
    """Versions and machine facts for the JSON."""
    return {
        "python": sys.version.split()[0],
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "graddebug": graddebug.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    parser.add_argument("--configs", nargs="+", choices=[c.key for c in CONFIGS],
                        default=[c.key for c in CONFIGS])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--fit-steps", type=int, default=30,
                        help="steps per fit() call; enough to amortise fit's own set-up")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table and write the JSON."""
    args = parse_args(argv)
    console = Console(width=140)
    results = []
    for workload in args.workloads:
        for loop in args.loops:
            for config in CONFIGS:
                if config.key not in args.configs or (config.key == "f" and loop == "fit"):
                    continue
                console.log(f"{workload} / {loop} / {config.label}")
                results.append(bench(workload, loop, config, args.rounds, args.steps_per_round,
                                     args.fit_steps))
    console.print(results_table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "environment": environment(),
        "settings": {"rounds": args.rounds, "steps_per_round": args.steps_per_round,
                     "fit_steps": args.fit_steps},
        "results": [asdict(r) for r in results],
    }, indent=2))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
