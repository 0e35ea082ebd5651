"""Tables and figures of the Performance page, read from the benchmark scripts' JSON output.

The numbers on ``docs/performance.md`` are not typed by hand: each benchmark script writes a
JSON file, a copy of it is committed under ``docs/_data/benchmarks/``, and this extension turns
it into a table when the docs build. A page writes::

    ```{benchmark-table} overhead_torch.json
    :workloads: mlp,cnn
    ```

and, for one ratio inside a sentence, ``{benchmark}`overhead_torch.json mlp b```. The kind of
table follows from the file's ``benchmark`` field (``zoo``, ``overhead_torch``,
``overhead_tf``, ``overhead_jax``, ``many_layers_torch``); ``:table:`` names it where the file
lacks one. Every table's caption gives the date, the machine and the versions the file records.

A file that is missing, is not JSON or lacks a field its table needs is a Sphinx warning, so that
the strict build (``-W``) fails and says which file and field; it never stops the build with a
traceback and never leaves a silent gap.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective, SphinxRole

__all__ = [
    "BenchTable",
    "BenchmarkDataError",
    "build_table",
    "inline_ratio",
    "load",
    "setup",
    "table_node",
]

logger = logging.getLogger(__name__)

DATA_DIR = "_data/benchmarks"
"""Where the committed JSON lives, relative to the docs' source folder (``benchtables_data``)."""

DASH = "–"

# Short names of the configs for a table cell; the page's prose says what each one runs. The
# scripts' own labels (torch's JSON keeps them) are sentences, too long for a column.
CONFIG_NAMES: dict[str, dict[str, str]] = {
    "overhead_torch": {
        "a": "(a) params", "b": "(b) params + outputs", "c": "(c) = (b), every=10",
        "o": "(o) = (b), ops=True", "d": "(d) detect_anomaly", "f": "(f) floor of (a)",
        "g": "(g) floor of (b)", "n": "(n) null",
    },
    "overhead_tf": {
        "a": "(a) params", "b": "(b) params + outputs", "f": "(f) floor", "n": "(n) null",
    },
}


class BenchmarkDataError(ValueError):
    """A benchmark JSON file that is missing, unreadable, or lacks what its table needs."""


@dataclass
class BenchTable:
    """A table ready to render: a caption line, a header row and body rows of text cells.

    Attributes:
        caption: Where the numbers come from: the file, date, machine, versions and settings.
        header: The column titles.
        rows: The body, one list of cells per row, as long as ``header``.
    """

    caption: str
    header: list[str]
    rows: list[list[str]]


# -- reading -----------------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    """Read one benchmark JSON file.

    Args:
        path: The file.

    Returns:
        Its top-level object.

    Raises:
        BenchmarkDataError: The file cannot be read, is not JSON, or is not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise BenchmarkDataError(
            f"{path.name}: cannot be read ({e.strerror or e}); run the benchmark that writes "
            f"it and copy its JSON to {path.parent} (see benchmarks/README.md)") from e
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchmarkDataError(f"{path.name}: not valid JSON ({e})") from e
    if not isinstance(payload, dict):
        raise BenchmarkDataError(
            f"{path.name}: a benchmark file holds a JSON object, not {type(payload).__name__}")
    return payload


def _kind(payload: dict[str, Any], name: str, table: str | None) -> str:
    kind = table or payload.get("benchmark")
    if kind not in BUILDERS:
        found = f"benchmark {kind!r}" if kind else "no 'benchmark' field"
        raise BenchmarkDataError(
            f"{name}: {found}; give :table: one of {', '.join(sorted(BUILDERS))}")
    return str(kind)


# -- cells -------------------------------------------------------------------------------------


def _when(stamp: str) -> str:
    """``2026-12-04T18:24:26+00:00`` as ``2026-12-04 18:24 UTC``."""
    moment = datetime.fromisoformat(stamp)
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def _ms(value: float) -> str:
    """A step time: one decimal under 100 ms, whole milliseconds above."""
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _ratio(res: dict[str, Any]) -> str:
    return f"{res['ratio']:.3f} [{res['ratio_low']:.3f}-{res['ratio_high']:.3f}]"


