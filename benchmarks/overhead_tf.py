"""Step-time overhead of graddebug on TensorFlow/Keras: watched over plain, in pairs of steps.

Run by hand (it is a benchmark, not a test)::

    python benchmarks/overhead_tf.py                         # every workload, loop and config
    python benchmarks/overhead_tf.py --workloads mlp --loops function --rounds 21

Four ways of training are measured for each workload:

- ``function``: a custom ``tf.function`` train step (forward, loss, ``tape.gradient``,
  ``optimizer.apply_gradients``) with ``dbg.step(grads)`` after it when watched;
- ``function_opt``: the same step, watched with ``watch(model, optimizer=opt)``, so that the
  parameter statistics are computed inside the compiled step, and ``dbg.step()`` after it;
- ``eager``: the ``function`` step run eagerly, op by op (a ``GradientTape`` loop with no
  ``tf.function``), with ``dbg.step(grads)`` after it when watched;
- ``fit``: ``model.fit`` on an in-memory dataset, with ``dbg.callback()`` when watched.

Configurations: (a) parameters only, (b) parameters and every layer output, (f) the floor
of parameter capture without graddebug (each gradient's norm inside the compiled step, read in
one transfer; not in ``fit``), and (n) the null: both twins plain, what the method
reads for a monitor that costs nothing. The table gives each row's distance to the floor.

Plain and watched run in one process, on twin copies of the model with the same weights, batch
and optimizer settings. Each watched configuration enters its Watcher once, as a real run would;
its train step is traced inside the ``with`` block, the plain one outside it, so the plain graph
holds no graddebug op at all. In every loop but ``fit`` single steps are timed in pairs, one
plain and one watched back to back, the order flipping from pair to pair and from round to
round: load from elsewhere on a shared machine comes in bursts far longer than a step, so both
steps of a pair meet the same load. The ratio is the median over every pair of watched / plain.
``fit`` cannot run a single batch without its own set-up, so there a round is one plain and one
watched ``fit`` call (in alternating order), a batch's time runs from one batch end to the next
(read by a clock callback that both sides carry, so both sync per batch), and the ratio is the
median over the rounds of each round's median watched batch over its median plain one. Each
ratio comes with its 95% bootstrap interval over the rounds, and the result column says ``pass``
or ``FAIL`` only when the whole interval lies on one side of the target (``benchmarks/ratios.py``).
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
from dataclasses import asdict, dataclass, field
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ratios.py, also when loaded by path
from ratios import (
    BOOTSTRAP_RESAMPLES,
    alternate,
    bootstrap_interval,
    pair_ratios,
    pairs_estimator,
    quartiles,
    rounds_estimator,
    verdict,
)

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "overhead_tf.json"
WORKLOADS: tuple[str, ...] = ("mlp", "cnn")
LOOPS: tuple[str, ...] = ("function", "function_opt", "eager", "fit")


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
    # The method's own reading of a monitor that costs nothing: both twins plain.
    Config("n", "(n) null: both twins plain", {"null": True}, math.inf),
)


@dataclass
class Result:
    """One (workload, loop, config) measurement.

    Attributes:
        workload: Workload name.
        loop: ``function``, ``function_opt``, ``eager`` or ``fit``.
        config: Config key.
        target: The ratio the config must stay under.
        plain_ms: Median over the rounds of the plain round's median step time (ms).
        watched_ms: The same for the watched side.
        ratio: In every loop but ``fit``, the median over every pair of watched / plain;
            in ``fit``, the median over the rounds of their ratios.
        ratio_low: Lower end of the 95% bootstrap interval of ``ratio`` (the rounds resampled
            with replacement).
        ratio_high: Its upper end.
        q1: First quartile of the rounds' ratios.
        q3: Third quartile of the rounds' ratios.
        verdict: ``"pass"`` when the whole interval lies under the target, ``"FAIL"`` when it
            lies above, ``"within noise"`` when it holds the target.
        rounds: Timed rounds.
        recorded_steps: Steps the watcher recorded, warm-up included.
        round_ratios: Every round's ratio, in round order.
        plain_steps_ms: Every plain step's time (ms), per round: in pair order, or in ``fit``
            batch by batch.
        watched_steps_ms: The same for the watched side.
    """

    workload: str
    loop: str
    config: str
    target: float
    plain_ms: float = math.nan
    watched_ms: float = math.nan
    ratio: float = math.nan
    ratio_low: float = math.nan
    ratio_high: float = math.nan
    q1: float = math.nan
    q3: float = math.nan
    verdict: str = ""
    rounds: int = 0
    recorded_steps: int = 0
    round_ratios: list[float] = field(default_factory=list)
    plain_steps_ms: list[list[float]] = field(default_factory=list)
    watched_steps_ms: list[list[float]] = field(default_factory=list)


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
              norms: bool = False, eager: bool = False) -> Callable[..., Any]:
    """A compiled train step returning the gradients (traced on its first call); with
    ``norms``, also, last, the norm of every parameter gradient (the floor (f): the cheapest
    parameter capture, one reduction a gradient, inside the step); with ``eager``, the same
    step run eagerly, op by op."""

    def step(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if norms:
            return [*grads, tf.stack([tf.linalg.global_norm([g]) for g in grads])]
        return grads

    return step if eager else tf.function(step)


def timed_step(step: Callable[..., Any], x: tf.Tensor, y: tf.Tensor,
               dbg: graddebug.Watcher | None, hand_over: bool) -> float:
    """Seconds of one call of ``step`` and ``dbg.step`` after it (``hand_over`` passes it the
    gradients); without ``dbg``, of the call and the read of its last output, so that both
    sides end on one transfer to the host."""
    start = time.perf_counter()
    grads = step(x, y)
    if dbg is not None:
        dbg.step(grads if hand_over else None)
    else:
        grads[-1].numpy()
    return time.perf_counter() - start


class _BatchClock(keras.callbacks.Callback):
    """Times each batch of ``fit`` from one batch end to the next (both sides get one, so both
    sync per batch and Keras' per-call set-up stays out of the median)."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[float] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.ends.append(time.perf_counter())


def time_fit_round(model: keras.Model, data: tf.data.Dataset, steps: int,
                   callbacks: list[Any]) -> list[float]:
    """Seconds of each batch but the first of one ``fit`` call over ``steps`` batches, from
    one batch end to the next (the callbacks run before the clock reads, so graddebug's work
    counts)."""
    clock = _BatchClock()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
              callbacks=[*callbacks, clock])
    return [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]


