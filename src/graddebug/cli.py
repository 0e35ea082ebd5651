"""The ``graddebug`` command line: ``graddebug demo``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

# TensorFlow reads these when it is first imported; set them before anything can import it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from rich.console import Console
from rich.markup import escape

from graddebug.console import print_frame
from graddebug.errors import GradDebugError, MissingFrameworkError

__all__ = ["main"]

FINDING_COLUMNS = ("step", "layer", "tensor", "issue", "severity", "value", "message")
SUMMARY_COLUMNS = ("layer", "tensor", "kind", "depth", "norm_median", "norm_min", "norm_max",
                   "zero_frac_median", "issues")


def _demo(args: argparse.Namespace, console: Console) -> int:
    try:
        from graddebug_torch.demo import run_demo
    except ImportError as exc:  # torch or the torch adapter missing
        raise MissingFrameworkError(
            f"graddebug demo trains a small torch model and needs torch and the torch "
            f"adapter ({exc}); install them with: pip install graddebug[torch]"
        ) from exc
    started = time.perf_counter()
    with console.status(f"training a 12-layer sigmoid MLP for {args.steps} steps..."):
        dbg = run_demo(steps=args.steps, seed=args.seed)
    console.print(
        f"[bold]graddebug demo[/bold]: a 12-layer sigmoid MLP with default init, "
        f"{args.steps} SGD steps on synthetic data, {time.perf_counter() - started:.1f} s."
    )
    print_frame(console, dbg.findings(), "Findings", FINDING_COLUMNS)
    print_frame(console, dbg.summary(), "Per-layer summary", SUMMARY_COLUMNS)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``graddebug`` command."""
    parser = argparse.ArgumentParser(prog="graddebug", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a built-in sigmoid MLP and show its findings")
    demo.add_argument("--steps", type=_positive, default=20, help="training steps (default 20)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = build_parser().parse_args(argv)
    # Tables need room; when piped, rich would otherwise fall back to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        code: int = args.func(args, console)
    except GradDebugError as exc:
        # The message may hold brackets ("graddebug[torch]") that rich would read as markup.
        console.print(f"[bold red]error:[/bold red] {escape(str(exc))}", soft_wrap=True)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