def _target(target: float) -> str:
    return f"≤ {target:.2f}" if math.isfinite(target) else DASH


def _verdict(res: dict[str, Any], target: float, key: str = "verdict") -> str:
    return str(res[key]) if math.isfinite(target) else DASH


def _cpus(count: Any) -> str:
    return f", {count} CPUs" if count else ""


def _versions(pairs: Sequence[tuple[str, Any]]) -> str:
    return ", ".join(f"{name} {value}" for name, value in pairs if value)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _keep(results: list[dict[str, Any]], filters: dict[str, list[str]]) -> list[dict[str, Any]]:
    """The results whose fields are among the values ``filters`` allows, in the file's order."""
    return [res for res in results
            if all(str(res.get(name)) in allowed for name, allowed in filters.items())]


# -- one builder per benchmark -------------------------------------------------------------------


def _zoo(payload: dict[str, Any], name: str, filters: dict[str, list[str]]) -> BenchTable:
    meta = payload["meta"]
    rows = []
    for row in _keep(payload["rows"], filters):
        rows.append([
            str(row["model"]), str(row["framework"]), str(row["family"]),
            _findings(row["issues"], int(row["findings_at_init"])),
            f"{_ms(row['plain_ms'])} → {_ms(row['watched_ms'])} ms ({row['overhead']:.2f}×)",
        ])
    versions = meta.get("versions", {})
    threads = meta.get("torch_threads")
    caption = (f"{name}: {_when(meta['date'])}, {meta['machine']}{_cpus(meta.get('cpus'))}; "
               + (f"{_versions(list(versions.items()))}; " if versions else "")
               + (f"torch on {_plural(threads, 'thread')}; "
                  if threads and "torch" in versions else "")
               + f"{meta['rounds']} alternating rounds of {meta['steps']} steps a side, "
               "the first step of each run not timed")
    return BenchTable(caption, ["model", "framework", "family", "findings at init",
                                "step time plain → watched"], rows)


def _findings(issues: dict[str, list[str]], count: int) -> str:
    """``0``, or the count and each issue's first layers, as the zoo script's own table."""
    if not count:
        return "0"
    parts = []
    for issue, layers in issues.items():
        more = f" and {len(layers) - 2} more" if len(layers) > 2 else ""
        parts.append(f"{issue} at {', '.join(layers[:2])}{more}")
    return f"{count}: " + "; ".join(parts)


def _overhead_torch(payload: dict[str, Any], name: str,
                    filters: dict[str, list[str]]) -> BenchTable:
    env, settings = payload["environment"], payload["settings"]
    compiled = bool(settings.get("compile"))
    names = CONFIG_NAMES["overhead_torch"]
    header = ["workload", "config", "target", "ratio [95% interval]", "result",
              "plain ms/step", "watched ms/step"]
    if compiled:
        header.append("graph breaks plain / watched")
    rows = []
    for res in _keep(payload["results"], filters):
        target = float(res["target"])
        row = [str(res["workload"]), names.get(res["config"], str(res["label"])),
               _target(target), _ratio(res), _verdict(res, target), _ms(res["plain_ms"]),
               _ms(res["watched_ms"])]
        if compiled:
            row.append(f"{res['graph_breaks_plain']} / {res['graph_breaks_watched']}")
        rows.append(row)
    commit = str(env.get("git_commit", ""))[:10]
    caption = (f"{name}: {_when(env['timestamp'])}, {env['platform']}{_cpus(env.get('cpus'))}; "
               f"torch {env['torch']} on {_plural(env['torch_threads'], 'thread')}"
               + (" under torch.compile" if compiled else "")
               + (f", graddebug {env['graddebug']}" if env.get("graddebug") else "")
               + (f", commit {commit}" if commit else "")
               + (" with local changes to the library" if env.get("library_modified") else "")
               + f"; {settings['rounds']} rounds of {settings['steps_per_round']} pairs of steps "
               f"a config after {settings['warmup_rounds']} warm-up, "
               f"{settings.get('allocator', 'default')} allocator")
    return BenchTable(caption, header, rows)


