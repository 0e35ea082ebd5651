"""A run on disk: the format only. Streamed while training (``watch(log_dir=...)``), saved after
the fact (``save``), read back by :func:`graddebug.load`.

Layout of a run directory::

    graddebug.json                 format, status, metadata, thresholds, column specs
    records/part-000000.parquet    one Parquet file per flush (a flush every N recorded steps)
    events/part-000000.parquet
    internal/part-000000.parquet   internal_error findings, as they happen
    findings.parquet               the findings as diagnosed when the run ended

Crash safety: every file is written under a temporary name and renamed into place, so a reader
sees whole files only. A process killed mid-run (SIGKILL, OOM) leaves ``graddebug.json`` with
``"status": "running"`` and every part flushed before the kill. When the ``with`` block ends
(normally or by an exception) the Watcher writes ``findings.parquet`` and then marks the run
``"complete"``. Nothing is pickled; see :mod:`graddebug.runs.arrowio` for how columns are typed.

This package stores and reads frames; it never diagnoses and never builds a Report. Modules:
:mod:`~graddebug.runs.layout` (names, the JSON file), :mod:`~graddebug.runs.arrowio` (exact
column conversions), :mod:`~graddebug.runs.writer`, :mod:`~graddebug.runs.parts` (part files
and their checks) and :mod:`~graddebug.runs.reader` (whole runs).
"""
