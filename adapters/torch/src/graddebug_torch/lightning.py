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
clipped by ``gradient_clip_val``. So ``norm`` is the gradient before the clip, which the
diagnoses judge, and with ``gradient_clip_algorithm="norm"`` (the default) ``clipped_norm`` is
the gradient after it, what the optimizer applies (clipping by value leaves it NaN). Under
``precision="16-mixed"`` the callback follows the precision plugin's GradScaler as
``watch(scaler=...)`` does: the statistics of gradients at layer outputs, captured during
``backward``, are divided by the loss scale, and a step the scaler skips is marked with a
``skipped_step`` event.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from graddebug.errors import MissingFrameworkError

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import rank_zero_only
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise MissingFrameworkError(
        "graddebug_torch.lightning needs Lightning: pip install 'graddebug-torch[lightning]' "
        "(or pip install lightning)."
    ) from _exc

from graddebug.integrations.clipping import HostClip
from graddebug.integrations.session import CallbackSession, SessionResults
from graddebug_torch.scaling import is_grad_scaler

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["GradDebugCallback"]

_TORCH_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by total + 1e-6
_notice: Callable[[str], None] = rank_zero_only(
    logging.getLogger("lightning.pytorch.callbacks.graddebug").warning)
"""The notice of new findings goes through Lightning's logging, on rank zero only."""


class GradDebugCallback(SessionResults, pl.Callback):
    """Watch ``pl_module`` from ``on_fit_start`` to the end of ``fit``, crash included.

    Each optimizer step closes a graddebug step (in ``on_before_optimizer_step``). When
    Lightning logs (every ``log_every_n_steps`` optimizer steps, at the step its own metrics
    get), the callback sends the metrics of the steps since its last log to the Trainer's
    loggers (:mod:`graddebug.integrations.metrics`: the total and per-layer gradient norms
    before the clip, the update/weight ratios, the count of new findings, each with its
    maximum over the interval as ``.../max``); nothing goes to the progress bar. A step that
    brings a new finding logs one line through Lightning's logger, on rank zero.

    Args:
        stop_on: Issues that stop training (``trainer.should_stop = True``) at the first step
            that shows them: ``("nonfinite",)``. The reason, naming the layer where the NaN/Inf
            was born, goes on the notice line and is kept in :attr:`stop_reason`.
        log: Send the metrics to the Trainer's loggers.
        every_tensor: Send the norm of every recorded tensor too
            (``graddebug/norm/<layer>.<tensor>``).
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
                 every_tensor: bool = False, **watch_options: Any) -> None:
        super().__init__()
        self._session = CallbackSession(
            "GradDebugCallback", "pass it to Trainer(callbacks=[...]) and call trainer.fit() "
            "first.", stop_on=stop_on, log=log, every_tensor=every_tensor, notify=_notice,
            watch_options=watch_options)
        self._stepped = False  # an optimizer step closed a graddebug step in this batch

    # -- Lightning hooks ----------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start watching ``pl_module`` (unless bound to a Watcher already), with the
        precision plugin's GradScaler under AMP."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        clip = None
        value = trainer.gradient_clip_val
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value",
                                trainer.gradient_clip_algorithm) or "norm")
        if value and float(value) > 0 and algorithm == "norm":
            clip = HostClip(float(value), "total", _TORCH_EPS)
        self._stepped = False
        self._session.start(pl_module, scaler=scaler if is_grad_scaler(scaler) else None,
                            clip=clip)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Close the graddebug step (before Lightning clips); check ``stop_on``."""
        # Under AMP the scaler has just unscaled the gradients in place; the close reads them
        # as they are now.
        closed = self._session.close()
        self._stepped = self._stepped or closed.recorded
        if closed.stop:
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """Record the loss that ``training_step`` returned, for the step just closed; log the
        metrics when Lightning logs its own."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._session.record_loss(loss)
        every = getattr(trainer, "log_every_n_steps", 0)
        if not (self._stepped and every and trainer.loggers):
            return
        # Lightning logs its own metrics after the batch whose optimizer step makes the count
        # of steps a multiple of log_every_n_steps, at the step index before that count.
        done = trainer.global_step
        if done % every and not trainer.should_stop:
            return
        step = done - 1
        self._stepped = False
        metrics = self._session.take_metrics()
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

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
