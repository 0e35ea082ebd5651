"""Reading a run back into frames: :func:`read_run` for a finished or crashed run (the run a
live Watcher is writing is read by :func:`graddebug.runs.parts.read_streams`). Nothing here
diagnoses; the report layer (:func:`graddebug.load`) turns what is read into a Report."""

from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from graddebug.config import Thresholds
from graddebug.errors import ConfigError, CorruptRunError, NotARunError
from graddebug.records import EVENT_DTYPES, FINDING_DTYPES, RECORD_DTYPES
from graddebug.runs.arrowio import (
    ColumnSpec,
    table_to_frame,
)
from graddebug.runs.layout import (
    FINDINGS_FILE,
    META_FILE,
    STREAMS,
    link_problem,
    meta_file,
    read_meta,
    writer_count,
)
from graddebug.runs.parts import (
    OPTIONAL,
    TEXT,
    Progress,
    Streams,
    concat,
    corrupt_error,
    read_all,
    stream_frame,
    with_appended,
)

__all__ = ["Progress", "StoredRun", "read_run"]

def _resolve(path: str | os.PathLike[str]) -> Path:
    run = Path(path)
    if run.is_file() and run.name == META_FILE:
        run = run.parent
    if not run.exists():
        raise NotARunError(f"{str(run)!r} does not exist; pass the directory given to "
                           "watch(log_dir=...) or save().")
    if not run.is_dir():
        raise NotARunError(f"{str(run)!r} is a file, not a graddebug run; a run is a directory "
                           f"holding {META_FILE!r}, as written by watch(log_dir=...) or save().")
    if not (run / META_FILE).is_file():
        raise NotARunError(f"{str(run)!r} holds no {META_FILE!r}, so it is not a graddebug run "
                           "(watch(log_dir=...) and save() write one).")
    return run


@dataclass
class StoredRun:
    """What a run directory holds, read back.

    Attributes:
        path: The run directory.
        records: The record frame.
        events: The event frame.
        internal: The internal_error findings recorded while the run trained.
        findings: The findings stored when the run completed; None when the run did not
            complete (or its findings file is damaged), so they must be diagnosed again.
        thresholds: The thresholds the run used.
        metadata: The stored metadata, with a ``"run"`` entry that describes the run on disk
            (path, status, whether findings must be rediagnosed, steps, damaged files).
    """

    path: Path
    records: pd.DataFrame
    events: pd.DataFrame
    internal: pd.DataFrame
    findings: pd.DataFrame | None
    thresholds: Thresholds
    metadata: dict[str, Any]


def read_run(path: str | os.PathLike[str], *, skip_damaged: bool = False,
             progress: Progress | None = None) -> StoredRun:
    """Read a run written by ``watch(log_dir=...)`` or ``save``.

    Args:
        path: The run directory (or its ``graddebug.json``).
        skip_damaged: Return what is readable instead of raising when files are damaged.
        progress: Called as ``progress(done, total)`` while files are read.

    Raises:
        NotARunError: ``path`` does not exist or holds no run.
        CorruptRunError: A file is truncated or corrupt (the message says what is readable).
        RunFileError: The run was written by a newer graddebug.
        MissingFrameworkError: pyarrow is not installed.
    """
    run = _resolve(path)
    damaged: list[tuple[Path, str]] = []
    meta = _read_meta(run, skip_damaged, damaged)
    ranks = _rank_statuses(run, meta)
    finished = meta.get("status") == "complete" and all(v == "complete" for v in ranks.values())
    # A multi-rank run stores no findings: they come from every rank's rows, on loading.
    complete = finished and not ranks and isinstance(meta.get("columns"), dict)
    specs: dict[str, ColumnSpec] = {}
    if complete:
        stored = _stored_specs(run, meta, skip_damaged, damaged)
        complete = stored is not None  # else read the parts as streamed, and diagnose again
        specs = stored or {}
    findings_file = run / FINDINGS_FILE
    streams, others = read_all(run, [findings_file] if complete else [], progress,
                                complete=finished)
    if streams.damaged and not skip_damaged:
        raise corrupt_error(run, streams)
    damaged += streams.damaged
    complete = complete and findings_file in others
    thresholds = _thresholds(meta.get("thresholds"))
    frames, findings = _frames(run, streams, specs if complete else {},
                               others[findings_file] if complete else None)
    if ranks:  # every rank's rows, step by step
        for stream in ("records", "events"):
            frames[stream] = frames[stream].sort_values(["step", "rank"], kind="stable",
                                                        ignore_index=True)
    metadata = _run_metadata(run, meta, ranks, damaged, frames["records"]["step"],
                             finished=finished, complete=complete)
    return StoredRun(run, frames["records"], frames["events"], frames["internal"], findings,
                     thresholds, metadata)