def _overhead_tf(payload: dict[str, Any], name: str,
                 filters: dict[str, list[str]]) -> BenchTable:
    env, settings = payload["environment"], payload["settings"]
    names = CONFIG_NAMES["overhead_tf"]
    rows = []
    for res in _keep(payload["results"], filters):
        target = float(res["target"])
        rows.append([str(res["workload"]), str(res["loop"]),
                     names.get(res["config"], f"({res['config']})"), _target(target),
                     _ratio(res), _verdict(res, target), _ms(res["plain_ms"]),
                     _ms(res["watched_ms"])])
    machine = env.get("platform") or env["machine"]
    caption = (f"{name}: {_when(env['when'])}, {machine}{_cpus(env.get('cpus'))}; "
               + _versions([("TensorFlow", env["tensorflow"]), ("Keras", env["keras"]),
                            ("graddebug", env.get("graddebug"))])
               + f"; {settings['rounds']} rounds of {settings['steps_per_round']} pairs of "
               f"steps, fit: {settings['rounds']} rounds of one {settings['fit_steps']}-batch "
               "call a side")
    return BenchTable(caption, ["workload", "loop", "config", "target", "ratio [95% interval]",
                                "result", "plain ms/step", "watched ms/step"], rows)


def _overhead_jax(payload: dict[str, Any], name: str,
                  filters: dict[str, list[str]]) -> BenchTable:
    rows = []
    for res in _keep(payload["results"], filters):
        target = float(res["target"])
        watched = res.get("watched_ms")
        rows.append([str(res["workload"]), str(res["config"]), _target(target), _ratio(res),
                     _verdict(res, target, "result"), _ms(res["plain_ms"]),
                     _ms(watched) if watched is not None else DASH])
    caption = (f"{name}: {_when(payload['when'])}, {payload['machine']}"
               f"{_cpus(payload.get('cpus'))}; "
               + _versions([("JAX", payload["jax"]), ("Flax", payload.get("flax")),
                            ("optax", payload.get("optax")),
                            ("graddebug", payload.get("graddebug"))])
               + f"; {payload['rounds']} rounds of {payload['pairs']} pairs of steps")
    return BenchTable(caption, ["workload", "config", "target", "ratio [95% interval]",
                                "result", "plain ms/step", "watched ms/step"], rows)


def _many_layers(payload: dict[str, Any], name: str,
                 filters: dict[str, list[str]]) -> BenchTable:
    res, targets = payload["result"], payload["targets"]
    settings = payload.get("settings", {})
    frame_plus = res["frame_s"] + res["findings_s"]
    rows = [
        ["watched / plain step, median over rounds",
         f"{res['ratio']:.2f}× ({_ms(res['plain_ms'])} → {_ms(res['watched_ms'])} ms)",
         f"≤ {targets['step_ratio']:g}×"],
        ["a step that every= skips / plain step",
         f"{res['skipped_ratio']:.2f}× ({_ms(res['skipped_ms'])} ms)", DASH],
        ["enter + exit watch(model)", f"{res['attach_s']:.2f} s", DASH],
        [f"frame() + findings() of {res['rows']:,} rows",
         f"{frame_plus:.2f} s ({res['frame_s']:.2f} + {res['findings_s']:.2f})",
         f"< {targets['frame_plus_findings_s']:g} s"],
        ["findings of the healthy model", str(res["findings"]), "0"],
    ]
    rounds = (f"; {settings['rounds']} rounds of {settings['steps_per_round']} steps"
              if settings else "")
    caption = (f"{name}: {_when(payload['when'])}, {payload.get('machine', 'machine unknown')}"
               f"{_cpus(payload.get('cpus'))}; "
               f"torch {payload['torch']} on {_plural(payload['threads'], 'thread')}"
               + (f", graddebug {payload['graddebug']}" if payload.get("graddebug") else "")
               + "; "
               f"{res['layers']:,} × Linear(8, 8){rounds}")
    return BenchTable(caption, ["measure", "value", "target"], rows)


