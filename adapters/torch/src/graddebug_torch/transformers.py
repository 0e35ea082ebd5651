"""A Hugging Face ``transformers.Trainer`` callback: watch the model during ``Trainer.train``.

Nothing imports this module unless the user does, so transformers is needed only by those who
use it::

    from graddebug_torch.transformers import GradDebugCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = GradDebugCallback.attach(trainer, stop_on=("nonfinite",))
    trainer.train()
    callback.findings()

A graddebug step closes in ``on_pre_optimizer_step``, once per optimizer step: the gradients
there are pooled over all micro-batches of ``gradient_accumulation_steps``, already unscaled
under fp16 AMP, and already clipped by ``max_grad_norm`` (the Trainer clips before this event,
and offers none earlier; it logs the total norm before clipping as ``grad_norm``). They are
what the optimizer applies; ``max_grad_norm=0`` shows them unclipped. Gradients at layer outputs
are captured during ``backward``, so under a loss scaler they carry the scale.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from graddebug.errors import MissingFrameworkError

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise MissingFrameworkError(
        "graddebug_torch.transformers needs transformers: "
        "pip install 'graddebug-torch[transformers]' (or pip install transformers)."
    ) from _exc

from graddebug.integrations.session import CallbackSession, SessionResults

if TYPE_CHECKING:
    from transformers import Trainer


__all__ = ["GradDebugCallback"]


class GradDebugCallback(SessionResults, TrainerCallback):
    """Watch the Trainer's model from ``on_train_begin`` to ``on_train_end``.

    Each optimizer step closes a graddebug step. On recorded steps, the gradient norm of every
    watched tensor is logged as ``graddebug/<layer>.<tensor>/norm`` (``graddebug/lm_head.weight
    /norm``, ``graddebug/transformer.h.0.mlp.output/norm``) at the Trainer's ``global_step``,
    next to its own ``loss`` entries; ``every=`` thins both. With :meth:`attach`, they go
    through ``trainer.log``, so they reach ``state.log_history`` and every ``report_to``
    integration (TensorBoard, wandb, MLflow); a callback given as ``Trainer(callbacks=[...])``
    cannot reach the Trainer and appends them to ``state.log_history`` only.

    Args:
        stop_on: Issues that stop training (``control.should_training_stop = True``) at the
            first step that shows them: ``("nonfinite",)``. The reason, naming the layer where
            the NaN/Inf was born, is logged as a warning and kept in :attr:`stop_reason`.
        log: Log the norms.
        **watch_options: Options of :func:`graddebug.watch` (``layers=``, ``every=``,
            ``outputs=``, ``thresholds=``, ``tensorboard=``, ...), except ``optimizer=``.

    Attributes:
        watcher: The Watcher of the latest ``train`` (None before one starts); it keeps its
            frames after training ends.
        stop_reason: Why this callback stopped training, or None.

    Raises:
        ConfigError: An unknown ``stop_on`` issue or watch option, or an unusable value.
    """

    def __init__(self, *, stop_on: Iterable[str] | str = (), log: bool = True,
                 **watch_options: Any) -> None:
        super().__init__()
        self._session = CallbackSession(
            "GradDebugCallback", "pass it to Trainer(callbacks=[...]) or "
            "GradDebugCallback.attach(trainer), and call trainer.train() first.",
            stop_on=stop_on, log=log, watch_options=watch_options)
        self._trainer: Trainer | None = None
        self._pending: dict[str, float] = {}  # norms of the step, logged at its step end
        self._loss: Any = None  # the open step's loss so far, where attach() follows it

    @classmethod
    def attach(cls, trainer: Trainer, *, stop_on: Iterable[str] | str = (), log: bool = True,
               **watch_options: Any) -> GradDebugCallback:
        """Add a callback to ``trainer`` that logs through ``trainer.log``.

        Args:
            trainer: The Trainer.
            stop_on, log, **watch_options: As for the constructor.

        Returns:
            The callback, to read its findings after ``trainer.train()``.
        """
        callback = cls(stop_on=stop_on, log=log, **watch_options)
        callback._trainer = trainer
        callback._follow_loss(trainer)
        trainer.add_callback(callback)
        return callback

    def _follow_loss(self, trainer: Trainer) -> None:
        """Sum what ``trainer.training_step`` returns over the micro-batches of each optimizer
        step: the Trainer's own logged loss is that sum, averaged over the logged steps."""
        original = trainer.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            self._loss = loss if self._loss is None else self._loss + loss
            return loss

        trainer.training_step = training_step  # type: ignore[method-assign]

    # -- Trainer events -------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: Any = None, **kwargs: Any) -> None:
        """Start watching ``model`` (unless bound to a Watcher already)."""
        self._pending = {}
        self._session.start(model)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        """Close the graddebug step; keep its norms for logging and check ``stop_on``."""
        # Since backward, the Trainer may have unscaled (AMP) and clipped the gradients in
        # place; the close reads them as they are now, what the optimizer applies.
        loss, self._loss = self._loss, None
        closed = self._session.close(loss)
        if closed.metrics:
            self._pending = closed.metrics
        if closed.stop:
            control.should_training_stop = True

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """Log the norms of the step that just ended, at the Trainer's ``global_step``."""
        metrics, self._pending = self._pending, {}
        if not metrics:
            return
        if self._trainer is not None:
            # trainer.log clears should_log, which the Trainer set for its own loss entry.
            should_log = control.should_log
            self._trainer.log(metrics)
            control.should_log = should_log
        else:
            state.log_history.append({**metrics, "step": state.global_step})

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Stop watching: remove every hook."""
        self._session.finish()