def _read_meta(run: Path, skip_damaged: bool, damaged: list[tuple[Path, str]]
               ) -> dict[str, Any]:
    """Read the run's JSON file, or stand in for a damaged one.

    Args:
        run: The run directory.
        skip_damaged: Stand in for a damaged file instead of raising.
        damaged: Where a damaged file and the reason are added.

    Returns:
        The file's content; for a damaged file, that of a run still running, with no
        metadata and default thresholds.

    Raises:
        CorruptRunError: The file is damaged and ``skip_damaged`` is False.
    """
    try:
        return read_meta(run)
    except CorruptRunError as exc:
        if not skip_damaged:
            raise
        damaged.append((run / META_FILE, str(exc.__cause__ or exc)))
        return {"status": "running", "metadata": {}, "thresholds": {}}


def _stored_specs(run: Path, meta: Mapping[str, Any], skip_damaged: bool,
                  damaged: list[tuple[Path, str]]) -> dict[str, ColumnSpec] | None:
    """The column specs that a complete run's JSON file gives for its stored files.

    Args:
        run: The run directory.
        meta: The content of its JSON file.
        skip_damaged: Return None for damaged specs instead of raising.
        damaged: Where a damaged file and the reason are added.

    Returns:
        The specs by frame (``"records"``, ``"events"``, ``"findings"``, ...), or None when
        they are damaged.

    Raises:
        CorruptRunError: The specs are damaged and ``skip_damaged`` is False.
    """
    try:
        return _specs(meta.get("columns"), run / META_FILE)
    except CorruptRunError as exc:
        if not skip_damaged:
            raise
        damaged.append((run / META_FILE, str(exc)))
        return None


def _frames(run: Path, streams: Streams, specs: Mapping[str, ColumnSpec],
            findings: Any | None) -> tuple[dict[str, pd.DataFrame], pd.DataFrame | None]:
    """Build the frames of the streams and, for a complete run, of its stored findings.

    Args:
        run: The run directory, for the message.
        streams: The tables read, by stream.
        specs: The column specs of a complete run's files; empty to read the streams as
            streamed.
        findings: The stored findings table of a complete run, else None.

    Returns:
        The frame of each stream, and the findings frame (None when they must be diagnosed
        again).

    Raises:
        CorruptRunError: The files do not fit together or do not match the JSON file.
    """
    frames: dict[str, pd.DataFrame] = {}
    try:
        for stream, tables in streams.tables.items():
            table = concat(stream, tables)
            spec = specs.get(stream)
            frames[stream] = (with_appended(table_to_frame(table, spec), STREAMS[stream][1]) if spec
                              else stream_frame(stream, table))
        stored = (with_appended(table_to_frame(findings, specs["findings"]), FINDING_DTYPES)
                  if findings is not None else None)
    except (KeyError, TypeError, ValueError) as exc:  # Arrow's errors derive from these too
        raise CorruptRunError(
            f"run {str(run)!r}: its files do not fit together or do not match {META_FILE} "
            f"({type(exc).__name__}: {exc})", path=str(run), recoverable="nothing reliable",
        ) from exc
    return frames, stored


