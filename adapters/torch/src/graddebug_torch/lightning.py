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
clipped by ``gradient_clip_val``. Under ``precision="16-mixed"`` the callback follows the
precision plugin's GradScaler as ``watch(scaler=...)`` does: the statistics of gradients at
layer outputs, captured during ``backward``, are divided by the loss scale, and a step the
scaler skips is marked with a ``skipped_step`` event.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from graddebug.errors import MissingFrameworkError

try:
    import lightning.pytorch as pl
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise MissingFrameworkError(
        "graddebug_torch.lightning needs Lightning: pip install 'graddebug-torch[lightning]' "
        "(or pip install lightning)."
    ) from _exc

from graddebug.integrations.session import CallbackSession, SessionResults
from graddebug_torch.scaling import is_grad_scaler

if TYPE_CHECKING:

    pass

__all__ = ["GradDebugCallback"]


class GradDebugCallback(SessionResults, pl.Callback):
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
        self._session = CallbackSession(
            "GradDebugCallback", "pass it to Trainer(callbacks=[...]) and call trainer.fit() "
            "first.", stop_on=stop_on, log=log, watch_options=watch_options)

    # -- Lightning hooks ----------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start watching ``pl_module`` (unless bound to a Watcher already), with the
        precision plugin's GradScaler under AMP."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._session.start(pl_module, scaler=scaler if is_grad_scaler(scaler) else None)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Close the graddebug step; log the norms and check ``stop_on`` if it was recorded."""
        # Under AMP the scaler has just unscaled the gradients in place; the close reads them
        # as they are now.
        closed = self._session.close()
        if closed.metrics and trainer.loggers:
            for logger in trainer.loggers:
                logger.log_metrics(closed.metrics, step=trainer.global_step)
        if closed.stop:
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """Record the loss that ``training_step`` returned, for the step just closed."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._session.record_loss(loss)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Stop watching: remove every hook."""
        self._session.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Stop watching when ``fit`` fails; the frames recorded so far stay readable."""
        self._session.finish(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stop watching, if nothing else did (an interrupted ``fit``)."""
        self._session.finish()
