"""A run on disk: streamed while training (``watch(log_dir=...)``), saved after the fact
(``save``), read back by :func:`load`.

Layout of a run directory::

    graddebug.json                 format, status, metadata, thresholds, column specs
    records/part-000000.parquet    one Parquet file per flush (a flush every N recorded steps)
    events/part-000000.parquet
    internal/part-000000.parquet   internal_error findings, as they happen
    findings.parquet               the findings as diagnosed when the run ended

Crash safety: every file is written under a temporary name and renamed into place, so a reader
sees whole files only. A process killed mid-run (SIGKILL, OOM) leaves ``graddebug.json`` with
``"status": "running"`` and every part flushed before the kill; :func:`load` reads those parts and
diagnoses them again with the stored thresholds. When the ``with`` block ends (normally or by an
exception) the Watcher writes ``findings.parquet`` and then marks the run ``"complete"``.
Nothing is pickled; see :mod:`graddebug.arrowio` for how columns are typed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from graddebug.arrowio import (
    ColumnSpec,
    frame_spec,
    frame_to_table,
    require_pyarrow,
    rows_to_table,
)
from graddebug.errors import ConfigError, RunFileError
from graddebug.records import Event, Finding, Record

if TYPE_CHECKING:
    from graddebug.adapter import WatchOptions

__all__ = [
    "DEFAULT_FLUSH_EVERY",
    "FLUSH_SECONDS",
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "STREAMS",
    "RunWriter",
    "is_run",
    "now",
    "read_meta",
    "run_metadata",
    "write_run",
]

FORMAT = "graddebug-run"
FORMAT_VERSION = 1
META_FILE = "graddebug.json"
FINDINGS_FILE = "findings.parquet"
DEFAULT_FLUSH_EVERY = 100
"""Recorded steps buffered in memory before they are written (``watch(flush_every=...)``)."""
FLUSH_SECONDS = 30.0
"""A flush also happens at the first recorded step this many seconds after the last one, so
that slow steps lose little to a crash."""

_OBJ, _I64, _F64, _BOOL = "object", "int64", "float64", "bool"
STREAMS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "records": (Record._fields, {
        "step": _I64, "layer": _OBJ, "tensor": _OBJ, "kind": _OBJ, "depth": _I64, "shape": _OBJ,
        "numel": _I64, "norm": _F64, "mean": _F64, "std": _F64, "absmax": _F64,
        "zero_frac": _F64, "nan": _BOOL, "inf": _BOOL, "pre_norm": _F64}),
    "events": (Event._fields, {
        "step": _I64, "layer": _OBJ, "tensor": _OBJ, "depth": _I64, "event": _OBJ,
        "detail": _OBJ}),
    "internal": (Finding._fields, {
        "step": _I64, "layer": _OBJ, "tensor": _OBJ, "issue": _OBJ, "severity": _OBJ,
        "value": _F64, "threshold": _F64, "message": _OBJ}),
}
"""The part streams: the tuple fields written for each, and their dtypes."""

PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")


def now() -> str:
    """The current UTC time, ISO 8601 to the second (as stored in metadata)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _describe(value: Any) -> Any:
    """A JSON-friendly account of an option value (tensors and callables by their type)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, type):
        return _qualname(value)
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [_describe(v) for v in items]
    if callable(value) and not hasattr(value, "shape"):
        return f"<callable {getattr(value, '__qualname__', type(value).__name__)}>"
    return f"<{_qualname(type(value))}>"


def run_metadata(*, adapter: str | None, model: Any, options: WatchOptions,
                 settings: Mapping[str, Any], started: str) -> dict[str, Any]:
    """Describe a run for its JSON file: framework and versions, model class, options, start
    time and host.

    Args:
        adapter: The adapter's name (``"torch"``), None before one was chosen.
        model: The watched model, or None.
        options: The validated ``watch`` options.
        settings: Further options of the Watcher (``every``, ``strict``, ...).
        started: When the ``with`` block was first entered (see :func:`now`).

    Returns:
        A dict of JSON values.
    """
    module = sys.modules.get(adapter) if adapter else None
    interventions = {
        name: {k: v for k, v in vars(spec).items() if v is not None}
        for name, spec in options.intervene.items()
    }
    return {
        "framework": adapter,
        "framework_version": getattr(module, "__version__", None) or (
            _version(adapter) if adapter else None),
        "adapter_version": _version(f"graddebug-{adapter}") if adapter else None,
        "graddebug_version": _version("graddebug"),
        "python": platform.python_version(),
        "model": _qualname(type(model)) if model is not None else None,
        "options": _describe({
            "layers": options.layers,
            "keep": options.keep,
            "intervene": interventions,
            "outputs": options.outputs,
            "param_stats": options.param_stats,
            "optimizer": type(options.optimizer) if options.optimizer is not None else None,
            **settings,
        }),
        "started": started,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def is_run(path: Path) -> bool:
    """Whether ``path`` is a directory holding a graddebug run's JSON file."""
    return path.is_dir() and (path / META_FILE).is_file()


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    text = json.dumps(payload, indent=1, default=str, allow_nan=True)
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _write_parquet(path: Path, table: Any) -> None:
    _, pq = require_pyarrow()
    _atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check a run's JSON file.

    Raises:
        CorruptRunError: The file is not valid JSON or not a JSON object.
        RunFileError: It was written by a newer graddebug, or is not a graddebug run file.
    """
    from graddebug.errors import CorruptRunError

    file = path / META_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRunError(
            f"{str(file)!r} is truncated or corrupt ({exc}); the Parquet files next to it may "
            "still be intact, and graddebug.load(path, skip_damaged=True) reads them with the "
            "default thresholds.",
            path=str(file),
            recoverable="the Parquet parts, with default thresholds and no metadata",
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RunFileError(f"{str(file)!r} is not a graddebug run file (no format {FORMAT!r}).")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise RunFileError(
            f"{str(file)!r} has format version {version!r}; this graddebug reads versions up to "
            f"{FORMAT_VERSION}. Upgrade graddebug to read it."
        )
    return meta


def _base_meta(status: str, metadata: Mapping[str, Any], thresholds: Mapping[str, Any],
               **more: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "status": status,
        "metadata": {k: v for k, v in metadata.items() if k != "run"},
        "thresholds": dict(thresholds),
        **more,
    }


def _specs(**frames: pd.DataFrame) -> dict[str, ColumnSpec]:
    return {name: frame_spec(frame) for name, frame in frames.items()}


def write_run(path: str | os.PathLike[str], records: pd.DataFrame, events: pd.DataFrame,
              findings: pd.DataFrame, *, thresholds: Mapping[str, Any],
              metadata: Mapping[str, Any]) -> Path:
    """Write finished frames as a complete run, replacing a run already at ``path``.

    The run is written into a temporary sibling directory and then renamed into place.

    Args:
        path: The run directory to create.
        records: The record frame.
        events: The event frame.
        findings: The findings frame.
        thresholds: The thresholds the findings were computed with, as a dict.
        metadata: Facts about the run; values that are not JSON are stored as ``str``.

    Returns:
        The run directory.

    Raises:
        RunFileError: ``path`` is a file, or a non-empty directory that holds no run; or a
            column cannot be stored.
        MissingFrameworkError: pyarrow is not installed.
    """
    target = Path(path)
    if target.exists() and not is_run(target) and (target.is_file() or any(target.iterdir())):
        raise RunFileError(
            f"cannot save a run to {str(target)!r}: it is a file or a non-empty directory that "
            "holds no graddebug run. Choose a new path."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for stream, frame in (("records", records), ("events", events)):
            (tmp / stream).mkdir(parents=True)
            table, _ = frame_to_table(frame)
            _write_parquet(tmp / stream / "part-000000.parquet", table)
        (tmp / "internal").mkdir()
        _write_parquet(tmp / FINDINGS_FILE, frame_to_table(findings)[0])
        _write_json(tmp / META_FILE, _base_meta(
            "complete", metadata, thresholds, parts=1,
            columns=_specs(records=records, events=events, findings=findings)))
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class RunWriter:
    """Streams one Watcher's records to a run directory.

    The Watcher keeps only what is not yet flushed; :meth:`read` returns the whole run.

    Args:
        path: The run directory; it must not exist yet, or be empty.
        flush_every: Write a part after this many recorded steps.

    Raises:
        ConfigError: ``path`` is a file or a non-empty directory.
        MissingFrameworkError: pyarrow is not installed.
    """

    def __init__(self, path: str | os.PathLike[str], *, flush_every: int) -> None:
        require_pyarrow()
        self.path = Path(path)
        self.flush_every = flush_every
        self._check_free()
        self._started = False
        self._parts = 0
        self._pending_steps = 0
        self._last_flush = time.monotonic()
        self._meta: dict[str, Any] = {}
        # Parts read back by read(), kept only once someone asked for the frame mid-run.
        self._cache: dict[str, dict[Path, Any]] = {}

    def _check_free(self) -> None:
        if self.path.is_file() or (self.path.is_dir() and any(self.path.iterdir())):
            what = "a graddebug run" if is_run(self.path) else "a file or a non-empty directory"
            raise ConfigError(
                f"log_dir={str(self.path)!r} is {what}; graddebug will not overwrite it (it may "
                "be the post-mortem of an earlier run). Pass a new directory, e.g. "
                "log_dir=f\"runs/{time.strftime('%Y%m%d-%H%M%S')}\"."
            )

    @property
    def parts(self) -> int:
        """How many parts have been flushed."""
        return self._parts

    def start(self, metadata: Mapping[str, Any], thresholds: Mapping[str, Any]) -> None:
        """Create the directory (the first time) and mark the run as running."""
        if not self._started:
            self._check_free()
            for stream in STREAMS:
                (self.path / stream).mkdir(parents=True, exist_ok=True)
            self._started = True
        self._meta = _base_meta("running", metadata, thresholds, flush_every=self.flush_every,
                                parts=self._parts)
        _write_json(self.path / META_FILE, self._meta)

    def step_recorded(self) -> bool:
        """Count one recorded step; return whether a flush is due."""
        self._pending_steps += 1
        return (self._pending_steps >= self.flush_every
                or time.monotonic() - self._last_flush >= FLUSH_SECONDS)

    def flush(self, records: Sequence[Record], events: Sequence[Event],
              internal: Sequence[Finding]) -> None:
        """Write the buffered rows as one part per stream; the caller then drops them."""
        self._pending_steps = 0
        self._last_flush = time.monotonic()
        if not (records or events or internal):
            return
        name = f"part-{self._parts:06d}.parquet"
        for stream, rows in (("records", records), ("events", events), ("internal", internal)):
            if rows:
                fields, types = STREAMS[stream]
                _write_parquet(self.path / stream / name, rows_to_table(rows, fields, types))
        self._parts += 1

    def read(self, records: Sequence[Record], events: Sequence[Event]
             ) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Return the record and event frames of the whole run: flushed parts plus ``records``
        and ``events`` still in memory.

        Parts read once stay in memory (as Arrow tables) until :meth:`release`, so that asking
        for the frame repeatedly during training reads each part once.
        """
        from graddebug.runload import read_streams

        frames = read_streams(self.path, pending={"records": records, "events": events},
                              cache=self._cache)
        return frames["records"], frames["events"]

    def release(self) -> None:
        """Drop the parts that :meth:`read` keeps in memory."""
        self._cache.clear()

    def finish(self, records: pd.DataFrame, events: pd.DataFrame, findings: pd.DataFrame,
               metadata: Mapping[str, Any], thresholds: Mapping[str, Any]) -> None:
        """Write the findings and mark the run complete (after a final :meth:`flush`)."""
        _write_parquet(self.path / FINDINGS_FILE, frame_to_table(findings)[0])
        columns = _specs(records=records, events=events, findings=findings)
        _write_json(self.path / META_FILE, _base_meta(
            "complete", {**metadata, "finished": now()}, thresholds,
            flush_every=self.flush_every, parts=self._parts, columns=columns))