def twin(name: str) -> tuple[keras.Model, keras.Model, np.ndarray, np.ndarray, Any]:
    """Two copies of a workload's model with equal weights, and its batch and loss."""
    plain, x, y, loss = build_model(name)
    watched, _, _, _ = build_model(name)
    watched.set_weights(plain.get_weights())
    return plain, watched, x, y, loss


_Round = Callable[[bool], tuple[list[float], list[float]]]
"""Runs one round, the watched side first or not; returns the plain and watched seconds."""


def bench(workload: str, loop: str, config: Config, rounds: int, steps: int,
          fit_steps: int) -> Result:
    """Measure one configuration: a warm-up round, then ``rounds`` timed ones.

    Args:
        workload: Workload name.
        loop: ``function``, ``function_opt``, ``eager`` or ``fit``.
        config: The configuration.
        rounds: Timed rounds.
        steps: Pairs of steps a round in every loop but ``fit``.
        fit_steps: Batches of each ``fit`` call.

    Returns:
        Every round's steps, the ratio, its interval and its verdict.
    """
    plain, watched, x, y, loss = twin(workload)
    res = Result(workload, loop, config.key, config.target, rounds=rounds)
    optimizer = keras.optimizers.SGD(1e-4)
    floor = bool(config.options.get("floor"))
    bare = floor or bool(config.options.get("null"))  # no graddebug on either side
    options = {**config.options, **({"optimizer": optimizer} if loop == "function_opt" else {})}
    with (contextlib.nullcontext() if bare else graddebug.watch(watched, **options)) as dbg:
        run = (_fit_rounds(plain, watched, x, y, loss, dbg, fit_steps) if loop == "fit" else
               _step_rounds(plain, watched, x, y, loss, optimizer, dbg, loop, floor, steps))
        run(False)  # warm-up round
        for r in range(rounds):
            plain_times, watched_times = run(r % 2 == 1)
            res.plain_steps_ms.append([t * 1e3 for t in plain_times])
            res.watched_steps_ms.append([t * 1e3 for t in watched_times])
            res.round_ratios.append(
                statistics.median(pair_ratios(watched_times, plain_times)) if loop != "fit"
                else statistics.median(watched_times) / statistics.median(plain_times))
    res.recorded_steps = 0 if dbg is None else int(dbg.frame()["step"].nunique())
    _summarise(res)
    return res


def _step_rounds(plain: keras.Model, watched: keras.Model, x: np.ndarray, y: np.ndarray,
                 loss: Any, optimizer: Any, dbg: graddebug.Watcher | None, loop: str,
                 floor: bool, steps: int) -> _Round:
    """Trace both sides' steps (the watched one closing its first step), and return a round
    of ``steps`` pairs of single steps."""
    xs, ys = tf.constant(x), tf.constant(y)
    eager = loop == "eager"
    plain_step = make_step(plain, loss, keras.optimizers.SGD(1e-4), eager=eager)
    watched_step = make_step(watched, loss, optimizer, norms=floor, eager=eager)
    plain_step(xs, ys)
    grads = watched_step(xs, ys)  # trace both before timing
    if dbg is not None:
        dbg.step(grads)
    hand_over = loop != "function_opt"

    def run(watched_first: bool) -> tuple[list[float], list[float]]:
        return alternate(
            lambda: timed_step(plain_step, xs, ys, None, hand_over),
            lambda: timed_step(watched_step, xs, ys, dbg, hand_over),
            steps, watched_first)

    return run


