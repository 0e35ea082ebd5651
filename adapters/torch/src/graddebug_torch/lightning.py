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

import logging
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import graddebug
from graddebug.errors import ConfigError, MissingFrameworkError, WatcherStateError

try:
    import lightning.pytorch as pl
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise MissingFrameworkError(
        "graddebug_torch.lightning needs Lightning: pip install 'graddebug-torch[lightning]' "
        "(or pip install lightning)."
    ) from _exc

from graddebug.adapter import StepResult, WatchContext
from graddebug.integrations.stopping import (
    check_watch_options,
    nonfinite,
    parse_stop_on,
    stop_reason,
)

if TYPE_CHECKING:
    import pandas as pd

    from graddebug.report.report import Report

__all__ = ["GradDebugCallback"]

log = logging.getLogger(__name__)

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
        self._stop_on = parse_stop_on(stop_on, "GradDebugCallback")
        self._log = log
        if "optimizer" in watch_options:
            raise ConfigError(
                "GradDebugCallback closes a step at each optimizer step by itself; "
                "leave out optimizer=."
            )
        self._options = watch_options
        check_watch_options(watch_options, "GradDebugCallback", ("stop_on", "log"))
        self.watcher: WatchContext | None = None
        self.stop_reason: str | None = None
        self._owned = True
        self._own: graddebug.Watcher | None = None  # the Watcher this callback entered

    @classmethod
    def bound(cls, context: WatchContext, *, stop_on: Iterable[str] | str = (),
              log: bool = True) -> GradDebugCallback:
        """Return a callback that serves an active Watcher instead of making its own.

        This is what ``dbg.callback()`` returns for a torch model: the ``with`` block keeps
        owning the Watcher, and the callback closes its steps, logs and stops.

        Args:
            context: The Watcher.
            stop_on: As for the constructor.
            log: As for the constructor.

        Raises:
            WatcherStateError: ``context`` is not active.
        """
        if not context.active:
            raise WatcherStateError("a bound GradDebugCallback needs an active Watcher.")
        callback = cls(stop_on=stop_on, log=log)
        callback.watcher, callback._owned = context, False
        return callback

    # -- Lightning hooks ----------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start watching ``pl_module`` (unless bound to a Watcher already)."""
        self.stop_reason = None
        if not self._owned:
            return
        watcher = graddebug.Watcher(pl_module, **self._options)
        watcher.__enter__()
        self.watcher = self._own = watcher

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Close the graddebug step; log the norms and check ``stop_on`` if it was recorded."""
        watcher = self.watcher
        if watcher is None or not watcher.active:
            return
        step = watcher.step_index
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if watcher.adapter is not None and scaler is not None:
            watcher.adapter.grads_changed_in_place()  # the scaler has just unscaled them
        result = watcher.step()
        if result is None:
            return
        if self._log and trainer.loggers:
            metrics = {f"graddebug/{r.layer}.{r.tensor}/norm": r.norm for r in result.records}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self._stop_on and self.stop_reason is None and nonfinite(result):
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

    def _require(self) -> WatchContext:
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

    def _stop(self, trainer: pl.Trainer, watcher: WatchContext, step: int,
              result: StepResult) -> None:
        self.stop_reason = stop_reason(watcher.findings(), step, result)
        log.warning(self.stop_reason)
        trainer.should_stop = True

    def _finish(self, exception: BaseException | None) -> None:
        watcher, self._own = self._own, None
        if watcher is None or not watcher.active:
            return
        exc_info: tuple[type[BaseException] | None, BaseException | None,
                        TracebackType | None] = (None, None, None)
        if exception is not None:
            exc_info = (type(exception), exception, exception.__traceback__)
        watcher.__exit__(*exc_info)
