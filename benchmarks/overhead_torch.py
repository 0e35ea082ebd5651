"""Step-time overhead of graddebug on PyTorch: watched over plain, median over pairs of steps.

Run by hand (it is a benchmark, not a test)::

    python benchmarks/overhead_torch.py                       # all workloads, both configs
    python benchmarks/overhead_torch.py --rounds 15 --steps-per-round 10 --workloads mlp
    python benchmarks/overhead_torch.py --profile --workloads transformer
    python benchmarks/overhead_torch.py --compile --workloads mlp,transformer,resnet18

A training step is ``zero_grad, forward, loss, backward, SGD step`` and, when watched,
``dbg.step()`` right after ``backward`` (as the library documents). The plain and the watched side
are twins: two copies of one model, each with its own optimizer, on the same batch, in one
process. Steps are timed one by one in pairs, one plain step of the plain twin and one watched
step of the watched twin back to back, the order flipping from pair to pair; load from elsewhere
on a shared machine comes in bursts far longer than a step, so both steps of a pair meet the same
load and the pair's ratio cancels it. A round is a run of such pairs under one config; the
configs take turns round by round, and the order of the first pair flips from one round to the
next and from one config to the next. Each configuration builds one ``Watcher`` for the watched
twin and enters it around every round, so the plain twin never carries a graddebug hook, and the
one-off cost of entering and leaving (attaching and removing hooks) is timed separately, not
charged to the steps, because a real run enters once for thousands of steps. The ratio of a config
is the median over all its pairs of the watched step's time over the plain one's. Config (c)
records one step in 10, which a median would hide: its ratio is the mean over the positions of
a round of each position's median pair ratio over the rounds (``position_ratio``). Config (n)
runs the watched twin plain too: its ratio is the method's own bias and noise. Next to each
ratio the table gives its 95% bootstrap interval (the rounds resampled with replacement, the
ratio taken again from each resample), and the result column says ``pass`` or ``FAIL`` only
when the whole interval lies on one side of the target, ``within noise`` when it holds the
target.

With ``--compile`` both sides run ``torch.compile``d models, and the script also counts the graph
breaks and compiled graphs of a few steps, plain and under each config, each from a clean dynamo
state (``torch._dynamo.utils.counters``, backend "eager": breaks are dynamo's). Dynamo does not
guard on hooks added to a module after a hook-free graph of its class was compiled
(``torch._dynamo.config.skip_nnmodule_hook_guards``), so the watched side is a copy of the model
under a subclass of its class, compiled apart: sharing one model, the plain rounds' graph would
serve the watched rounds too, without graddebug's hooks. For the same reason each config gets a
compiled watched copy of its own: a config without graddebug, such as (n), would have dynamo
compile a hook-free graph that the next config's rounds would run. The ``rows/step`` column
shows that the watched rounds recorded.

Before any model is built the script fixes glibc's malloc thresholds (``ratios.steady_allocator``;
``--default-allocator`` leaves them). Left to glibc, the twins settle into different page-fault
patterns, set by the order in which the process allocated and freed before: in one measured run
the plain twin took no minor page fault a step and the watched twin 200-320, with graddebug and
with the hand-written floor (g) alike, and compiled twins with no graddebug at all read 0.85 to
1.14 of each other from one pair to the next. With the thresholds fixed, both twins take none.

This file is the command line; the rest lives beside it: ``torch_configs.py`` (the configs and
the stand-ins of those without graddebug), ``torch_workloads.py`` (the models, their batches,
twins and training step), ``torch_timing.py`` (pairs, rounds, each config's ratio),
``torch_results.py`` (the table and the JSON), ``torch_profile.py`` (``--profile``), and
``ratios.py`` (the statistics, shared with ``overhead_tf.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its modules, also when loaded by path
from ratios import steady_allocator
from torch_configs import CONFIGS, Config
from torch_profile import profile_workload
from torch_results import Result, environment, results_table, write_json
from torch_timing import benchmark_workload
from torch_workloads import CENSUS_STEPS, DEFAULT_WORKLOADS, WORKLOADS

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "overhead_torch.json"
COMPILED_JSON = DEFAULT_JSON.with_name("overhead_torch_compile.json")


# -- command line ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        The parsed options, with ``workload_names`` (the workloads to run, in order) and
        ``config_list`` (the chosen configs, in :data:`CONFIGS` order) added, and ``json`` set
        to its default where it was not given.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup < 0:
        parser.error("--rounds and --steps-per-round must be >= 1, --warmup >= 0")
    args.workload_names = _workload_names(parser, args)
    if args.profile and args.compile:
        parser.error("--profile profiles eager steps; leave out --compile")
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the first round compiles")
    if args.json is None:
        args.json = COMPILED_JSON if args.compile else DEFAULT_JSON
    args.config_list = _config_list(parser, args)
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Step-time overhead of graddebug.watch on PyTorch (watched / plain).",
    )
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per config")
    parser.add_argument("--steps-per-round", type=int, default=10,
                        help="pairs of steps (one plain, one watched) in each round")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds per config before the timed ones")
    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated, from {','.join(WORKLOADS)} (default: "
                             f"{','.join(DEFAULT_WORKLOADS)}; with --profile: mlp; gpt2 "
                             "needs transformers)")
    parser.add_argument("--configs", default="a,b",
                        help="comma-separated, from a,b,c,o,d,f,g,n (c: b recording every 10th "
                             "step; o: b with ops=True; d: detect_anomaly, no graddebug; "
                             "f: the floor, one _foreach_norm pass; g: f and hand-written "
                             "output hooks, the floor of b; n: both twins plain)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"where to write results (default: {DEFAULT_JSON.name}, with "
                             f"--compile {COMPILED_JSON.name}, in {DEFAULT_JSON.parent})")
    parser.add_argument("--compile", action="store_true",
                        help="run both sides under torch.compile and count graph breaks")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's own choice); 1 keeps a "
                             "shared, busy machine from thrashing")
    parser.add_argument("--default-allocator", action="store_true",
                        help="leave glibc's malloc thresholds as they are (by default they are "
                             "fixed, see ratios.steady_allocator: otherwise the twins can "
                             "settle into different page-fault patterns)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, cProfile one workload under the last of "
                             "--configs (default: b)")
    parser.add_argument("--profile-steps", type=int, default=30, help="steps under cProfile")
    parser.add_argument("--top", type=int, default=25, help="functions listed by --profile")
    return parser


def _workload_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    names: list[str] = args.workloads.split(",") if args.workloads else (
        ["mlp"] if args.profile else list(DEFAULT_WORKLOADS))
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown!r}; choose from {', '.join(WORKLOADS)}")
    if args.profile and len(names) != 1:
        parser.error("--profile takes exactly one workload, e.g. --workloads transformer")
    return names


def _config_list(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Config]:
    keys = args.configs.split(",")
    configs = [c for c in CONFIGS if c.key in keys]
    if len(configs) != len(keys):
        parser.error(f"--configs {args.configs!r}: choose from "
                     f"{','.join(c.key for c in CONFIGS)}")
    for config in configs:
        if args.steps_per_round % config.every and not args.profile:
            parser.error(f"--steps-per-round {args.steps_per_round}: {config.label} records one "
                         f"step in {config.every}, so a round must hold a multiple of "
                         f"{config.every} steps")
    return configs


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or the profile) and report.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        The exit status: 0 (missing a target is reported, not an error).
    """
    args = parse_args(argv)
    # Before any model is built: the twins' buffers come from the allocator as it is set now.
    allocator = "default" if args.default_allocator or not steady_allocator() else "steady"
    if args.threads:
        torch.set_num_threads(args.threads)
    # Redirected output would otherwise wrap the table at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 132)
    device = torch.device(args.device)
    if args.profile:
        name = args.workload_names[0]
        dump = args.json.parent / f"profile_{name}_{args.config_list[-1].key}.prof"
        profile_workload(name, args.config_list[-1], args.profile_steps, args.steps_per_round,
                         device, args.top, console, dump)
        console.print(f"raw stats: {dump}")
        return 0

    env = environment()
    console.print(f"torch {env['torch']}, {env['torch_threads']} threads, device {device}; "
                  f"{args.rounds} rounds x {args.steps_per_round} pairs of steps, "
                  f"{args.warmup} warm-up round(s); allocator: {allocator}")
    results: list[Result] = []
    for name in args.workload_names:
        results += benchmark_workload(name, args.config_list, args.rounds, args.steps_per_round,
                                      args.warmup, device, console, args.compile)
    title = (f"graddebug overhead{' under torch.compile' if args.compile else ''}, "
             f"torch {env['torch']} on {device} "
             f"({env['torch_threads']} threads), median of {args.rounds} rounds x "
             f"{args.steps_per_round} pairs of steps")
    console.print(results_table(results, title))
    settings = {
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "warmup_rounds": args.warmup,
        "workloads": args.workload_names,
        "configs": [c.key for c in args.config_list],
        "device": str(device),
        "compile": args.compile,
        "census_steps": CENSUS_STEPS if args.compile else 0,
        "allocator": allocator,
    }
    write_json(args.json, results, settings)
    console.print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