def _distributed(payload: dict[str, Any], name: str,
                 filters: dict[str, list[str]]) -> BenchTable:
    env, settings = payload["environment"], payload["settings"]
    rows = [[str(res["setup"]), str(res["world"]), _ms(res["plain_ms"]), _ms(res["watched_ms"]),
             f"{res['ratio']:.2f}×", _ms(res["close_ms"]), f"{res['collective_ms']:.2f}",
             f"{res['collective_ms'] / res['watched_ms']:.1%}", f"{res['collectives_per_step']:g}"]
            for res in _keep(payload["results"], filters)]
    caption = (f"{name}: {_when(env['timestamp'])}, {env['platform']}{_cpus(env.get('cpus'))}; "
               + _versions([("torch", env["torch"]), ("graddebug", env.get("graddebug"))])
               + f"; gloo on the CPU; {settings['blocks']} MLP blocks of width "
               f"{settings['width']}, global batch {settings['batch']}; {settings['rounds']} "
               f"rounds of {settings['steps_per_round']} steps")
    return BenchTable(caption, ["setup", "processes", "plain ms/step", "watched ms/step", "ratio",
                                "dbg.step() ms", "collective ms", "collective / step",
                                "collectives / step"], rows)


Builder = Callable[[dict[str, Any], str, dict[str, list[str]]], BenchTable]
BUILDERS: dict[str, Builder] = {
    "distributed": _distributed,
    "zoo": _zoo,
    "overhead_torch": _overhead_torch,
    "overhead_tf": _overhead_tf,
    "overhead_jax": _overhead_jax,
    "many_layers_torch": _many_layers,
}


def build_table(paths: Sequence[Path], table: str | None = None,
                filters: dict[str, list[str]] | None = None) -> BenchTable:
    """Build one table from one or more JSON files of one benchmark.

    Several files (the zoo's torch and Keras runs, say) give one table: their rows in turn,
    their captions joined.

    Args:
        paths: The JSON files.
        table: The kind of table; None takes each file's ``benchmark`` field.
        filters: Keep only the results whose field (``workload``, ``config``, ``loop``,
            ``framework``) takes one of the listed values.

    Returns:
        The table.

    Raises:
        BenchmarkDataError: A file is missing or malformed, lacks a field the table needs, its
            files are of different kinds, or the filters leave no row.
    """
    if not paths:
        raise BenchmarkDataError("no JSON file named")
    tables, kinds = [], set()
    for path in paths:
        payload = load(path)
        kind = _kind(payload, path.name, table)
        kinds.add(kind)
        try:
            tables.append(BUILDERS[kind](payload, path.name, filters or {}))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"lacks the field {e.args[0]!r}" if isinstance(e, KeyError) else f"{e}"
            raise BenchmarkDataError(f"{path.name}: {what} ({kind} table)") from e
    if len(kinds) > 1:
        raise BenchmarkDataError(f"one table from files of different benchmarks: {sorted(kinds)}")
    rows = [row for part in tables for row in part.rows]
    if not rows:
        names = ", ".join(path.name for path in paths)
        raise BenchmarkDataError(f"{names}: no result matches {filters}")
    return BenchTable("; ".join(part.caption for part in tables), tables[0].header, rows)


def inline_ratio(path: Path, keys: Sequence[str]) -> str:
    """One result's ratio and its 95% interval, ``1.156 [1.142-1.169]``, for a sentence.

    Args:
        path: An overhead benchmark's JSON file.
        keys: The result's ``workload`` and ``config`` (TensorFlow: ``workload``, ``loop``,
            ``config``).

    Returns:
        The ratio and its interval.

    Raises:
        BenchmarkDataError: The file is missing or malformed, or not exactly one result
            matches ``keys``.
    """
    payload = load(path)
    kind = _kind(payload, path.name, None)
    fields = ("workload", "loop", "config") if kind == "overhead_tf" else ("workload", "config")
    if kind not in ("overhead_torch", "overhead_tf", "overhead_jax") or len(keys) != len(fields):
        raise BenchmarkDataError(
            f"{path.name}: an inline ratio names a {kind} result by {' '.join(fields)}; "
            f"got {' '.join(keys)!r}")
    try:
        found = [res for res in payload["results"]
                 if all(str(res.get(f)) == k for f, k in zip(fields, keys, strict=True))]
        text = _ratio(found[0]) if len(found) == 1 else ""
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BenchmarkDataError(f"{path.name}: lacks a field of its results ({e!r})") from e
    if not text:
        raise BenchmarkDataError(
            f"{path.name}: {len(found)} results match {' '.join(keys)!r}, not one")
    return text


