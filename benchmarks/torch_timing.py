"""The timing of ``overhead_torch.py``: single steps, pairs of a plain and a watched twin's
steps, rounds of pairs under each config in turn, and each config's ratio with its bootstrap
interval (the statistics are ``ratios.py``'s)."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from ratios import alternate, bootstrap_interval, pair_ratios, pairs_estimator, quartiles, verdict
from rich.console import Console
from torch import nn
from torch_configs import Config, make_watcher
from torch_results import Result
from torch_workloads import (
    Workload,
    build_workload,
    compiled_copy,
    graph_census,
    train_step,
    twin,
)

from graddebug import Watcher

__all__ = ["benchmark_workload", "step_times", "sync", "time_pairs", "time_steps", "timed_step"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU).

    Args:
        device: The workloads' device.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(work: Workload, dbg: Any, device: torch.device) -> float:
    """Run and time one :func:`train_step`, in seconds, the device synchronised at its end."""
    start = time.perf_counter()
    train_step(work, dbg)
    sync(device)
    return time.perf_counter() - start


def step_times(work: Workload, steps: int, dbg: Watcher | None,
               device: torch.device) -> list[float]:
    """Time ``steps`` consecutive training steps one by one; return their times, in seconds.

    Args:
        work: The workload to train.
        steps: How many steps the round has.
        dbg: An entered watcher, or None for plain steps.
        device: The workload's device, synchronised around every step.
    """
    # Collect leftovers from the previous round outside the clock; collections the round itself
    # triggers stay in, because they are part of its cost.
    gc.collect()
    sync(device)
    return [timed_step(work, dbg, device) for _ in range(steps)]


def time_steps(work: Workload, steps: int, dbg: Watcher | None, device: torch.device) -> float:
    """The median of :func:`step_times`, so that a burst of load from elsewhere on a shared
    machine that hits one or two steps does not decide the round."""
    return statistics.median(step_times(work, steps, dbg, device))


def time_pairs(plain: Workload, watched: Workload, steps: int, watcher: Any,
               device: torch.device, watched_first: bool) -> tuple[list[float], list[float], float]:
    """Enter ``watcher`` on the watched twin, time ``steps`` pairs of single steps, leave it.

    A pair is one plain step of ``plain`` and one watched step of ``watched``, back to back,
    the order within the pairs flipping from one pair to the next (:func:`ratios.alternate`).

    Args:
        plain: The plain twin, never watched.
        watched: The watched twin, the model ``watcher`` was built for.
        steps: How many pairs the round has.
        watcher: A Watcher (or a stand-in) for ``watched.model``, not entered.
        device: The workloads' device.
        watched_first: Whether the round's first pair starts with the watched step.

    Returns:
        The plain and the watched steps' times in pair order, in seconds, and the seconds spent
        entering plus leaving ``watcher``.

    Raises:
        RuntimeError: graddebug left a hook on a model, so later rounds would be unfair.
    """
    # Collect leftovers from the previous round outside the clock; collections the round itself
    # triggers stay in, because they are part of its cost.
    gc.collect()
    per_step = getattr(watcher, "per_step", contextlib.nullcontext)
    start = time.perf_counter()
    with watcher as dbg:
        entered = time.perf_counter()
        sync(device)

        def watched_step() -> float:
            with per_step():  # entered and left outside the step's clock
                return timed_step(watched, dbg, device)

        plain_times, watched_times = alternate(lambda: timed_step(plain, None, device),
                                               watched_step, steps, watched_first)
        leaving = time.perf_counter()
    enter_exit = (entered - start) + (time.perf_counter() - leaving)
    _check_no_hooks(watched.model)
    _check_no_hooks(plain.model)
    return plain_times, watched_times, enter_exit


def _check_no_hooks(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            raise RuntimeError(f"graddebug left a module hook on {name or 'the model'!r}")
    for name, param in model.named_parameters():
        if param._post_accumulate_grad_hooks or param._backward_hooks:
            raise RuntimeError(f"graddebug left a gradient hook on parameter {name!r}")


def benchmark_workload(
    name: str,
    configs: Sequence[Config],
    rounds: int,
    steps: int,
    warmup: int,
    device: torch.device,
    console: Console,
    compiled: bool = False,
) -> list[Result]:
    """Measure every config on one workload, in pairs of a plain and a watched twin's steps.

    Args:
        name: Workload name.
        configs: The watch configurations to compare with plain training.
        rounds: Timed rounds per config.
        steps: Pairs of steps per round.
        warmup: Untimed rounds per config before the timed ones (under ``compiled``, they
            take the compilation).
        device: Where to run.
        console: For progress lines.
        compiled: Run both sides under ``torch.compile`` and count graph breaks.

    Returns:
        One result per config, in ``configs`` order.
    """
    work = build_workload(name, device)
    results = {c.key: Result(name, c.key, c.label, c.target, compiled=compiled)
               for c in configs}
    console.print(f"[bold]{name}[/bold]: {work.description}, "
                  f"{sum(p.numel() for p in work.model.parameters()):,} parameters")
    if compiled:
        _count_graphs(name, configs, results, device, console)
    plain_work, watched_works = _twins(work, configs, compiled)
    watchers = {c.key: make_watcher(watched_works[c.key].model, c) for c in configs}
    enter_exit: dict[str, list[float]] = {c.key: [] for c in configs}
    for r in range(-warmup, rounds):
        for i, config in enumerate(configs):
            watcher = watchers[config.key]
            # Flip the order every round, and from one config to the next, so that drift
            # favours neither side.
            plain, watched, enter = time_pairs(plain_work, watched_works[config.key], steps,
                                               watcher, device,
                                               watched_first=(r + i) % 2 == 1)
            if r >= 0:
                _add_round(results[config.key], plain, watched, watcher.every)
                enter_exit[config.key].append(enter * 1e3)
        if r >= 0:
            line = "  ".join(
                f"{c.key}={results[c.key].round_ratios[-1]:.3f}" for c in configs
            )
            console.print(f"  round {r + 1:>2}/{rounds}  ratio {line}", style="dim")
    for config in configs:
        _summarise(results[config.key], config, watchers[config.key],
                   (warmup + rounds) * steps, enter_exit[config.key], console)
    return [results[c.key] for c in configs]


def _count_graphs(name: str, configs: Sequence[Config], results: dict[str, Result],
                  device: torch.device, console: Console) -> None:
    """Fill in each result's graph breaks and compiled graphs, plain and under its config."""
    plain_census = graph_census(name, None, device)
    for c in configs:
        res = results[c.key]
        res.graph_breaks_plain, res.graphs_plain = plain_census
        res.graph_breaks_watched, res.graphs_watched = graph_census(name, c.watch_options(),
                                                                    device)
        console.print(f"  {c.label}: graph breaks {res.graph_breaks_plain} plain, "
                      f"{res.graph_breaks_watched} watched; graphs {res.graphs_plain} "
                      f"plain, {res.graphs_watched} watched", style="dim")