def _run_metadata(run: Path, meta: Mapping[str, Any], ranks: Mapping[int, str],
                  damaged: Sequence[tuple[Path, str]], steps: pd.Series, *, finished: bool,
                  complete: bool) -> dict[str, Any]:
    """The run's stored metadata, with what reading it found under ``"run"``.

    Args:
        run: The run directory.
        meta: The content of its JSON file.
        ranks: The status of every rank but 0 (empty for one process).
        damaged: The damaged files skipped, with the reasons.
        steps: The ``step`` column of the record frame.
        finished: Every rank finished its run.
        complete: The stored findings were read (False: diagnosed again).

    Returns:
        The metadata of the loaded run.
    """
    stored = meta.get("metadata")
    metadata = dict(stored) if isinstance(stored, dict) else {}
    metadata["run"] = {
        "path": str(run),
        "status": "complete" if finished else "incomplete",
        "rediagnosed": not complete,
        "steps": int(steps.nunique()),
        "last_step": int(steps.max()) if len(steps) else -1,
        "damaged": [str(f) for f, _ in damaged],
        "ranks": {"0": meta.get("status"), **{str(r): v for r, v in ranks.items()}},
    }
    return metadata


def _rank_statuses(run: Path, meta: Mapping[str, Any]) -> dict[int, str]:
    """The status of every rank but 0 of a multi-rank run as streamed (empty for one process
    and for a run that ``save()`` wrote whole).

    A rank whose JSON file is missing or unreadable (killed before it wrote one, or while
    writing) counts as ``"running"``: its rows are read as streamed, and the run is not
    complete.
    """
    size = writer_count(meta)
    if not isinstance(size, int) or size <= 1 or meta.get("merged"):
        return {}  # one process, or every rank's rows saved as one run (save())
    statuses = {}
    for rank in range(1, size):
        file = run / meta_file(rank)
        status = "running"
        if link_problem(run, file) is None and file.is_file():
            try:
                loaded = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                loaded = None
            if isinstance(loaded, dict) and isinstance(loaded.get("status"), str):
                status = loaded["status"]
        statuses[rank] = status
    return statuses


def _specs(stored: Any, file: Path) -> dict[str, ColumnSpec]:
    """Check the column specs of a finished run's JSON file (which is data, not trusted).

    Each frame's spec must list every column of the schema, each with the schema's own dtype:
    a spec may not turn ``step`` into ``int8`` or ``norm`` into ``object``, and a frame without
    ``step`` cannot be a run. Columns the schema does not know keep the looser rules of
    :mod:`graddebug.runs.arrowio`.
    """
    specs: dict[str, ColumnSpec] = {}
    ok = isinstance(stored, dict) and {"records", "events", "findings"} <= set(stored)
    for name, spec in (stored.items() if ok else ()):
        if not (isinstance(spec, list) and all(
                isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c)
                for c in spec)):
            ok = False
            break
        specs[name] = [(c[0], c[1]) for c in spec]
    if not ok:
        raise CorruptRunError(f"the column specs in {str(file)!r} are malformed: "
                              f"{reprlib.repr(stored)}", path=str(file),
                              recoverable="the Parquet files, with skip_damaged=True")
    for name, schema in (("records", RECORD_DTYPES), ("events", EVENT_DTYPES),
                         ("findings", FINDING_DTYPES)):
        given = dict(specs[name])
        for column, dtype in schema.items():
            wrong = column not in given and column not in OPTIONAL
            if column in given and given[column] != dtype:
                wrong = not (dtype == "object" and given[column] in TEXT)
            if wrong:
                raise CorruptRunError(
                    f"the column specs in {str(file)!r} do not fit the run format: {name} "
                    f"column {column!r} is {given.get(column, 'missing')!r} where the schema "
                    f"has {dtype!r}", path=str(file),
                    recoverable="the Parquet files, with skip_damaged=True")
    return specs


def _thresholds(stored: Any) -> Thresholds:
    if not isinstance(stored, dict):
        return Thresholds()
    # A newer graddebug may store thresholds this one does not know; they cannot apply here.
    known = {k: v for k, v in stored.items() if k in Thresholds.names()}
    try:
        return Thresholds.coerce(known)
    except ConfigError as exc:
        raise CorruptRunError(f"the run's thresholds {stored!r} are unusable: {exc}",
                              recoverable="the records, with graddebug.load(...).rediagnose()"
                              ) from exc
