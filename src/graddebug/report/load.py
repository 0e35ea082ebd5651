"""``graddebug.load``: a run on disk, as a Report."""

from __future__ import annotations

import os

from graddebug.diagnosis import diagnose
from graddebug.records import Finding
from graddebug.report.report import Report
from graddebug.runs.reader import Progress, read_run

__all__ = ["load"]


def load(path: str | os.PathLike[str], *, skip_damaged: bool = False,
         progress: Progress | None = None) -> Report:
    """Read a run written by ``watch(log_dir=...)``, ``Watcher.save`` or ``Report.save``.

    A run whose process was killed before the ``with`` block ended holds every step flushed
    before the kill; its findings are diagnosed again, with the run's thresholds, and
    ``report.metadata["run"]["status"]`` is ``"incomplete"`` (``"rediagnosed"`` is True
    whenever the findings were not read from the run). Loading never executes code stored in
    the run (no pickle).

    Args:
        path: The run directory (or its ``graddebug.json``).
        skip_damaged: Return what is readable instead of raising when files are damaged; the
            damaged files are listed in ``report.metadata["run"]["damaged"]``.
        progress: Called as ``progress(done, total)`` while files are read.

    Returns:
        The :class:`graddebug.Report` of the run.

    Raises:
        NotARunError: ``path`` does not exist or holds no run.
        CorruptRunError: A file is truncated or corrupt (the message says what is readable).
        RunFileError: The run was written by a newer graddebug.
        MissingFrameworkError: pyarrow is not installed.
    """
    run = read_run(path, skip_damaged=skip_damaged, progress=progress)
    findings = run.findings
    if findings is None:
        extra = [Finding(*row) for row in run.internal.itertuples(index=False)]
        findings = diagnose(run.records, run.events, run.thresholds, extra=extra)
    return Report(run.records, run.events, findings, thresholds=run.thresholds,
                  metadata=run.metadata)
