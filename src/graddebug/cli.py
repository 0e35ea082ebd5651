"""The ``graddebug`` command line: ``graddebug demo``, ``graddebug report RUN`` and
``graddebug compare RUN_A RUN_B``.

Exit codes: 0 healthy, 1 when a run has error-severity findings (``report``), 2 for a bad
run or bad arguments. The command line never imports torch, TensorFlow or an adapter; ``demo``
asks the installed adapters for their demonstration through the ``graddebug_demo`` hook.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

# TensorFlow reads these when it is first imported; set them before anything can import it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import pandas as pd
from rich.console import Console

from graddebug.errors import GradDebugError, MissingFrameworkError, printable
from graddebug.frames import with_rank
from graddebug.report.console import (
    csv_text,
    frame_table,
    markdown_table,
    print_frame,
    terminal_text,
)

if TYPE_CHECKING:
    from graddebug.report.report import Report

__all__ = ["DESCRIPTION", "build_parser", "main", "version_text"]

DESCRIPTION = """\
Gradient debugging from the command line.

  graddebug demo                 train a built-in model that goes wrong, and show why
  graddebug report RUN           summarise a run that watch(log_dir=...) or save() wrote
  graddebug compare RUN_A RUN_B  per-layer gradient norm ratios between two runs

Exit codes: 0 healthy, 1 when a run has error findings (report), 2 for a bad run or bad
arguments. The command line imports no framework; demo uses an installed adapter."""

FINDING_COLUMNS = ("step", "layer", "tensor", "issue", "cause", "severity", "value",
                   "message")
SUMMARY_COLUMNS = ("layer", "tensor", "kind", "depth", "norm_median", "norm_min", "norm_max",
                   "zero_frac_median", "issues")
TABLES = ("findings", "issues", "worst", "summary")
LARGE_RUN_BYTES = 2_000_000
"""Runs with more Parquet bytes than this get a progress bar even when stderr is no terminal."""
LARGE_RUN_FILES = 50


def _demo(args: argparse.Namespace, console: Console) -> int:
    from graddebug.plugins import get_plugin_manager

    _check_outputs(args)
    started = time.perf_counter()
    with console.status(f"training the demo model for {args.steps} steps..."):
        report = get_plugin_manager().hook.graddebug_demo(steps=args.steps, seed=args.seed)
    if report is None:
        raise MissingFrameworkError(
            "graddebug demo trains a small model with an installed framework adapter, and "
            "none offers one; install the torch adapter with: pip install graddebug[torch]"
        )
    console.print(
        f"[bold]graddebug demo[/bold]: {terminal_text(report.metadata.get('demo', ''))} "
        f"({time.perf_counter() - started:.1f} s)."
    )
    findings = report.findings()
    print_frame(console, findings, "Findings", with_rank(findings, FINDING_COLUMNS))
    print_frame(console, report.summary(), "Per-layer summary", SUMMARY_COLUMNS)
    if args.log_dir is not None:
        written = report.save(args.log_dir)
        console.print(f"wrote the run to {terminal_text(written)}: "
                      f"graddebug report {terminal_text(written)}", soft_wrap=True)
    if args.html is not None:
        report.to_html(args.html)
        console.print(f"wrote {terminal_text(args.html)}", soft_wrap=True)
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse the demo's ``--log-dir`` and ``--html`` before training, not after it.

    Raises:
        RunFileError: ``--log-dir`` is a file or a directory that holds something else.
        ConfigError: The folder of ``--html`` does not exist.
    """
    from graddebug.errors import ConfigError, RunFileError
    from graddebug.runs.layout import check_run_path
    from graddebug.runs.writer import check_save_target

    if args.log_dir is not None:
        check_run_path(args.log_dir, "--log-dir", RunFileError)
        check_save_target(args.log_dir)
    if args.html is not None and not Path(args.html).resolve().parent.is_dir():
        raise ConfigError(f"--html {args.html!r}: its folder does not exist; create it first")


# -- progress --------------------------------------------------------------------------------


def _run_size(path: Path) -> tuple[int, int]:
    files = [f for f in path.rglob("*.parquet") if f.is_file()] if path.is_dir() else []
    return len(files), sum(f.stat().st_size for f in files)


@contextmanager
def _progress(args: argparse.Namespace, description: str, paths: Sequence[Path]
              ) -> Iterator[Callable[[int, int], None] | None]:
    """Yield a ``progress(done, total)`` callback drawing a bar on stderr, or None.

    The bar shows when stderr is a terminal, or when the runs are large (many or big files),
    unless ``--no-progress``; ``--progress`` always shows it.
    """
    err = Console(stderr=True)
    show = args.progress
    if show is None:
        files, size = map(sum, zip(*(_run_size(p) for p in paths), strict=True))
        show = err.is_terminal or size >= LARGE_RUN_BYTES or files >= LARGE_RUN_FILES
    if not show:
        yield None
        return
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                  console=err, transient=err.is_terminal) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _load(args: argparse.Namespace, path: str) -> Report:
    from graddebug.report.load import load

    with _progress(args, f"loading {path}", [Path(path)]) as update:
        return load(path, progress=update)


