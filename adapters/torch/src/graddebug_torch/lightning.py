"""A Lightning callback: watch the LightningModule during ``Trainer.fit``.

Nothing imports this module unless the user does, so Lightning is needed only by those who use
it::

    from graddebug_torch.lightning import GradDebugCallback

    callback = GradDebugCallback(stop_on=("nonfinite",))
    lightning.Trainer(callbacks=[callback]).fit(module, loader)
    callback.findings()

Inside ``with graddebug.watch(module) as dbg:``, ``dbg.callback()`` returns the same callback
bound to that Watcher instead of one that makes its own.

A graddebug step closes in ``on_before_optimizer_step``: the gradients are complete there (all
micro-batches of ``accumulate_grad_batches`` included), already unscaled under AMP, and not yet
clipped by ``gradient_clip_val``. Gradients at layer outputs are captured during ``backward``,
so under a loss scaler they carry the scale.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from graddebug.errors import ConfigError, MissingFrameworkError, WatcherStateError, close_matches

try:
    import lightning.pytorch as pl
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise MissingFrameworkError(
        "graddebug_torch.lightning needs Lightning: pip install 'graddebug-torch[lightning]' "
        "(or pip install lightning)."
    ) from _exc

from graddebug.adapter import StepResult, WatchContext
from graddebug.records import EventKind, Issue, Record
from graddebug.session import Watcher

if TYPE_CHECKING:
    import pandas as pd

    from graddebug.report import Report
    from graddebug_torch.adapter import TorchAdapter

__all__ = ["STOP_ON", "GradDebugCallback"]

log = logging.getLogger(__name__)

STOP_ON: tuple[str, ...] = (Issue.NONFINITE.value,)
"""Issues that ``stop_on=`` accepts: those a single step shows. Issues judged over many steps
(vanishing, exploding, dead) are read from :meth:`GradDebugCallback.findings` after ``fit``."""


class GradDebugCallback(pl.Callback):
    """Watch ``pl_module`` from ``on_fit_start`` to the end of ``fit``, crash included.

    Each optimizer step closes a graddebug step (in ``on_before_optimizer_step``). On recorded
    steps, the gradient norm of every watched tensor goes to the Trainer's loggers as
    ``graddebug/<layer>.<tensor>/norm`` (``graddebug/fc1.weight/norm``,
    ``graddebug/fc1.output/norm``) at ``trainer.global_step``; ``every=`` thins both.

    Args:
        stop_on: Issues that stop training (``trainer.should_stop = True``) at the first step
            that shows them: ``("nonfinite",)``. The reason, naming the layer where the NaN/Inf
            was born, is logged as a warning and kept in :attr:`stop_reason`.
        log: Send the norms to the Trainer's loggers.
        **watch_options: Options of :func:`graddebug.watch` (``layers=``, ``every=``,
            ``outputs=``, ``thresholds=``, ...), except ``optimizer=``.

    Attributes:
        watcher: The Watcher of the latest ``fit`` (None before one starts); it keeps its
            frames after ``fit`` ends.
        stop_reason: Why this callback stopped training, or None.

    Raises:
        ConfigError: An unknown ``stop_on`` issue or watch option, or an unusable value.
    """

    def __init__(self, *, stop_on: Iterable[str] | str = (), log: bool = True,
                 **watch_options: Any) -> None:
        super().__init__()
        self._stop_on = _parse_stop_on(stop_on)
        self._log = log
        if "optimizer" in watch_options:
            raise ConfigError(
                "GradDebugCallback closes a step at each optimizer step by itself; "
                "leave out optimizer=."
            )
        self._options = watch_options
        _check_watch_options(watch_options)
        self.watcher: Watcher | None = None
        self.stop_reason: str | None = None
        self._adapter: TorchAdapter | None = None
        self._owned = True

    @classmethod
    def bound(cls, context: WatchContext, adapter: TorchAdapter, *,
              stop_on: Iterable[str] | str = (), log: bool = True) -> GradDebugCallback:
        """Return a callback that serves an active Watcher instead of making its own.

        This is what ``dbg.callback()`` returns for a torch model: the ``with`` block keeps
        owning the Watcher, and the callback closes its steps, logs and stops.

        Args:
            context: The Watcher.
            adapter: The Watcher's torch adapter.
            stop_on: As for the constructor.
            log: As for the constructor.

        Raises:
            WatcherStateError: ``context`` is not an active Watcher.
        """
        if not isinstance(context, Watcher) or not context.active:
            raise WatcherStateError("a bound GradDebugCallback needs an active Watcher.")
        callback = cls(stop_on=stop_on, log=log)
        callback.watcher, callback._adapter, callback._owned = context, adapter, False
        return callback

    # -- Lightning hooks ----------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start watching ``pl_module`` (unless bound to a Watcher already)."""
        self.stop_reason = None
        if not self._owned:
            return
        watcher = Watcher(pl_module, **self._options)
        watcher.__enter__()
        try:
            # The torch adapter binds a callback to the Watcher: borrow its adapter.
            self._adapter = watcher.callback()._adapter
        except BaseException:
            watcher.__exit__(None, None, None)
            raise
        self.watcher = watcher

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Close the graddebug step; log the norms and check ``stop_on`` if it was recorded."""
        watcher = self.watcher
        if watcher is None or not watcher.active:
            return
        recorded = watcher.recording
        step = watcher.step_index
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if self._adapter is not None and scaler is not None:
            self._adapter.grads_changed_in_place()  # the scaler has just unscaled them
        watcher.step()
        if not recorded or self._adapter is None:
            return
        result = self._adapter.last_result
        if self._log and trainer.loggers:
            metrics = {f"graddebug/{r.layer}.{r.tensor}/norm": r.norm for r in result.records}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self._stop_on and self.stop_reason is None and _nonfinite(result):
            self._stop(trainer, watcher, step, result)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Stop watching: remove every hook."""
        self._finish(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Stop watching when ``fit`` fails; the frames recorded so far stay readable."""
        self._finish(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stop watching, if nothing else did (an interrupted ``fit``)."""
        self._finish(None)

    # -- results ----------------------------------------------------------------------------

    def _require(self) -> Watcher:
        if self.watcher is None:
            raise WatcherStateError(
                "GradDebugCallback has no Watcher yet: pass it to Trainer(callbacks=[...]) "
                "and call trainer.fit() first."
            )
        return self.watcher

    def frame(self) -> pd.DataFrame:
        """Return the Watcher's record frame (one row per step and tensor)."""
        return self._require().frame()

    def findings(self) -> pd.DataFrame:
        """Return the Watcher's findings."""
        return self._require().findings()

    def report(self) -> Report:
        """Return the run as a :class:`graddebug.Report`."""
        return self._require().report()

    # -- internals ------------------------------------------------------------------------------

    def _stop(self, trainer: pl.Trainer, watcher: Watcher, step: int,
              result: StepResult) -> None:
        findings = watcher.findings()
        here = findings[(findings["issue"] == Issue.NONFINITE.value) & (findings["step"] == step)]
        if not here.empty:
            reason = str(here["message"].iloc[0])
        else:  # the detector saw nothing more precise than the non-finite rows themselves
            first = min((r for r in result.records if _bad(r)), key=lambda r: -r.depth,
                        default=None)
            where = f"{first.layer}.{first.tensor}" if first is not None else "a forward output"
            reason = f"non-finite gradient at {where!r}."
        self.stop_reason = f"graddebug stopped training at step {step}: {reason}"
        log.warning(self.stop_reason)
        trainer.should_stop = True

    def _finish(self, exception: BaseException | None) -> None:
        watcher = self.watcher
        if not self._owned or watcher is None or not watcher.active:
            return
        exc_info: tuple[type[BaseException] | None, BaseException | None,
                        TracebackType | None] = (None, None, None)
        if exception is not None:
            exc_info = (type(exception), exception, exception.__traceback__)
        watcher.__exit__(*exc_info)


def _bad(record: Record) -> bool:
    return bool(record.nan or record.inf) or not math.isfinite(record.norm)


def _nonfinite(result: StepResult) -> bool:
    return any(_bad(r) for r in result.records) or any(
        e.event == EventKind.FORWARD_NONFINITE.value for e in result.events
    )


def _parse_stop_on(stop_on: Iterable[str] | str) -> frozenset[str]:
    issues = [stop_on] if isinstance(stop_on, str) else list(stop_on)
    for issue in issues:
        if issue not in STOP_ON:
            raise ConfigError(
                f"stop_on={issue!r} is not supported.{close_matches(str(issue), STOP_ON)} "
                f"GradDebugCallback stops on: {', '.join(STOP_ON)}; issues judged over many "
                "steps are in callback.findings() after fit."
            )
    return frozenset(issues)


def _check_watch_options(options: dict[str, Any]) -> None:
    """Check option names now rather than at ``on_fit_start``, inside the Trainer."""
    known = [n for n in inspect.signature(Watcher).parameters if n not in ("model", "optimizer")]
    for name in options:
        if name not in known:
            raise ConfigError(
                f"GradDebugCallback got an unknown option {name!r}.{close_matches(name, known)} "
                f"Options: stop_on, log, {', '.join(known)}."
            )
