"""TensorBoard output: per-tensor gradient norms as scalars, and norms over layers as histograms.

Two ways in, one format:

- ``graddebug report RUN --tensorboard DIR`` writes a recorded run (:func:`write_report`);
- ``watch(model, tensorboard=DIR)`` streams each recorded step while training. That form is a
  plugin of the ``graddebug_step_recorded`` hook (this module is registered as a built-in
  plugin), the same hook a wandb or MLflow logger would implement.

For each recorded step and each tensor, the scalar ``graddebug/<layer>.<tensor>/norm`` (the
tags the Lightning and Trainer callbacks log), and for each kind (activation, parameter) the
histogram ``graddebug/log10_norm/<kind>`` of log10 norms over the tensors of that step. Norms
span many orders of magnitude across layers, so their log is what a histogram can show; zero
and non-finite norms are left out of the histogram (the scalars keep them). Where they are
known, also the step's loss (``graddebug/loss``) and each parameter's update/weight ratio
(``graddebug/<layer>.<tensor>/update_ratio``), and each finding as text at the step it was
first seen (``graddebug/findings``), so that an event shows on the step axis.

The files are written with tensorboardX, imported only when used: the core imports no
framework. tensorboardX itself imports torch when torch is installed.
"""

from __future__ import annotations

import importlib
import math
import weakref
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from graddebug.errors import MissingFrameworkError
from graddebug.frames import combine_ranks
from graddebug.hookspecs import hookimpl
from graddebug.records import Kind, Record

if TYPE_CHECKING:
    import os

    import pandas as pd

    from graddebug.adapter import CallbackContext, StepResult
    from graddebug.report.report import Report

__all__ = [
    "graddebug_run_finished",
    "graddebug_step_recorded",
    "histogram_tag",
    "scalar_tag",
    "write_report",
]

# The writers of the live runs, by Watcher. Weak keys: a Watcher that is dropped without
# leaving its block leaves no writer behind.
_WRITERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


_LOSS = Kind.LOSS.value


def _tensorboardx() -> ModuleType:
    try:
        return importlib.import_module("tensorboardX")
    except ImportError as exc:
        raise MissingFrameworkError(
            f"graddebug's TensorBoard output needs tensorboardX ({exc}); "
            "install it with: pip install graddebug[tensorboard]"
        ) from exc


def scalar_tag(layer: str, tensor: str, rank: int = 0) -> str:
    """The scalar tag of one tensor's norm: ``graddebug/<layer>.<tensor>/norm``, with
    ``/rank<r>`` appended for the rows of a replica other than 0 in one process."""
    suffix = f"/rank{rank}" if rank > 0 else ""
    return f"graddebug/{layer}.{tensor}/norm{suffix}"


def histogram_tag(kind: str) -> str:
    """The histogram tag of the log10 norms of one kind of tensor over layers."""
    return f"graddebug/log10_norm/{kind}"


LOSS_TAG = "graddebug/loss"
"""The scalar tag of the step's loss."""
FINDINGS_TAG = "graddebug/findings"
"""The text tag under which each finding is written at its step."""

Row = tuple[str, str, str, float, int, float, float, float]
"""(layer, tensor, kind, norm, rank, mean, weight_norm, update_norm) of one record."""


def ratio_tag(layer: str, tensor: str) -> str:
    """The scalar tag of one parameter's update/weight ratio."""
    return f"graddebug/{layer}.{tensor}/update_ratio"


def _write_step(writer: Any, step: int, rows: Iterable[Row]) -> None:
    """Write one step's scalars and histograms."""
    by_kind: dict[str, list[float]] = {}
    for layer, tensor, kind, norm, rank, mean, weight, update in rows:
        if kind == _LOSS:
            writer.add_scalar(LOSS_TAG, float(mean), global_step=step)
            continue
        writer.add_scalar(scalar_tag(layer, tensor, rank), float(norm), global_step=step)
        if math.isfinite(norm) and norm > 0:
            by_kind.setdefault(kind, []).append(math.log10(norm))
        if weight > 0 and math.isfinite(update):
            writer.add_scalar(ratio_tag(layer, tensor), float(update / weight),
                              global_step=step)
    for kind, values in sorted(by_kind.items()):
        writer.add_histogram(histogram_tag(kind), np.asarray(values), global_step=step,
                             bins="auto")


def _write_findings(writer: Any, findings: pd.DataFrame) -> None:
    """Write each finding as text at its step."""
    for step, layer, tensor, issue, cause, message in zip(
            findings["step"], findings["layer"], findings["tensor"], findings["issue"],
            findings["cause"], findings["message"], strict=True):
        where = f"{layer}.{tensor}" if tensor else (layer or "every layer")
        writer.add_text(FINDINGS_TAG, f"**{issue}** at `{where}` (cause: {cause or '-'}): "
                                      f"{message}", global_step=int(step))


def _rows(records: Iterable[Record]) -> list[Row]:
    return [(r.layer, r.tensor, r.kind, r.norm, r.rank, r.mean, r.weight_norm, r.update_norm)
            for r in records]


def write_report(report: Report, log_dir: str | os.PathLike[str]) -> Path:
    """Write a recorded run as TensorBoard event files.

    Args:
        report: The run (``graddebug.load(path)``, ``dbg.report()``).
        log_dir: The directory to write to (created if needed); point ``tensorboard
            --logdir`` at it.

    Returns:
        The directory.

    Raises:
        MissingFrameworkError: tensorboardX is not installed.
    """
    writer = _tensorboardx().SummaryWriter(logdir=str(log_dir))
    try:
        frame = combine_ranks(report.frame())  # a multi-rank run as its global view
        steps = frame["step"].to_numpy()
        columns = frame[["layer", "tensor", "kind", "norm", "rank", "mean", "weight_norm",
                         "update_norm"]]
        for step in np.unique(steps):
            _write_step(writer, int(step),
                        columns[steps == step].itertuples(index=False, name=None))
        _write_findings(writer, report.findings())
    finally:
        writer.close()
    return Path(log_dir)


@hookimpl
def graddebug_step_recorded(watcher: CallbackContext, step: int, result: StepResult) -> None:
    """Stream a recorded step to ``watch(tensorboard=DIR)``; nothing when not asked for."""
    log_dir = getattr(watcher, "tensorboard", None)
    if log_dir is None:
        return
    writer = _WRITERS.get(watcher)
    if writer is None:
        rank = watcher.distribution.rank
        if rank:  # each rank of a distributed run is a TensorBoard run of its own
            log_dir = Path(log_dir) / f"rank{rank}"
        writer = _WRITERS[watcher] = _tensorboardx().SummaryWriter(logdir=str(log_dir))
    _write_step(writer, step, _rows(result.records))
    _write_findings(writer, result.findings)


@hookimpl
def graddebug_run_finished(watcher: CallbackContext) -> None:
    """Close the writer of a run that streamed to TensorBoard."""
    writer = _WRITERS.pop(watcher, None)
    if writer is not None:
        writer.close()