def _fit_rounds(plain: keras.Model, watched: keras.Model, x: np.ndarray, y: np.ndarray,
                loss: Any, dbg: graddebug.Watcher | None, fit_steps: int) -> _Round:
    """Compile both sides and fit each two batches, and return a round of one ``fit`` call
    of ``fit_steps`` batches a side."""
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    for model in (plain, watched):
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss)
    callbacks = [] if dbg is None else [dbg.callback()]
    plain.fit(data, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)
    watched.fit(data, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False,
                callbacks=callbacks)

    def run(watched_first: bool) -> tuple[list[float], list[float]]:
        if watched_first:
            watched_times = time_fit_round(watched, data, fit_steps, callbacks)
            return time_fit_round(plain, data, fit_steps, []), watched_times
        plain_times = time_fit_round(plain, data, fit_steps, [])
        return plain_times, time_fit_round(watched, data, fit_steps, callbacks)

    return run


def _summarise(res: Result) -> None:
    """Fill in ``res``'s step times, ratio, interval and verdict from its rounds."""
    res.plain_ms = statistics.median(statistics.median(t) for t in res.plain_steps_ms)
    res.watched_ms = statistics.median(statistics.median(t) for t in res.watched_steps_ms)
    estimate = (rounds_estimator(res.round_ratios) if res.loop == "fit"
                else pairs_estimator(res.watched_steps_ms, res.plain_steps_ms))
    res.ratio = estimate(range(res.rounds))
    res.ratio_low, res.ratio_high = bootstrap_interval(estimate, res.rounds)
    res.q1, res.q3 = quartiles(res.round_ratios)
    res.verdict = verdict(res.ratio_low, res.ratio_high, res.target)


def results_table(results: Sequence[Result], title: str) -> Table:
    """A rich table of the results, with each row's distance to its loop's floor."""
    table = Table(title=title, title_justify="left")
    for column in ("workload", "loop", "config", "plain ms", "watched ms", "ratio",
                   "95% interval", "over floor", "target", "result"):
        table.add_column(column, justify="right" if column not in ("workload", "loop") else "left")
    labels = {c.key: c.label for c in CONFIGS}
    floors = {(r.workload, r.loop): r.ratio for r in results if r.config == "f"}
    for r in results:
        floor = floors.get((r.workload, r.loop))
        judged = math.isfinite(r.target)
        colour = {"pass": "green", "FAIL": "red"}.get(r.verdict, "yellow")
        table.add_row(
            r.workload, r.loop, labels[r.config], f"{r.plain_ms:.2f}", f"{r.watched_ms:.2f}",
            f"{r.ratio:.3f}", f"{r.ratio_low:.3f}-{r.ratio_high:.3f}",
            f"{r.ratio - floor:+.3f}" if floor is not None and judged else "",
            f"<= {r.target:.2f}" if judged else "",
            f"[{colour}]{r.verdict}[/{colour}]" if judged else "")
    return table


def environment() -> dict[str, Any]:
    """Versions and machine facts for the JSON."""
    return {
        "python": sys.version.split()[0],
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "graddebug": graddebug.__version__,
        "machine": platform.machine(),
        "platform": platform.platform(),
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
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1 or args.fit_steps < 2:
        parser.error("--rounds and --steps-per-round must be >= 1, --fit-steps >= 2 (a batch "
                     "is timed from the end of the one before)")
    return args


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
                res = bench(workload, loop, config, args.rounds, args.steps_per_round,
                            args.fit_steps)
                judged = f" {res.verdict}" if math.isfinite(config.target) else ""
                console.log(f"  ratio {res.ratio:.3f} [{res.ratio_low:.3f}-{res.ratio_high:.3f}]"
                            f"{judged}", style="dim")
                results.append(res)
    console.print(results_table(results, (
        f"graddebug overhead, TF {tf.__version__} / Keras {keras.__version__}, {args.rounds} "
        f"rounds of {args.steps_per_round} pairs of steps (fit: of one {args.fit_steps}-batch "
        "call a side)")))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "benchmark": "overhead_tf",
        "method": "twin models in one process; function, function_opt and eager: single steps "
                  "timed in pairs "
                  "(one plain, one watched, the order flipping from pair to pair and round to "
                  "round), ratio the median over every pair of watched/plain; fit: a round is "
                  "one plain and one watched fit call in alternating order, batch times from "
                  "one batch end to the next, ratio the median over the rounds of the watched "
                  "over the plain median batch; ratio_low/ratio_high: 95% percentile bootstrap "
                  f"interval over {BOOTSTRAP_RESAMPLES} resamples of the rounds (seed 0)",
        "environment": environment(),
        "settings": {"rounds": args.rounds, "steps_per_round": args.steps_per_round,
                     "fit_steps": args.fit_steps, "workloads": args.workloads,
                     "loops": args.loops, "configs": args.configs},
        "results": [asdict(r) for r in results],
    }, indent=2) + "\n")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