# -- docutils ----------------------------------------------------------------------------------


def table_node(table: BenchTable) -> nodes.table:
    """The docutils table of ``table``, its caption as the table's title.

    Args:
        table: The table to render.

    Returns:
        A ``table`` node with a title, a header row and a body.
    """
    node = nodes.table(classes=["benchmark-table"])
    node += nodes.title(text=table.caption)
    group = nodes.tgroup(cols=len(table.header))
    node += group
    for _ in table.header:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    head += _row_node(table.header)
    body = nodes.tbody()
    for row in table.rows:
        body += _row_node(row)
    group += head
    group += body
    return node


def _row_node(cells: Sequence[str]) -> nodes.row:
    row = nodes.row()
    for cell in cells:
        row += nodes.entry("", nodes.paragraph(text=cell))
    return row


def _data_path(srcdir: str | Path, folder: str, name: str) -> Path:
    if not name or Path(name).name != name:
        raise BenchmarkDataError(f"{name!r}: name a file of {folder}, without a folder")
    return Path(srcdir) / folder / name


def _names(argument: str | None) -> list[str]:
    return [part.strip() for part in (argument or "").split(",") if part.strip()]


class BenchmarkTable(SphinxDirective):
    """``benchmark-table``: a table from JSON files of the benchmarks' data folder.

    Arguments are file names in that folder. Options: ``:table:`` (the kind, when a file has no
    ``benchmark`` field) and ``:workloads:``, ``:configs:``, ``:loops:``, ``:frameworks:``
    (comma-separated values to keep).
    """

    required_arguments = 1
    optional_arguments = 8
    option_spec = {  # noqa: RUF012 (docutils reads it from the class)
        "table": directives.unchanged,
        "workloads": directives.unchanged,
        "configs": directives.unchanged,
        "loops": directives.unchanged,
        "frameworks": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        """Build the table, or warn and render nothing."""
        folder = self.config.benchtables_data
        filters = {field: _names(self.options[option])
                   for option, field in (("workloads", "workload"), ("configs", "config"),
                                         ("loops", "loop"), ("frameworks", "framework"))
                   if option in self.options}
        try:
            paths = [_data_path(self.env.srcdir, folder, name) for name in self.arguments]
            for path in paths:
                self.env.note_dependency(str(path))
            table = build_table(paths, self.options.get("table"), filters)
        except BenchmarkDataError as e:
            logger.warning("benchmark-table: %s", e, location=self.get_location())
            return []
        return [table_node(table)]


class BenchmarkRatio(SphinxRole):
    """``{benchmark}`overhead_torch.json mlp b```: one result's ratio and its 95% interval."""

    def run(self) -> tuple[list[nodes.Node], list[nodes.system_message]]:
        """Render the ratio, or warn and render the role's text."""
        name, *keys = self.text.split()
        folder = self.config.benchtables_data
        try:
            path = _data_path(self.env.srcdir, folder, name)
            self.env.note_dependency(str(path))
            text = inline_ratio(path, keys)
        except BenchmarkDataError as e:
            logger.warning("benchmark: %s", e, location=self.get_location())
            return [nodes.literal(text=self.text)], []
        return [nodes.inline(text=text, classes=["benchmark-ratio"])], []


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the ``benchmark-table`` directive, the ``benchmark`` role and the data folder.

    Args:
        app: The Sphinx application.

    Returns:
        The extension's metadata.
    """
    app.add_config_value("benchtables_data", DATA_DIR, "env", types=[str])
    app.add_directive("benchmark-table", BenchmarkTable)
    app.add_role("benchmark", BenchmarkRatio())
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
