"""Reading a run back into frames: :func:`read_run` for a finished or crashed run, and
:func:`read_streams` for the run a live Watcher is writing. Nothing here diagnoses; the report
layer (:func:`graddebug.load`) turns what is read into a Report."""

from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from graddebug.config import Thresholds
from graddebug.errors import ConfigError, CorruptRunError, NotARunError
from graddebug.records import EVENT_DTYPES, FINDING_DTYPES, RECORD_DTYPES
from graddebug.runs.arrowio import (
    ColumnSpec,
    require_pyarrow,
    rows_to_table,
    table_spec,
    table_to_frame,
)
from graddebug.runs.layout import (
    FINDINGS_FILE,
    META_FILE,
    STREAMS,
    link_problem,
    meta_file,
    part_files,
    read_meta,
    writer_count,
)

__all__ = ["Progress", "StoredRun", "read_run", "read_streams"]

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called as the files of a run are read."""


@dataclass
class _Streams:
    tables: dict[str, Any] = field(default_factory=dict)
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    readable: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # step ranges


_TEXT = frozenset({"object", "str", "string"})
"""Dtype names of text columns: pandas versions name the schema's ``object`` columns
differently, and all three hold the same values."""

_OPTIONAL = frozenset({"pre_norm", "rank", "source", "cause"})
"""Schema columns a part or a spec may lack: ``pre_norm`` exists only where one acted, and runs
written before ``rank`` or ``source`` existed lack them (they come from one process, rank 0,
and knew no source lines)."""


_APPENDED_TEXT = ("source", "cause")
"""Text columns appended to the format after its first release, empty in older files."""


def _ranked(frame: pd.DataFrame, schema: Mapping[str, str] | None = None) -> pd.DataFrame:
    """``frame`` with the columns appended to the format since its files were written: ``rank``
    (0), and ``source`` and ``cause`` (empty) where ``schema`` has them (events have
    ``source``, findings both)."""
    if "rank" not in frame:
        frame = frame.assign(rank=np.zeros(len(frame), dtype="int64"))
    for column in _APPENDED_TEXT:
        if schema is None or column not in schema:
            continue
        if column not in frame:
            frame = frame.assign(**{column: pd.Series([""] * len(frame), dtype=object,
                                                      index=frame.index)})
        elif frame[column].isna().any():  # parts written before it, read with newer ones
            frame = frame.assign(**{column: frame[column].fillna("")})
    return frame


class _Damaged(Exception):
    pass


def _arrow_fits(pa: Any, dtype: str, kind: Any) -> bool:
    """Whether an Arrow column of type ``kind`` holds the schema's ``dtype`` as graddebug
    writes it: strings (or lists of int64, for shapes) for text, the exact type otherwise."""
    if dtype == "object":
        return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or (
            pa.types.is_list(kind) and kind.value_type == pa.int64()))
    return bool(kind == pa.from_numpy_dtype(np.dtype(dtype)))


def _check_table(table: Any, schema: Mapping[str, str]) -> None:
    """Refuse a table whose schema columns are missing or not of the schema's type.

    Casting would turn a tampered column (``int8`` steps, float norms stored as ``uint8``, a
    string ``step``) into plausible-looking numbers, so nothing is cast.
    """
    pa, _ = require_pyarrow()
    names = table.column_names
    for name, dtype in schema.items():
        if name not in names:
            if name in _OPTIONAL:
                continue
            raise _Damaged(f"no {name!r} column in {names}")
        kind = table.schema.field(name).type
        if not _arrow_fits(pa, dtype, kind):
            raise _Damaged(f"column {name!r} is of Arrow type {kind}, where the schema has "
                           f"{dtype}")


def _read_table(run: Path, file: Path) -> Any:
    refused = link_problem(run, file)
    if refused is not None:
        raise _Damaged(refused)
    if not file.is_file():
        raise _Damaged("it is not a regular file")
    pa, pq = require_pyarrow()
    try:
        return pq.read_table(file)
    except (pa.ArrowException, OSError) as exc:
        raise _Damaged(str(exc)) from exc


def _check_folders(path: Path, complete: bool, out: _Streams) -> None:
    """A stream folder that is a file (or a link) would read as a stream with no rows."""
    for stream in STREAMS:
        folder = path / stream
        refused = link_problem(path, folder)
        if refused is None and folder.exists() and not folder.is_dir():
            refused = "it is a file where the run has a directory of parts"
        elif refused is None and complete and not folder.exists():
            refused = "the directory is missing from a run marked complete"
        if refused is not None:
            out.damaged.append((folder, refused))


def _read_all(path: Path, extra: Sequence[Path], progress: Progress | None, *,
              complete: bool = False) -> tuple[_Streams, dict[Path, Any]]:
    out = _Streams()
    _check_folders(path, complete, out)
    refused = {f for f, _ in out.damaged}
    files = {s: ([] if path / s in refused else f) for s, f in part_files(path).items()}
    total = sum(len(v) for v in files.values()) + len(extra)
    done = 0
    others: dict[Path, Any] = {}
    for stream, paths in [*files.items(), ("", list(extra))]:
        tables = []
        schema = STREAMS[stream][1] if stream else FINDING_DTYPES
        for file in paths:
            try:
                table = _read_table(path, file)
                _check_table(table, schema)
            except _Damaged as exc:
                out.damaged.append((file, str(exc)))
            else:
                if not stream:
                    others[file] = table
                else:
                    tables.append(table)
                    if stream == "records" and table.num_rows:
                        steps = table.column("step").to_numpy()
                        out.readable.setdefault(stream, []).append(
                            (int(steps.min()), int(steps.max())))
            done += 1
            if progress is not None:
                progress(done, total)
        if stream:
            out.tables[stream] = tables
    return out, others


def _concat(stream: str, tables: list[Any], pending: Sequence[tuple[Any, ...]] = ()) -> Any:
    pa, _ = require_pyarrow()
    fields, types = STREAMS[stream]
    if pending or not tables:
        tables = [*tables, rows_to_table(pending, fields, types)]
    return pa.concat_tables(tables, promote_options="default")


def _stream_frame(stream: str, table: Any) -> pd.DataFrame:
    frame = table_to_frame(table, table_spec(table))
    if stream == "records" and "pre_norm" in frame and frame["pre_norm"].isna().all():
        frame = frame.drop(columns="pre_norm")  # as record_frame: only where one acted
    return _ranked(frame, STREAMS[stream][1])


def read_streams(path: Path, *, pending: Mapping[str, Sequence[tuple[Any, ...]]],
                 cache: dict[str, dict[Path, Any]], rank: int = 0) -> dict[str, pd.DataFrame]:
    """Return the record and event frames of a run being written, with rows still in memory.

    Args:
        path: The run directory.
        pending: Rows not flushed yet, by stream name.
        cache: Tables of parts read before, by stream and file; parts not in it are read and
            added, so that a Watcher asked for its frame again reads only the new parts.
        rank: The rank whose parts are read (a Watcher reads back only its own).

    Raises:
        CorruptRunError: A part cannot be read.
    """
    files = part_files(path, rank)
    frames = {}
    for stream in ("records", "events"):
        known = cache.setdefault(stream, {})
        for file in files[stream]:
            if file not in known:
                try:
                    known[file] = _read_table(path, file)
                    _check_table(known[file], STREAMS[stream][1])
                except _Damaged as exc:
                    known.pop(file, None)
                    raise CorruptRunError(
                        f"{str(file)!r}, written by this Watcher, can no longer be read ({exc})",
                        path=str(file), recoverable="the other parts") from exc
        tables = [known[f] for f in files[stream] if f in known]
        frames[stream] = _stream_frame(stream, _concat(stream, tables, pending.get(stream, ())))
    return frames


def _ranges(spans: list[tuple[int, int]]) -> str:
    if not spans:
        return "no steps"
    return ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in sorted(spans))


def _corrupt(path: Path, streams: _Streams) -> CorruptRunError:
    names = ", ".join(f"{str(f)!r} ({why})" for f, why in streams.damaged)
    counts = ", ".join(f"{len(t)} {s} part(s)" for s, t in streams.tables.items())
    recoverable = (f"{counts}; record steps {_ranges(streams.readable.get('records', []))}")
    return CorruptRunError(
        f"run {str(path)!r}: {len(streams.damaged)} file(s) are truncated or corrupt: {names}. "
        f"Still readable: {recoverable}. graddebug.load(path, skip_damaged=True) returns what is "
        "readable (findings are then diagnosed again from it).",
        path=str(streams.damaged[0][0]),
        recoverable=recoverable,
    )


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
    streams, others = _read_all(run, [findings_file] if complete else [], progress,
                                complete=finished)
    if streams.damaged and not skip_damaged:
        raise _corrupt(run, streams)
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


def _frames(run: Path, streams: _Streams, specs: Mapping[str, ColumnSpec],
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
            table = _concat(stream, tables)
            spec = specs.get(stream)
            frames[stream] = (_ranked(table_to_frame(table, spec), STREAMS[stream][1]) if spec
                              else _stream_frame(stream, table))
        stored = (_ranked(table_to_frame(findings, specs["findings"]), FINDING_DTYPES)
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
            wrong = column not in given and column not in _OPTIONAL
            if column in given and given[column] != dtype:
                wrong = not (dtype == "object" and given[column] in _TEXT)
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
