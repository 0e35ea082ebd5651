"""The method of the overhead benchmarks: single steps timed in pairs, ratios of watched over
plain step times, their 95% bootstrap intervals, the verdict against a target, and the malloc
settings both sides run under (:func:`steady_allocator`, used by ``overhead_torch.py``).

Shared by ``overhead_torch.py`` and ``overhead_tf.py``; it imports no framework. A round is a
run of pairs (or, for ``model.fit``, one plain and one watched ``fit`` call); the intervals
resample whole rounds, each plain round with its watched one.
"""

from __future__ import annotations

import ctypes
import random
import statistics
import sys
from collections.abc import Callable, Sequence

__all__ = ["BOOTSTRAP_RESAMPLES", "STEADY_HEAP_BYTES", "Estimate", "alternate",
           "bootstrap_interval", "pair_ratios", "pairs_estimator", "position_ratio", "quartiles",
           "rounds_estimator", "steady_allocator", "verdict"]

BOOTSTRAP_RESAMPLES = 2000
"""Resamples of the rounds behind each ratio's 95% interval."""

Estimate = Callable[[Sequence[int]], float]
"""A ratio taken over the rounds at the given indices (a round may come more than once)."""

STEADY_HEAP_BYTES = 32 << 20
"""Under :func:`steady_allocator`, the largest allocation glibc serves from its heap: the
highest mmap threshold it accepts on a 64-bit machine."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from glibc's malloc.h
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols the process has loaded, the C library's among them
    except OSError:
        return None
    # gnu_get_libc_version is glibc's own: other C libraries may stub mallopt out.
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def steady_allocator() -> bool:
    """Fix glibc's malloc thresholds for the rest of the process, so that where a large
    buffer comes from no longer depends on what the process freed before.

    By default glibc serves an allocation above its mmap threshold with fresh pages from the
    system, which fault in on first touch and go back when freed, and smaller ones from its
    heap. It raises the threshold each time such a block is freed, and gives the top of the
    heap back to the system past a trim threshold that moves with it. Two twins that allocate
    the same activations every step can therefore settle into different states, one reusing
    heap memory and the other faulting in fresh pages every step. Under ``torch.compile`` the
    null config read anywhere from 0.85 to 1.14 from one pair of compiled twins to the next in
    one process; with the thresholds fixed, 0.98 to 1.03.

    Fixed here: every allocation up to :data:`STEADY_HEAP_BYTES` comes from the heap, and the
    heap is never trimmed, so a training loop reuses the same memory every step and takes no
    page fault. (With glibc's defaults even the benchmark's plain MLP, alone in a process, took
    2,000-2,600 minor page faults a step.)

    Returns:
        Whether the thresholds were set: False where the C library is not glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, STEADY_HEAP_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))


def alternate(plain: Callable[[], float], watched: Callable[[], float], pairs: int,
              watched_first: bool) -> tuple[list[float], list[float]]:
    """Run ``pairs`` pairs of one plain and one watched step back to back, the order within a
    pair flipping from pair to pair; return what each call returned (its seconds), plain and
    watched, in pair order.

    Load from elsewhere on a shared machine comes in bursts far longer than a step, so both
    steps of a pair meet the same load and the pair's ratio cancels it.

    Args:
        plain: Runs and times one plain step.
        watched: Runs and times one watched step.
        pairs: How many pairs the round has.
        watched_first: Whether the round's first pair starts with the watched step.
    """
    plain_times: list[float] = []
    watched_times: list[float] = []
    for k in range(pairs):
        if (k % 2 == 0) != watched_first:
            plain_times.append(plain())
        watched_times.append(watched())
        if (k % 2 == 0) == watched_first:
            plain_times.append(plain())
    return plain_times, watched_times


def pair_ratios(watched: Sequence[float], plain: Sequence[float]) -> list[float]:
    """Each pair's watched step time over its plain step time.

    Raises:
        ValueError: The two sides hold different numbers of steps.
    """
    return [w / p for w, p in zip(watched, plain, strict=True)]


def position_ratio(watched: Sequence[Sequence[float]], plain: Sequence[Sequence[float]]) -> float:
    """Watched over plain per-step cost of rounds where only some steps are recorded.

    With ``every=N`` one step in N is recorded, at the same position of each round (rounds
    hold a multiple of N pairs and start on a recorded step), so a median over the pairs would
    hide it and a mean is decided by the few pairs that load from elsewhere hit unevenly. Each
    position of the round takes the median over the rounds of its pairs' ratios instead, which
    keeps what graddebug does at that position (the recorded step, the step after it), drops
    the bursts and, like every pair, cancels the machine's drift; the ratio is the mean of
    these medians over the positions (a plain step costs the same at every position).

    Args:
        watched: Per round, every watched step's time, in pair order.
        plain: Per round, every plain step's time, in pair order (the same number of steps).
    """
    per_position = zip(*(pair_ratios(w, p) for w, p in zip(watched, plain, strict=True)),
                       strict=True)
    return statistics.fmean(statistics.median(at) for at in per_position)


def pairs_estimator(watched: Sequence[Sequence[float]], plain: Sequence[Sequence[float]],
                    every: int = 1) -> Estimate:
    """The ratio of rounds of pairs: the median of the ratios of all the picked rounds' pairs,
    or with ``every`` above 1 their :func:`position_ratio`.

    Args:
        watched: Per round, every watched step's time, in pair order.
        plain: Per round, every plain step's time, in pair order.
        every: The watch's ``every=``: one step in this many is recorded.
    """
    if every > 1:
        return lambda picked: position_ratio([watched[i] for i in picked],
                                             [plain[i] for i in picked])
    per_round = [pair_ratios(w, p) for w, p in zip(watched, plain, strict=True)]
    return lambda picked: statistics.median(r for i in picked for r in per_round[i])


def rounds_estimator(round_ratios: Sequence[float]) -> Estimate:
    """The ratio of rounds that are not made of pairs (``model.fit`` calls): the median of the
    picked rounds' own ratios."""
    return lambda picked: statistics.median(round_ratios[i] for i in picked)


def bootstrap_interval(estimate: Estimate, rounds: int, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of ``estimate``: the rounds resampled with
    replacement :data:`BOOTSTRAP_RESAMPLES` times, each plain round with its watched one.

    Args:
        estimate: The ratio over the rounds at the given indices.
        rounds: How many rounds there are.
        seed: The resampling's seed, so that a run's interval can be reproduced from its JSON.

    Raises:
        ValueError: ``rounds`` is below 1.
    """
    if rounds < 1:
        raise ValueError(f"a bootstrap interval needs at least one round, got {rounds}")
    rng = random.Random(seed)
    values = sorted(estimate(rng.choices(range(rounds), k=rounds))
                    for _ in range(BOOTSTRAP_RESAMPLES))
    return values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]


def verdict(low: float, high: float, target: float) -> str:
    """``"pass"`` when the whole interval ``[low, high]`` lies at or under ``target``,
    ``"FAIL"`` when it lies above, ``"within noise"`` when it holds the target."""
    if high <= target:
        return "pass"
    return "FAIL" if low > target else "within noise"


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (both the value itself for one value).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("quartiles of no values")
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]
