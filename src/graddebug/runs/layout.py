"""The names and the JSON file of a run directory: what writer and reader agree on."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from graddebug.errors import ConfigError, CorruptRunError, GradDebugError, RunFileError
from graddebug.records import (
    EVENT_DTYPES,
    FINDING_DTYPES,
    RECORD_DTYPES,
    Event,
    Finding,
    Record,
)

__all__ = [
    "FINDINGS_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "PART_RE",
    "RANK_META_RE",
    "STREAMS",
    "atomic_write",
    "base_meta",
    "check_run_path",
    "is_run",
    "link_problem",
    "meta_file",
    "now",
    "part_files",
    "part_name",
    "read_meta",
    "write_json",
]

FORMAT = "graddebug-run"
FORMAT_VERSION = 1
META_FILE = "graddebug.json"
FINDINGS_FILE = "findings.parquet"

STREAMS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "records": (Record._fields, RECORD_DTYPES),
    "events": (Event._fields, EVENT_DTYPES),
    "internal": (Finding._fields, FINDING_DTYPES),
}
"""The part streams: the tuple fields written for each, and their dtypes (from the schema)."""

PART_RE = re.compile(r"^part-(\d{6,})(?:-rank(\d{1,6}))?\.parquet$")
"""A part's file name: its index, and the rank that wrote it when not 0."""
RANK_META_RE = re.compile(r"^graddebug\.rank(\d{1,6})\.json$")
"""The JSON file of a rank other than 0 in a multi-rank run (rank 0 writes :data:`META_FILE`,
which holds the run's metadata; the others record only their own status)."""


def part_name(index: int, rank: int = 0) -> str:
    """The file name of part ``index`` written by ``rank``."""
    return f"part-{index:06d}.parquet" if rank == 0 else f"part-{index:06d}-rank{rank}.parquet"


def meta_file(rank: int = 0) -> str:
    """The name of the JSON file that ``rank`` writes."""
    return META_FILE if rank == 0 else f"graddebug.rank{rank}.json"


def writer_count(meta: Mapping[str, Any]) -> int | None:
    """How many processes write the run whose JSON metadata file holds ``meta``: its
    ``processes``, or its ``world_size`` for runs written before replicas in one process were
    told apart; None when neither is an int."""
    stored = meta.get("metadata")
    if not isinstance(stored, dict):
        return None
    size = stored.get("processes", stored.get("world_size"))
    return size if isinstance(size, int) else None


def now() -> str:
    """The current UTC time, ISO 8601 to the second (as stored in metadata)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def check_run_path(path: object, option: str,
                   error: type[GradDebugError] = ConfigError) -> Path:
    """Check that ``path`` can name a run directory, before anything is written.

    The operating system accepts names that a run cannot hold: a name that is not valid UTF-8
    (the run's JSON file and Parquet's file system layer encode paths as UTF-8), a NUL byte,
    or a path below a regular file. Each would otherwise fail mid-way with a raw
    ``UnicodeEncodeError``, ``ValueError`` or ``NotADirectoryError``.

    Args:
        path: The ``str`` or ``os.PathLike`` the user gave.
        option: How the user gave it, for the message (``"log_dir"``, ``"save(path)"``).
        error: The error class to raise.

    Returns:
        The path.

    Raises:
        GradDebugError: ``error``, naming the path and the fix.
    """
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text:
        raise error(f"{option}={path!r} must be a non-empty str or pathlib.Path naming a "
                    "directory, e.g. \"runs/exp1\".")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{option}={text!r} is not valid UTF-8 ({exc.reason} at position "
                    f"{exc.start}), and a run stores its path as UTF-8. Choose a directory "
                    "name that is valid UTF-8.") from exc
    if "\0" in text:
        raise error(f"{option}={text!r} holds a NUL character, which no file name may hold.")
    for parent in Path(text).absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise error(f"{option}={text!r} lies under {str(parent)!r}, which is a file, "
                            "not a directory. Choose a path inside a directory.")
            break
    return Path(text)


def is_run(path: Path) -> bool:
    """Whether ``path`` is a directory holding a graddebug run's JSON file."""
    return path.is_dir() and (path / META_FILE).is_file()


def part_files(path: Path, rank: int | None = None) -> dict[str, list[Path]]:
    """The part files of every stream of a run: rank by rank, each in the order written.

    Args:
        path: The run directory.
        rank: Only the parts of this rank; None for every rank's.
    """
    files: dict[str, list[Path]] = {}
    for stream in STREAMS:
        folder = path / stream
        found = [((int(m[2] or 0), int(m[1])), n)
                 for n in (os.listdir(folder) if folder.is_dir() else [])
                 if (m := PART_RE.match(n))]
        files[stream] = [folder / n for key, n in sorted(found)
                         if rank is None or key[0] == rank]
    return files


def link_problem(run: Path, path: Path) -> str | None:
    """Why ``path`` must not be read as part of the run ``run``, or None when it may.

    A run directory is untrusted input (it may come from someone else's machine): a file in
    it that is a symbolic link, or whose real path lies outside the run, would make the reader
    open files the run does not own (``/etc/passwd``, a device). graddebug itself never writes
    links, so any link is refused. The run directory itself may be reached through a link.

    Args:
        run: The run directory.
        path: A file or folder inside it.
    """
    if path.is_symlink():
        return f"it is a symbolic link (to {os.readlink(path)!r}); a run holds no links"
    try:
        inside = path.resolve().is_relative_to(run.resolve())
    except (OSError, RuntimeError) as exc:  # a link loop
        return f"its real path cannot be resolved ({exc})"
    if not inside:
        return f"its real path {str(path.resolve())!r} lies outside the run directory"
    return None


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary sibling renamed into place: readers see whole files."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    # numpy scalars given as options (every=np.int64(5)) stay numbers in the file.
    return value.item() if isinstance(value, np.generic) else str(value)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write a JSON file atomically (values that are not JSON are stored as their ``str``)."""
    text = json.dumps(payload, indent=1, default=_json_default, allow_nan=True)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def base_meta(status: str, metadata: Mapping[str, Any], thresholds: Mapping[str, Any],
              **more: Any) -> dict[str, Any]:
    """The content of a run's JSON file.

    Args:
        status: ``"running"`` or ``"complete"``.
        metadata: Facts about the run (a ``"run"`` key, which loading adds, is dropped).
        thresholds: The thresholds of the run, as a dict.
        **more: Further top-level keys (``parts``, ``flush_every``, ``columns``).
    """
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "status": status,
        "metadata": {k: v for k, v in metadata.items() if k != "run"},
        "thresholds": dict(thresholds),
        **more,
    }


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check a run's JSON file.

    Raises:
        CorruptRunError: The file is not valid JSON (or nested too deeply to parse), or it is
            a symbolic link or lies outside the run directory.
        RunFileError: It was written by a newer graddebug, or is not a graddebug run file.
    """
    file = path / META_FILE
    refused = link_problem(path, file)
    if refused is not None:
        raise CorruptRunError(f"{str(file)!r} cannot be read: {refused}.", path=str(file),
                              recoverable="nothing: the run directory was tampered with")
    try:
        # RecursionError: JSON nested thousands of levels deep, which graddebug never writes.
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
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
