"""The part files of a run: reading them, checking each against the schema, refusing damaged
ones without casting, and the frames of the streams they hold (:func:`read_streams` for the
run a live Watcher is writing). :mod:`graddebug.runs.reader` reads whole runs with them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from graddebug.errors import CorruptRunError
from graddebug.records import FINDING_DTYPES
from graddebug.runs.arrowio import require_pyarrow, rows_to_table, table_spec, table_to_frame
from graddebug.runs.layout import STREAMS, link_problem, part_files

__all__ = [
    "OPTIONAL",
    "TEXT",
    "Progress",
    "Streams",
    "concat",
    "corrupt_error",
    "read_all",
    "read_streams",
    "stream_frame",
    "with_appended",
]

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called as the files of a run are read."""


@dataclass
class Streams:
    """What reading a run's parts gave: the tables by stream, the damaged files and why, and
    the step ranges of the readable record parts."""

    tables: dict[str, Any] = field(default_factory=dict)
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    readable: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # step ranges


TEXT = frozenset({"object", "str", "string"})
"""Dtype names of text columns: pandas versions name the schema's ``object`` columns
differently, and all three hold the same values."""

OPTIONAL = frozenset({"pre_norm", "rank", "source", "cause", "weight_norm", "update_norm",
                      "clipped_norm"})
"""Schema columns a part or a spec may lack: ``pre_norm`` exists only where one acted, and runs
written before ``rank``, ``source``, ``cause`` or the optimizer's columns existed lack them
(they come from one process, rank 0, and knew no source lines, causes or updates)."""


_APPENDED_TEXT = ("source", "cause")
"""Text columns appended to the format after its first release, empty in older files."""
_APPENDED_FLOAT = ("weight_norm", "update_norm", "clipped_norm")
"""Number columns appended to the format after its first release, NaN in older files."""


def with_appended(frame: pd.DataFrame, schema: Mapping[str, str] | None = None) -> pd.DataFrame:
    """``frame`` with the columns appended to the format since its files were written: ``rank``
    (0), and ``source`` and ``cause`` (empty) where ``schema`` has them (events have
    ``source``, findings both)."""
    if "rank" not in frame:
        frame = frame.assign(rank=np.zeros(len(frame), dtype="int64"))
    for column in _APPENDED_FLOAT:
        if schema is not None and column in schema and column not in frame:
            frame = frame.assign(**{column: np.full(len(frame), np.nan)})
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
            if name in OPTIONAL:
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


def _check_folders(path: Path, complete: bool, out: Streams) -> None:
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


def read_all(path: Path, extra: Sequence[Path], progress: Progress | None, *,
              complete: bool = False) -> tuple[Streams, dict[Path, Any]]:
    """Read every part of the run at ``path``, and the ``extra`` files (stored findings),
    checking each against its schema; damaged ones are listed, not raised.

    Args:
        path: The run directory.
        extra: Further files with the findings schema.
        progress: Called as files are read.
        complete: The run is marked complete, so a missing stream folder is damage.

    Returns:
        The streams' tables and what was damaged, and the tables of ``extra`` by file.
    """
    out = Streams()
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


def concat(stream: str, tables: list[Any], pending: Sequence[tuple[Any, ...]] = ()) -> Any:
    """One table of ``stream`` from its parts' tables and the rows not written yet."""
    pa, _ = require_pyarrow()
    fields, types = STREAMS[stream]
    if pending or not tables:
        tables = [*tables, rows_to_table(pending, fields, types)]
    return pa.concat_tables(tables, promote_options="default")


def stream_frame(stream: str, table: Any) -> pd.DataFrame:
    """The frame of one stream's table, with the columns appended since it was written."""
    frame = table_to_frame(table, table_spec(table))
    if stream == "records" and "pre_norm" in frame and frame["pre_norm"].isna().all():
        frame = frame.drop(columns="pre_norm")  # as record_frame: only where one acted
    return with_appended(frame, STREAMS[stream][1])


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
        frames[stream] = stream_frame(stream, concat(stream, tables, pending.get(stream, ())))
    return frames


def _ranges(spans: list[tuple[int, int]]) -> str:
    if not spans:
        return "no steps"
    return ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in sorted(spans))


def corrupt_error(path: Path, streams: Streams) -> CorruptRunError:
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
