"""What a run has recorded so far, as frames: the read side of the Watcher."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pluggy

from graddebug.capture.buffer import RunBuffer
from graddebug.capture.live import LiveFindings, as_findings
from graddebug.config import Thresholds
from graddebug.diagnosis import diagnose
from graddebug.errors import RunFileError, WatcherStateError
from graddebug.frames import finding_frame, summary_frame
from graddebug.report.report import Report, notebook_html
from graddebug.runs.layout import check_run_path

__all__ = ["RunResults"]

class RunResults:
    """The frames, findings, summary, Report and kept gradients of a run being recorded.

    The Watcher is one: what it records goes to :attr:`_buffer`, and these methods read it.

    Args:
        buffer: The run's rows.
        thresholds: The thresholds the findings are diagnosed with.
        plugin_manager: Whose detectors diagnose.
    """

    def __init__(self, buffer: RunBuffer, thresholds: Thresholds,
                 plugin_manager: pluggy.PluginManager) -> None:
        self._buffer = buffer
        self.thresholds = thresholds
        self._pm = plugin_manager
        self._live = LiveFindings(thresholds, plugin_manager)

    @property
    def active(self) -> bool:
        """Whether the run is still recording."""
        return False

    def _describe(self) -> tuple[dict[str, Any], dict[str, float]]:
        """The run's metadata and thresholds (the Watcher knows them)."""
        return {}, self.thresholds.as_dict()

    def frame(self) -> pd.DataFrame:
        """Return one row per (step, tensor): the statistics of every recorded gradient.

        Columns, in order: ``step, layer, tensor, kind, depth, shape, numel, norm, mean, std,
        absmax, zero_frac, nan, inf``, plus ``pre_norm`` where an intervention acted.
        """
        return self._buffer.frame()

    def events(self) -> pd.DataFrame:
        """Return the structural events: parameters with no gradient, detached outputs, layers
        no gradient reached, outputs that were non-finite in forward."""
        return self._buffer.events_frame()

    def findings(self) -> pd.DataFrame:
        """Return one row per diagnosis: ``step, layer, tensor, issue, severity, value,
        threshold, message, rank, source, cause``. Empty for a healthy model.

        While the ``with`` block runs, the findings so far, at a cost that does not grow with
        the run (see :mod:`graddebug.capture.live`): the history rules as each step closed,
        and the other rules over the last ``history_window`` recorded steps. Once it has
        ended, the whole run diagnosed, together with anything reported while it ran.
        """
        if self.active:
            return self._buffer.cached("findings", lambda: finding_frame(
                [*self._buffer.internal, *self._live.findings()]))
        return self._buffer.cached("findings", self._whole_run)

    def _whole_run(self) -> pd.DataFrame:
        whole = diagnose(self.frame(), self.events(), self.thresholds,
                         extra=self._buffer.internal, plugin_manager=self._pm)
        seen = set(zip(whole["issue"], whole["layer"], strict=True))
        live = [f for f in self._live.reported() if (f.issue, f.layer) not in seen]
        return finding_frame([*as_findings(whole), *live]) if live else whole

    def summary(self) -> pd.DataFrame:
        """Return the per-layer aggregate over recorded steps, in depth order."""
        return self._buffer.cached("summary",
                                   lambda: summary_frame(self.frame(), self.findings()))

    def report(self, metadata: Mapping[str, Any] | None = None) -> Report:
        """Return the run so far as a :class:`Report`, which outlives the model.

        Args:
            metadata: Extra facts to store with the run.
        """
        return Report(
            self.frame(),
            self.events(),
            self.findings(),
            thresholds=self.thresholds,
            metadata={**self._describe()[0], **(metadata or {})},
        )

    def _repr_html_(self) -> str:
        """The notebook view of the run so far: verdict, findings table, small flow plot."""
        return notebook_html(self.frame(), self.findings())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the run so far to the directory ``path``, for :func:`graddebug.load`.

        The same format as ``watch(log_dir=...)``; see :meth:`graddebug.Report.save`.

        Args:
            path: The run directory to write (a run already there is replaced).

        Returns:
            The run directory.

        Raises:
            RunFileError: ``path`` is a file or a directory that holds something else.
            MissingFrameworkError: pyarrow is missing (``pip install graddebug[report]``).
            WatcherStateError: ``path`` is this Watcher's ``log_dir`` and the block is running.
        """
        check_run_path(path, "save(path)", RunFileError)  # before is_log_dir resolves it
        if self.active and self._buffer.is_log_dir(path):
            raise WatcherStateError(
                f"save({str(path)!r}) would replace the log_dir this Watcher is streaming to; "
                "save elsewhere, or load the log_dir once the `with` block has ended."
            )
        return self.report().save(path)

    def tensors(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Return the full gradients kept by ``keep=`` at one step.

        Keys are the layer name for a layer output (``"fc1"``), ``"fc1.output.0"`` for parts of
        tuple outputs, ``"fc1.weight"`` for parameters; a layer called several times in a step
        adds ``"fc1#1"``, ``"fc1#2"``, ... Arrays are dense (a sparse gradient is densified);
        bfloat16 and float16 gradients are kept as float32. Only the last ``keep_steps``
        recorded steps are held (10 by default).

        Args:
            step: A recorded step; None for the latest step that kept anything.

        Raises:
            WatcherStateError: Nothing was kept (``keep=`` was not given or matched nothing).
            KeyError: ``step`` kept nothing.
        """
        kept = self._buffer.kept
        if not kept:
            raise WatcherStateError(
                "no gradients were kept; pass keep=['layer', ...] to watch() to keep them."
            )
        if step is None:
            step = max(kept)
        if step not in kept:
            raise KeyError(
                f"step {step!r} kept no gradients; steps held now: {sorted(kept)} (only the "
                "last keep_steps recorded steps are held; watch(keep_steps=None) holds all)")
        return dict(kept[step])
