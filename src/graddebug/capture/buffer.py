"""The rows of a live run: records, events, internal errors and kept gradients, flushed to a run
directory when ``log_dir`` is set, and the frames built from them (each built once, cached
until new rows arrive)."""

from __future__ import annotations

import contextlib
import gc
import math
import operator
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from graddebug.adapter import Distribution, StepResult
from graddebug.capture.kept import KeptGradients
from graddebug.capture.layers import FailOpen
from graddebug.frames import event_frame, record_frame
from graddebug.records import Event, Finding, Kind, Record
from graddebug.runs.writer import RunWriter

__all__ = ["RunBuffer", "gc_paused"]

OnBug = Callable[[BaseException, str], None]
Warn = Callable[[str, str], None]
Describe = Callable[[], tuple[Mapping[str, Any], Mapping[str, Any]]]


# Enum.value is a descriptor call: slow once per row
_KIND_ORDER = {Kind.ACTIVATION.value: 0, Kind.OP.value: 1}


def _row_order(record: Record) -> tuple[int, float, str, str]:
    """Within a step: activations, then ops, then parameters; each in forward order."""
    depth = record.depth if record.depth >= 0 else math.inf
    return (_KIND_ORDER.get(record.kind, 2), depth, record.layer, record.tensor)


_DEPTH = operator.itemgetter(4)
_KNOWN_DEPTHS = operator.itemgetter(3, 4, 1, 2)
""":func:`_row_order` where every depth is known: the kinds' values sort in that order."""


