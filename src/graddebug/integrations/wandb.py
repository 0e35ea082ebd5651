"""Weights & Biases output: graddebug's compact metrics and its findings, in the active run.

::

    run = wandb.init(project="my-project")
    with log_to_wandb(graddebug.watch(model)) as dbg:
        ...                       # the loop, with its own wandb.log({"loss": ...})

This module is a built-in plugin of the ``graddebug_step_recorded`` hook, as the TensorBoard
writer is; :func:`log_to_wandb` only says which Watcher streams into which run. At each
recorded step it logs the compact set of the training callbacks
(:mod:`graddebug.integrations.metrics`: ``graddebug/grad_norm``,
``graddebug/grad_norm/<layer>``, ``graddebug/update_ratio/<layer>``, ``graddebug/findings``,
each with ``.../max``), ``graddebug/loss`` where the step has one, and ``graddebug/step``.

Where the values go. They ride on the host's own rows, as ``wandb.watch``'s gradients do:
``run.log(..., commit=False)``, so that they land in the row of the user's next
``wandb.log`` and never advance W&B's step (a ``wandb.log(step=N)`` of the user's stays valid).
When several recorded steps come before the user's next row, that row holds the latest values
and their maxima since the previous row (``.../max``), and ``graddebug/findings`` counts the
findings of all of them, as the callbacks log at their host's cadence. Charts of
``graddebug/*`` plot against ``graddebug/step`` (``run.define_metric``), the step of
``dbg.frame()``. A loop that logs nothing itself gets one row, committed by ``wandb.finish()``.

Findings. Each finding of severity ``warning`` or ``error`` raises one ``run.alert`` when it
is first seen, one per issue and layer in a run (W&B holds back a second alert of the same
title for ``wait_duration``; a title per issue and layer is never repeated), and the whole
``dbg.findings()`` is logged as a ``wandb.Table`` (``graddebug/findings_table``) when the
Watcher's run ends. A W&B Table is an immutable file: logging it each time the findings change
would store a copy per change, and the alerts already tell of each finding live. A healthy run
logs no alert and no table.

wandb is imported only by :func:`log_to_wandb`: the core imports no framework.
"""

from __future__ import annotations

import importlib
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from graddebug.adapter import CallbackContext
from graddebug.errors import ConfigError, MissingFrameworkError
from graddebug.hookspecs import hookimpl
from graddebug.integrations.metrics import PREFIX, step_metrics
from graddebug.records import Kind, Record, Severity

if TYPE_CHECKING:
    import pandas as pd

    from graddebug.adapter import StepResult

__all__ = [
    "FINDINGS_KEY",
    "LOSS_KEY",
    "STEP_KEY",
    "TABLE_KEY",
    "alert_title",
    "graddebug_run_finished",
    "graddebug_step_recorded",
    "log_to_wandb",
]

STEP_KEY = f"{PREFIX}/step"
"""The graddebug step of the values in a row: the x axis of every ``graddebug/*`` chart."""
LOSS_KEY = f"{PREFIX}/loss"
"""The step's loss, where graddebug saw it (``dbg.step(loss=...)``); the TensorBoard tag too."""
FINDINGS_KEY = f"{PREFIX}/findings"
"""How many findings the recorded steps of a row brought (the callbacks' metric)."""
TABLE_KEY = f"{PREFIX}/findings_table"
"""The key of the ``wandb.Table`` of ``dbg.findings()``, logged when the run ends."""

_LOSS = Kind.LOSS.value
_LEVELS = {Severity.ERROR.value: "ERROR", Severity.WARNING.value: "WARN"}
_TITLE_LENGTH = 63  # W&B refuses an alert title of 64 characters or more

W = TypeVar("W", bound=CallbackContext)


def _wandb() -> ModuleType:
    try:
        return importlib.import_module("wandb")
    except ImportError as exc:
        raise MissingFrameworkError(
            f"graddebug's Weights & Biases output needs wandb ({exc}); "
            "install it with: pip install graddebug[wandb]"
        ) from exc


def alert_title(issue: str, layer: str) -> str:
    """The title of the alert of one issue at one layer: ``graddebug: <issue> at <layer>``,
    cut to the 63 characters W&B accepts."""
    title = f"graddebug: {issue} at {layer or 'every layer'}"
    return title if len(title) <= _TITLE_LENGTH else title[:_TITLE_LENGTH - 3] + "..."