# -- report ----------------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "item"):  # numpy scalars
        return _json_value(value.item())
    return value


def _json_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    names = [str(c) for c in frame.columns]
    return [{n: _json_value(v) for n, v in zip(names, row, strict=True)}
            for row in frame.itertuples(index=False, name=None)]


def _tables(report: Report, top: int) -> dict[str, pd.DataFrame]:
    from graddebug.report.digest import issue_table, worst_layers

    findings, summary = report.findings(), report.summary()
    return {
        "findings": findings,
        "issues": issue_table(findings),
        "worst": worst_layers(summary, findings, top),
        "summary": summary,
    }


def _ranks(meta: dict[str, Any]) -> str:
    """``"2 ranks (gloo)"`` for a multi-rank run, ``"2 replicas (MirroredStrategy)"`` for the
    replicas of one process, else empty."""
    size = meta.get("world_size")
    if not isinstance(size, int) or size <= 1:
        return ""
    backend = meta.get("backend")
    unit = "replicas" if meta.get("processes") == 1 else "ranks"
    return f"{size} {unit}" + (f" ({backend})" if backend else "")


def _headline(report: Report, path: str) -> str:
    meta = report.metadata
    run = meta.get("run") or {}
    state = ("[bold yellow]incomplete[/]: the process stopped before graddebug finished; "
             f"recovered {run.get('steps')} recorded steps, up to step {run.get('last_step')}"
             if run.get("status") == "incomplete" else "complete")
    framework = " ".join(str(meta.get(k)) for k in ("framework", "framework_version")
                         if meta.get(k))
    facts = ", ".join(terminal_text(x) for x in (
        framework, meta.get("model"), f"{report.frame()['step'].nunique()} recorded steps",
        f"{len(report.summary())} tensors", _ranks(meta),
        meta.get("started") and f"started {meta['started']}",
        meta.get("host") and f"on {meta['host']}") if x)
    return f"[bold]graddebug report[/bold] {terminal_text(path)} ({state})\n{facts}"


def _report(args: argparse.Namespace, console: Console) -> int:
    from graddebug.report.digest import ISSUE_COLUMNS, WORST_COLUMNS

    report = _load(args, args.run)
    errors = int((report.findings()["severity"] == "error").sum())
    if args.html is not None:
        from graddebug.report.html import render_html

        stages = ["gradient flow plot", "heatmap", "tables"]
        with _progress(args, f"rendering {args.html}", [Path(args.run)]) as update:
            def stage(name: str) -> None:
                if update is not None:
                    update(stages.index(name), len(stages))

            page = render_html(report, progress=stage)
            if update is not None:
                update(len(stages), len(stages))
        Path(args.html).write_text(page, encoding="utf-8")
        Console(stderr=True).print(f"wrote {terminal_text(args.html)}")
    if args.tensorboard is not None:
        from graddebug.integrations.tensorboard import write_report

        write_report(report, args.tensorboard)
        Console(stderr=True).print(f"wrote TensorBoard events to {terminal_text(args.tensorboard)}")
    tables = _tables(report, args.top)
    if args.format == "csv":
        sys.stdout.write(csv_text(tables[args.table or "findings"]))
    elif args.format == "json":
        payload = {"run": report.metadata.get("run"),
                   "metadata": {k: v for k, v in report.metadata.items() if k != "run"},
                   "thresholds": report.thresholds.as_dict(),
                   **{name: _json_rows(frame) for name, frame in tables.items()
                      if args.table in (None, name)}}
        sys.stdout.write(json.dumps(payload, indent=1, default=str, allow_nan=False) + "\n")
    elif args.format == "markdown":
        if args.table:
            sys.stdout.write(markdown_table(tables[args.table]))
        else:
            sys.stdout.write(f"## graddebug report: `{printable(args.run)}`\n\n"
                             "### Findings by issue\n\n"
                             f"{markdown_table(tables['issues'], ISSUE_COLUMNS)}\n"
                             f"### Worst layers\n\n"
                             f"{markdown_table(tables['worst'], WORST_COLUMNS)}")
    else:
        console.print(_headline(report, args.run))
        if tables["issues"].empty:
            console.print("[bold green]No finding[/]: the gradients look healthy.")
        else:
            console.print(frame_table(tables["issues"], "Findings by issue", ISSUE_COLUMNS))
        print_frame(console, tables["worst"], f"Worst layers (top {args.top})", WORST_COLUMNS)
        if errors:
            console.print(f"[bold red]{errors} error finding(s)[/]: exit code 1.")
    return 1 if errors else 0