def _twins(work: Workload, configs: Sequence[Config], compiled: bool
           ) -> tuple[Workload, dict[str, Workload]]:
    """The plain twin, and the watched twin of each config (one shared twin when eager)."""
    if not compiled:
        shared = twin(work)
        return work, {c.key: shared for c in configs}
    # One compiled twin per config: dynamo recompiles a model when its forward hooks go (a
    # config without graddebug), and the graph it compiled without hooks would then serve the
    # next config's rounds, whose hooks it does not guard on (graddebug warns of it): that
    # config would time a model that records no layer output.
    plain_work = compiled_copy(work, False)
    return plain_work, {c.key: compiled_copy(work, True) for c in configs}


def _add_round(res: Result, plain: list[float], watched: list[float], every: int) -> None:
    """Keep one timed round's steps (seconds) in ``res``, and its round summaries."""
    res.plain_steps_ms.append([t * 1e3 for t in plain])
    res.watched_steps_ms.append([t * 1e3 for t in watched])
    # A median would hide the one recorded step in N: every= rounds show their mean.
    summary = statistics.fmean if every > 1 else statistics.median
    res.plain_round_ms.append(summary(plain) * 1e3)
    res.watched_round_ms.append(summary(watched) * 1e3)
    res.round_ratios.append(
        res.watched_round_ms[-1] / res.plain_round_ms[-1] if every > 1
        else statistics.median(pair_ratios(res.watched_steps_ms[-1], res.plain_steps_ms[-1])))


def _summarise(res: Result, config: Config, watcher: Any, recorded_steps: int,
               enter_exit_ms: list[float], console: Console) -> None:
    """Fill in ``res``'s ratio, interval, verdict and the watcher's rows and findings."""
    rounds = len(res.plain_steps_ms)
    res.plain_ms = statistics.median(res.plain_round_ms)
    res.watched_ms = statistics.median(res.watched_round_ms)
    estimate = pairs_estimator(res.watched_steps_ms, res.plain_steps_ms, watcher.every)
    res.ratio = estimate(range(rounds))
    res.ratio_low, res.ratio_high = bootstrap_interval(estimate, rounds)
    res.ratio_q1, res.ratio_q3 = quartiles(res.round_ratios)
    res.ratio_best = min(res.watched_round_ms) / min(res.plain_round_ms)
    res.passed = res.ratio <= config.target
    res.verdict = verdict(res.ratio_low, res.ratio_high, config.target)
    res.rows_per_step = len(watcher.frame()) / recorded_steps
    res.findings = len(watcher.findings())
    res.enter_exit_ms = statistics.median(enter_exit_ms)
    if res.findings:
        found = watcher.findings()
        console.print(f"  [yellow]{config.label}: {res.findings} findings[/yellow] "
                      f"(issues: {sorted(set(found['issue']))}); first: "
                      f"{found['message'].iloc[0]}")