def _larger(a: float, b: float) -> float:
    """The larger of two values; NaN wins, so that a non-finite step shows in the maximum."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a if a >= b else b


@dataclass
class _Stream:
    """Where one Watcher's steps go, and what the run's current row holds of them."""

    run: Any
    every_tensor: bool
    alerts: bool
    row: int | None = None  # the W&B step of the row the latest values were logged into
    top: dict[str, float] = field(default_factory=dict)  # maxima since that row began
    found: int = 0  # findings since that row began
    alerted: set[tuple[str, str]] = field(default_factory=set)

    def log_step(self, step: int, records: Iterable[Record], findings: pd.DataFrame) -> None:
        """Log one recorded step into the host's pending row, and alert its new findings."""
        records = list(records)
        # One round trip to wandb's service (1.3 ms here, as much as run.log itself): the only
        # public way to learn whether the host committed the row since the last step.
        row = self.run.step
        if row != self.row:  # the host committed the previous row: a new interval begins
            self.row, self.top, self.found = row, {}, 0
        latest = step_metrics(records, every_tensor=self.every_tensor)
        for r in records:
            if r.kind == _LOSS:
                latest[LOSS_KEY] = float(r.mean)
        top = self.top
        for key, value in latest.items():
            top[key] = _larger(top[key], value) if key in top else value
        self.found += len(findings)
        data: dict[str, float | int] = dict(latest)
        data.update({f"{key}/max": value for key, value in top.items()})
        data[FINDINGS_KEY] = float(self.found)
        data[STEP_KEY] = step
        self.run.log(data, commit=False)
        self.alert(findings)

    def alert(self, findings: pd.DataFrame) -> None:
        """Raise one alert per issue and layer not alerted yet, for warnings and errors."""
        if not self.alerts:
            return
        for step, layer, tensor, issue, severity, cause, message in zip(
                findings["step"], findings["layer"], findings["tensor"], findings["issue"],
                findings["severity"], findings["cause"], findings["message"], strict=True):
            level = _LEVELS.get(severity)
            if level is None or (issue, layer) in self.alerted:
                continue
            self.alerted.add((issue, layer))
            where = f"{layer}.{tensor}" if tensor else (layer or "every layer")
            self.run.alert(title=alert_title(issue, layer), level=level,
                           text=f"step {int(step)}, {where} (cause: {cause or '-'}): {message}")


# The streams of the live runs, by Watcher. Weak keys: a Watcher that is dropped without
# leaving its block leaves no stream behind.
_STREAMS: weakref.WeakKeyDictionary[Any, _Stream] = weakref.WeakKeyDictionary()


def log_to_wandb(watcher: W, run: Any = None, *, every_tensor: bool = False,
                 alerts: bool = True) -> W:
    """Stream a Watcher's recorded steps and findings into a Weights & Biases run.

    Call it before or inside the Watcher's ``with`` block (or after ``start()``), once per
    run: the stream ends with the block.

    Args:
        watcher: The Watcher (``graddebug.watch(model)``).
        run: The W&B run to log into; None for the active one (``wandb.run``, made by
            ``wandb.init``).
        every_tensor: Log ``graddebug/norm/<layer>.<tensor>`` for every recorded tensor too,
            not only the compact set.
        alerts: Raise a ``run.alert`` for each new warning or error (one per issue and layer).

    Returns:
        The Watcher, so that ``with log_to_wandb(graddebug.watch(model)) as dbg:`` works.

    Raises:
        MissingFrameworkError: wandb is not installed.
        ConfigError: ``watcher`` is not a Watcher, no W&B run is active and none was given,
            or ``every_tensor``/``alerts`` is not a bool.
    """
    module = _wandb()
    if not isinstance(watcher, CallbackContext):
        raise ConfigError(
            f"log_to_wandb({watcher!r}) needs the Watcher, not the model: "
            "log_to_wandb(graddebug.watch(model))."
        )
    for name, value in (("every_tensor", every_tensor), ("alerts", alerts)):
        if not isinstance(value, bool):
            raise ConfigError(f"log_to_wandb({name}={value!r}): pass True or False.")
    run = module.run if run is None else run
    if run is None:
        raise ConfigError(
            "log_to_wandb() found no active W&B run: call wandb.init(project=...) before it, "
            "or pass the run: log_to_wandb(dbg, run=run)."
        )
    run.define_metric(STEP_KEY)
    run.define_metric(f"{PREFIX}/*", step_metric=STEP_KEY)
    _STREAMS[watcher] = _Stream(run, every_tensor=every_tensor, alerts=alerts)
    return watcher


@hookimpl
def graddebug_step_recorded(watcher: CallbackContext, step: int, result: StepResult) -> None:
    """Log a recorded step into the run of :func:`log_to_wandb`; nothing when not asked for."""
    stream = _STREAMS.get(watcher)
    if stream is not None:
        stream.log_step(step, result.records, result.findings)


@hookimpl
def graddebug_run_finished(watcher: CallbackContext) -> None:
    """Alert the findings no step brought, and log every finding as a ``wandb.Table``."""
    stream = _STREAMS.pop(watcher, None)
    if stream is None:
        return
    findings = watcher.findings()
    if findings.empty:
        return
    stream.alert(findings)
    table = _wandb().Table(dataframe=findings.reset_index(drop=True))
    stream.run.log({TABLE_KEY: table}, commit=False)