def _compare(args: argparse.Namespace, console: Console) -> int:
    from graddebug.report.digest import COMPARE_COLUMNS, compare_runs

    a, b = _load(args, args.run_a), _load(args, args.run_b)
    table = compare_runs(a.summary(), b.summary())
    if args.format == "csv":
        sys.stdout.write(csv_text(table))
    elif args.format == "json":
        payload = {"a": args.run_a, "b": args.run_b, "layers": _json_rows(table)}
        sys.stdout.write(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    elif args.format == "markdown":
        sys.stdout.write(markdown_table(table, COMPARE_COLUMNS))
    else:
        styles = ["bold red" if r >= args.flag or r <= 1 / args.flag else ""
                  for r in table["ratio"].fillna(1.0)]
        title = (f"Median gradient norm per tensor, ratio = B / A "
                 f"(A: {terminal_text(args.run_a)}, B: {terminal_text(args.run_b)}; "
                 f"bold red: a factor of {args.flag:g} or more)")
        console.print(frame_table(table, title, COMPARE_COLUMNS, row_styles=styles))
    return 0


# -- parser ----------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def _factor(text: str) -> float:
    value = float(text)
    if not value > 1:
        raise argparse.ArgumentTypeError(f"must be a number above 1, not {text!r}")
    return value


def _output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("text", "csv", "json", "markdown"), default="text",
                        help="text (default, for people) or machine-readable output on stdout; "
                             "JSON writes NaN as null and infinities as \"inf\"; CSV text "
                             "cells that start with = + - @ get a leading ' so that "
                             "spreadsheets do not run them as formulas")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="always show a progress bar on stderr")
    group.add_argument("--no-progress", dest="progress", action="store_false",
                       help="never show one (default: when stderr is a terminal, or the run "
                            "is large)")


def version_text() -> str:
    """``graddebug X.Y.Z``, then each installed adapter's distribution and version, one a line.

    The adapters are read from the ``graddebug`` entry-point group's metadata; none is imported.
    """
    from importlib.metadata import entry_points

    from graddebug._version import __version__

    adapters = sorted({(ep.dist.name, ep.dist.version) for ep in entry_points(group="graddebug")
                       if ep.dist is not None})
    lines = [f"graddebug {__version__}"]
    lines += [f"  {name} {version}" for name, version in adapters]
    return "\n".join(lines)


class _Version(argparse.Action):
    """``--version``: print :func:`version_text` and exit; the metadata is read only then."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``graddebug`` command."""
    parser = argparse.ArgumentParser(prog="graddebug", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version,
                        help="print the versions of graddebug and its installed adapters")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a built-in sigmoid MLP and show its findings",
        description="Train a built-in 12-layer sigmoid MLP for a few steps under watch() and "
                    "show its findings and per-layer summary; --log-dir keeps the run for "
                    "'graddebug report', --html writes its report page.")
    demo.add_argument("--steps", type=_positive, default=20, help="training steps (default 20)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--log-dir", metavar="DIR", default=None,
                      help="also write the run to DIR (a new or empty directory), which "
                           "'graddebug report DIR' reads")
    demo.add_argument("--html", metavar="OUT.html", default=None,
                      help="also write the run's self-contained HTML report")
    demo.set_defaults(func=_demo)

    report = sub.add_parser(
        "report", help="summarise a recorded run; exit 1 when it has error findings",
        description="Summarise a run written by watch(log_dir=...) or save(): the findings "
                    "by issue and the worst layers. Exit code 0: no error finding; 1: error "
                    "findings; 2: the run cannot be read.")
    report.add_argument("run", help="the run directory")
    _output_options(report)
    report.add_argument("--table", choices=TABLES, default=None,
                        help="with --format csv/json/markdown: only this table (csv default: "
                             "findings)")
    report.add_argument("--top", type=_positive, default=10,
                        help="how many worst layers to list (default 10)")
    report.add_argument("--html", metavar="OUT.html", default=None,
                        help="also write a self-contained HTML report with the plots")
    report.add_argument("--tensorboard", metavar="DIR", default=None,
                        help="also write TensorBoard event files to DIR: per-tensor norms as "
                             "scalars, log10 norms over layers as histograms")
    report.set_defaults(func=_report)

    compare = sub.add_parser(
        "compare", help="per-layer gradient norm ratios between two runs (B / A)",
        description="Compare the median gradient norm of every tensor between run A (e.g. "
                    "before a fix) and run B (after it).")
    compare.add_argument("run_a", help="the first run directory (A)")
    compare.add_argument("run_b", help="the second run directory (B)")
    _output_options(compare)
    compare.add_argument("--flag", type=_factor, default=10.0,
                         help="highlight ratios beyond this factor either way (default 10)")
    compare.set_defaults(func=_compare)
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
        Console(stderr=True, width=console.width).print(
            f"[bold red]error:[/bold red] {terminal_text(exc)}", soft_wrap=True)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