def _in_order(records: list[Record]) -> list[Record]:
    """``records`` sorted by :func:`_row_order`, with a key built in C where every depth is
    known (a large model closes tens of thousands of rows a step)."""
    if records and min(map(_DEPTH, records)) >= 0:
        return sorted(records, key=_KNOWN_DEPTHS)
    return sorted(records, key=_row_order)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a step's records are built.

    A step of a large model allocates tens of thousands of record tuples, none of them part of
    a cycle. Every 700 allocations trigger a collection, and every hundredth of those walks
    the whole heap, which in a training process holds every module, parameter and tensor
    wrapper: building records then cost more per row the larger the model was (on 10,000
    layers, about two thirds of closing a step). The collector's state is restored after.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class RunBuffer:
    """What a Watcher has recorded, in memory or streamed to ``log_dir``.

    With ``log_dir``, :attr:`records` and :attr:`events` hold only the rows not flushed yet;
    :meth:`frame` and :meth:`events_frame` read the whole run back.

    :attr:`distribution` (set by the Watcher once its adapter is attached) says which rank
    this process is: rows of a rank other than 0 are marked with it, and with ``log_dir``
    each rank writes parts of its own into the one run directory.

    Args:
        log_dir: The run directory to stream to, or None to keep every row in memory.
        flush_every: With ``log_dir``, write a part every this many recorded steps.
        describe: Returns the run's metadata and thresholds, for its JSON file.
        on_bug: Where a failed write goes (``Watcher.internal_error``): a full disk must not
            stop training.
        keep_steps: How many recorded steps of ``keep=`` gradients to hold (None: all).
        warn: Warns once per key (``Watcher.warn_once``).

    Raises:
        ConfigError: ``log_dir`` is a file or a non-empty directory.
        MissingFrameworkError: ``log_dir`` was given and pyarrow is missing.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None, flush_every: int,
                 describe: Describe, on_bug: OnBug, keep_steps: int | None = None,
                 warn: Warn | None = None) -> None:
        self._describe = describe
        self._on_bug = on_bug
        self.records: list[tuple[Any, ...]] = []
        """Record rows as plain tuples in :class:`~graddebug.records.Record` field order: the
        collector stops tracking a plain tuple of numbers and strings the first time it looks
        at one, where a named tuple stays tracked. A large model keeps tens of thousands of
        rows a step, which would otherwise fill the oldest generation and make its
        whole-heap collections frequent."""
        self.events: list[Event] = []
        self.internal: list[Finding] = []
        self.kept = KeptGradients(keep_steps, warn or (lambda key, message: None))
        self.log = RunWriter(log_dir, flush_every=flush_every) if log_dir is not None else None
        self._flushed_internal = 0
        self._cache: dict[str, pd.DataFrame] = {}
        self._shared: list[tuple[Any, ...]] = []
        """With ``log_dir``, on a rank other than 0: the rows that combine every rank, which
        rank 0 writes; kept here for this process's frames."""
        self.distribution = Distribution()

    @property
    def rows(self) -> int:
        """Record rows held in memory."""
        return len(self.records)

    # -- adding rows --------------------------------------------------------------------------

    def add(self, step: int, result: StepResult) -> None:
        """Add a recorded step's rows; flush when a flush is due."""
        records, events = result.records, result.events
        rank = self.distribution.rank
        if rank:  # adapters build rows for rank 0; each process knows its own rank
            if not result.shared:
                records = [r._replace(rank=rank) for r in records]
            events = [e._replace(rank=rank) for e in events]
        if result.shared and rank and self.log is not None:
            # Rows every rank holds alike: rank 0 writes them, the others keep them.
            self._shared.extend(map(tuple, _in_order(records)))
        else:
            self.records.extend(map(tuple, _in_order(records)))
        self.events.extend(events)
        if result.kept:
            self.kept.add(step, result.kept)
        self._cache.clear()
        if self.log is not None and self.log.step_recorded():
            self.flush()

    def add_rows(self, records: list[Record]) -> None:
        """Add rows to a step recorded already (a loss known after its step closed)."""
        rank = self.distribution.rank
        self.records.extend(tuple(r._replace(rank=rank)) if rank else tuple(r) for r in records)
        self._cache.clear()

    def add_internal(self, finding: Finding) -> None:
        """Add an internal error (a bug caught in a hook)."""
        self.internal.append(finding._replace(rank=self.distribution.rank))
        self._cache.clear()

    # -- log_dir ------------------------------------------------------------------------------

    def start(self) -> None:
        """Create the run directory and mark it running (nothing without ``log_dir``).

        A directory that cannot be created raises: nothing has run yet. A metadata write that
        fails (a full disk) goes to ``on_bug`` like a failed flush, and the next flush retries it.

        Raises:
            ConfigError: ``log_dir`` became a file or a non-empty directory.
            OSError: The directory cannot be created.
        """
        log = self.log
        if log is None:
            return
        log.rank = self.distribution.rank
        log.processes = self.distribution.writers
        log.create()
        with FailOpen(self._on_bug, f"log_dir {str(log.path)!r}"):
            log.start(*self._describe())

    def flush(self) -> None:
        """Write the rows not flushed yet as one part per stream, then drop them.

        A failure (a full disk) must not stop training: it goes to ``on_bug``, the rows stay
        in memory, and the next flush writes them.
        """
        log = self.log
        if log is None:
            return
        internal = self.internal[self._flushed_internal:]
        written = False
        with FailOpen(self._on_bug, f"log_dir {str(log.path)!r}"):
            if log.parts == 0:  # an adapter chosen by tap() is known by the first flush
                log.start(*self._describe())
            log.flush(self.records, self.events, internal)
            written = True
        if not written:
            return
        self.records, self.events = [], []
        self._flushed_internal += len(internal)
        self._cache.clear()

    def finish(self, findings: Callable[[], pd.DataFrame]) -> None:
        """Flush, write the findings and mark the run complete.

        Args:
            findings: Diagnoses the whole run (called here, so that a failure is reported).
        """
        log = self.log
        if log is None:
            return
        self.flush()
        unwritten = self.unwritten()
        reason = None
        if unwritten:
            reason = (f"{unwritten} rows could not be written (see the internal_error "
                      "findings); the Watcher still holds them: dbg.frame() has them and "
                      "dbg.save(path) writes them elsewhere")
        with FailOpen(self._on_bug, f"log_dir {str(log.path)!r}"):
            log.finish(self.frame(), self.events_frame(), findings(), *self._describe(),
                       incomplete=reason)
        # What reached the disk is read back when asked; rows that did not stay in memory.
        self._cache.pop("frame", None)
        self._cache.pop("events", None)
        log.release()

    def unwritten(self) -> int:
        """Rows (records, events, internal errors) that a ``log_dir`` run has not written."""
        if self.log is None:
            return 0
        return (len(self.records) + len(self.events)
                + len(self.internal) - self._flushed_internal)

    def is_log_dir(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` is the directory this buffer streams to."""
        return self.log is not None and Path(path).resolve() == self.log.path.resolve()

    # -- frames ---------------------------------------------------------------------------------

    def cached(self, name: str, build: Callable[[], pd.DataFrame]) -> pd.DataFrame:
        """A frame built once and kept until new rows arrive."""
        if name not in self._cache:
            self._cache[name] = build()
        return self._cache[name]

    def frame(self) -> pd.DataFrame:
        """The record frame of the whole run."""
        if "frame" not in self._cache:
            self._read()
        return self._cache["frame"]

    def events_frame(self) -> pd.DataFrame:
        """The event frame of the whole run."""
        if "events" not in self._cache:
            self._read()
        return self._cache["events"]

    def _read(self) -> None:
        if self.log is not None:
            self._cache["frame"], self._cache["events"] = self.log.read(
                self._shared + self.records if self._shared else self.records, self.events)
        else:
            self._cache["frame"] = record_frame(self.records)
            self._cache["events"] = event_frame(self.events)
