"""Writing runs: :func:`write_run` for finished frames, :class:`RunWriter` for streaming."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from graddebug.errors import ConfigError, GradDebugError, RunFileError
from graddebug.records import Event, Finding
from graddebug.runs.arrowio import (
    ColumnSpec,
    frame_spec,
    frame_to_table,
    require_pyarrow,
    rows_to_table,
)
from graddebug.runs.layout import (
    FINDINGS_FILE,
    META_FILE,
    RANK_META_RE,
    STREAMS,
    atomic_write,
    base_meta,
    is_run,
    meta_file,
    now,
    part_files,
    part_name,
    read_meta,
    write_json,
    writer_count,
)
from graddebug.runs.parts import read_streams

__all__ = ["DEFAULT_FLUSH_EVERY", "FLUSH_SECONDS", "RunWriter", "check_save_target", "write_run"]

DEFAULT_FLUSH_EVERY = 100
"""Recorded steps buffered in memory before they are written (``watch(flush_every=...)``)."""
FLUSH_SECONDS = 30.0
"""A flush also happens at the first recorded step this many seconds after the last one, so
that slow steps lose little to a crash."""


def _write_parquet(path: Path, table: Any) -> None:
    _, pq = require_pyarrow()
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def _specs(**frames: pd.DataFrame) -> dict[str, ColumnSpec]:
    return {name: frame_spec(frame) for name, frame in frames.items()}


def check_save_target(path: str | os.PathLike[str]) -> Path:
    """Check that a run may be saved at ``path``: a new or empty directory, or a run (which
    is replaced).

    Raises:
        RunFileError: ``path`` is a file, or a non-empty directory that holds no run.
    """
    target = Path(path)
    if target.exists() and not is_run(target) and (target.is_file() or any(target.iterdir())):
        raise RunFileError(
            f"cannot save a run to {str(target)!r}: it is a file or a non-empty directory that "
            "holds no graddebug run. Choose a new path."
        )
    return target


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
    target = check_save_target(path)
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
        write_json(tmp / META_FILE, base_meta(
            "complete", metadata, thresholds, parts=1, merged=True,
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

    In a multi-rank run every rank has a RunWriter on the same directory (set :attr:`rank`
    and :attr:`processes` before :meth:`create`): each writes parts named with its rank and a
    JSON file of its own status; rank 0's JSON file holds the run's metadata. The findings
    of a multi-rank run are diagnosed on loading, from every rank's rows.

    Args:
        path: The run directory; it must not exist yet, or hold nothing but other ranks' files
            of a run being written.
        flush_every: Write a part after this many recorded steps.

    Raises:
        ConfigError: ``path`` is a file, a finished run, or a directory of other files.
        MissingFrameworkError: pyarrow is not installed.
    """

    def __init__(self, path: str | os.PathLike[str], *, flush_every: int) -> None:
        require_pyarrow()
        self.path = Path(path)
        self.flush_every = flush_every
        self.rank = 0
        self.processes = 1
        self._check_free()
        self._started = False
        self._parts = 0
        self._pending_steps = 0
        self._last_flush = time.monotonic()
        self._meta: dict[str, Any] = {}
        # Parts read back by read(), kept only once someone asked for the frame mid-run.
        self._cache: dict[str, dict[Path, Any]] = {}

    def _refuse(self, what: str) -> ConfigError:
        return ConfigError(
            f"log_dir={str(self.path)!r} is {what}; graddebug will not overwrite it (it may "
            "be the post-mortem of an earlier run). Pass a new directory, e.g. "
            "log_dir=f\"runs/{time.strftime('%Y%m%d-%H%M%S')}\"."
        )

    def _check_free(self) -> None:
        """Refuse a file, a finished one-process run, and a directory holding anything but a
        run's layout.

        The ranks of a distributed run create the directory concurrently, so another rank's
        files may be there already; which of them is this rank's is known only once the
        adapter is attached (:meth:`create` checks that).
        """
        if self.path.is_file():
            raise self._refuse("a file")
        if not self.path.is_dir():
            return
        names = os.listdir(self.path)
        foreign = [n for n in names if not _run_layout_name(n)]
        if foreign:
            raise self._refuse("a non-empty directory")
        if META_FILE in names and not _joinable(self.path):
            raise self._refuse("a graddebug run")

    def _check_own_files(self) -> None:
        """Refuse a directory that holds files this rank would write: an earlier run's."""
        own = self.path / meta_file(self.rank)
        parts = part_files(self.path, self.rank) if self.path.is_dir() else {}
        if own.exists() or any(parts.values()):
            raise self._refuse("a graddebug run" if self.rank == 0 else
                               f"a graddebug run that has files of rank {self.rank} already")

    @property
    def parts(self) -> int:
        """How many parts have been flushed."""
        return self._parts

    def create(self) -> None:
        """Create the run directory and its stream folders (once).

        Raises:
            ConfigError: ``path`` became a file or a non-empty directory since construction.
            OSError: The directory cannot be created.
        """
        if not self._started:
            self._check_free()
            self._check_own_files()
            for stream in STREAMS:
                (self.path / stream).mkdir(parents=True, exist_ok=True)
            self._started = True

    def start(self, metadata: Mapping[str, Any], thresholds: Mapping[str, Any]) -> None:
        """Create the directory (the first time) and mark the run as running."""
        self.create()
        self._meta = base_meta("running", metadata, thresholds, flush_every=self.flush_every,
                                parts=self._parts)
        write_json(self.path / meta_file(self.rank), self._meta)

    def step_recorded(self) -> bool:
        """Count one recorded step; return whether a flush is due."""
        self._pending_steps += 1
        return (self._pending_steps >= self.flush_every
                or time.monotonic() - self._last_flush >= FLUSH_SECONDS)

    def flush(self, records: Sequence[tuple[Any, ...]], events: Sequence[Event],
              internal: Sequence[Finding]) -> None:
        """Write the buffered rows as one part per stream; the caller then drops them."""
        self._pending_steps = 0
        self._last_flush = time.monotonic()
        if not (records or events or internal):
            return
        name = part_name(self._parts, self.rank)
        for stream, rows in (("records", records), ("events", events), ("internal", internal)):
            if rows:
                fields, types = STREAMS[stream]
                _write_parquet(self.path / stream / name, rows_to_table(rows, fields, types))
        self._parts += 1

    def read(self, records: Sequence[tuple[Any, ...]], events: Sequence[Event]
             ) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Return the record and event frames of the whole run: flushed parts plus ``records``
        and ``events`` still in memory.

        Parts read once stay in memory (as Arrow tables) until :meth:`release`, so that asking
        for the frame repeatedly during training reads each part once.
        """
        frames = read_streams(self.path, pending={"records": records, "events": events},
                              cache=self._cache, rank=self.rank)
        return frames["records"], frames["events"]

    def release(self) -> None:
        """Drop the parts that :meth:`read` keeps in memory."""
        self._cache.clear()

    def finish(self, records: pd.DataFrame, events: pd.DataFrame, findings: pd.DataFrame,
               metadata: Mapping[str, Any], thresholds: Mapping[str, Any],
               incomplete: str | None = None) -> None:
        """Write the findings and mark the run finished (after a final :meth:`flush`).

        In a multi-rank run no rank writes findings: each holds only its own rows, and the
        run is diagnosed on loading from every rank's. Each rank marks its own JSON file.

        Args:
            records, events, findings: The whole run's frames (their column specs are stored).
            metadata: Facts about the run.
            thresholds: The thresholds of the run.
            incomplete: Why some rows never reached the disk (a failed flush); the run is then
                marked ``"incomplete"`` with this reason (``metadata["incomplete_reason"]``),
                never ``"complete"``.
        """
        if self.processes == 1:
            _write_parquet(self.path / FINDINGS_FILE, frame_to_table(findings)[0])
        columns = _specs(records=records, events=events, findings=findings)
        status, extra = "complete", {}
        if incomplete is not None:
            status, extra = "incomplete", {"incomplete_reason": incomplete}
        write_json(self.path / meta_file(self.rank), base_meta(
            status, {**metadata, **extra, "finished": now()}, thresholds,
            flush_every=self.flush_every, parts=self._parts, columns=columns))


def _run_layout_name(name: str) -> bool:
    """Whether ``name`` is a file or folder a (multi-rank) run directory holds."""
    return (name in STREAMS or name in (META_FILE, FINDINGS_FILE)
            or RANK_META_RE.match(name) is not None
            or (name.startswith(".") and name.endswith(".tmp")))


def _joinable(path: Path) -> bool:
    """Whether the run at ``path`` may be one this process joins as a further rank: a run
    being written, or one of several ranks (whose other ranks may still be writing)."""
    try:
        meta = read_meta(path)
    except GradDebugError:
        return False
    size = writer_count(meta)
    return meta.get("status") == "running" or (isinstance(size, int) and size > 1)
