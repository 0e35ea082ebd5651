"""A Hugging Face ``transformers.Trainer`` callback: watch the model during ``Trainer.train``.

Nothing imports this module unless the user does, so transformers is needed only by those who
use it::

    from graddebug_torch.transformers import GradDebugCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = GradDebugCallback.attach(trainer, stop_on=("nonfinite",))
    trainer.train()
    callback.findings()

With :meth:`GradDebugCallback.attach`, a graddebug step closes right after the last
``training_step`` of each optimizer step: the gradients of every micro-batch of
``gradient_accumulation_steps`` are in, and the Trainer has not clipped them yet (it clips by
``max_grad_norm`` before ``on_pre_optimizer_step``, and offers no event in between). So ``norm``
is the gradient before the clip, whose total is the Trainer's own ``grad_norm`` log, and the
diagnoses see an explosion that the clip hides; ``clipped_norm`` is the gradient the optimizer
applied. Under fp16 AMP the accelerator's GradScaler is watched (``watch(scaler=...)``), so
the statistics are unscaled. A callback given as ``Trainer(callbacks=[...])`` cannot reach the
Trainer: it closes the step in ``on_pre_optimizer_step``, after the clip, and ``norm`` is the
clipped gradient there.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from graddebug.errors import MissingFrameworkError

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise MissingFrameworkError(
        "graddebug_torch.transformers needs transformers: "
        "pip install 'graddebug-torch[transformers]' (or pip install transformers)."
    ) from _exc

from graddebug.integrations.clipping import HostClip
from graddebug.integrations.session import CallbackSession, SessionResults

if TYPE_CHECKING:
    from transformers import Trainer


__all__ = ["GradDebugCallback"]

_notices = hf_logging.get_logger("transformers.integrations.graddebug")
"""The notice of new findings goes through transformers' logging (its handler, its verbosity)."""
_CONSOLE = (ProgressCallback, PrinterCallback)  # they print every log entry they are given
_TORCH_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by total + 1e-6


class GradDebugCallback(SessionResults, TrainerCallback):
    """Watch the Trainer's model from ``on_train_begin`` to ``on_train_end``.

    Each optimizer step closes a graddebug step. When the Trainer logs (every
    ``logging_steps``), the callback logs the metrics of the steps since its last log
    (:mod:`graddebug.integrations.metrics`: the total and per-layer gradient norms before the
    clip, the update/weight ratios, the count of new findings; each with its maximum over the
    interval as ``.../max``) at the Trainer's ``global_step``. They go to ``state.log_history``
    as an entry of their own and, with :meth:`attach`, to every ``report_to`` integration
    (TensorBoard, wandb, MLflow), but not to the progress bar or the console. A step that
    brings a new finding logs one line through transformers' logging.

    Args:
        stop_on: Issues that stop training (``control.should_training_stop = True``) at the
            first step that shows them: ``("nonfinite",)``. The reason, naming the layer where
            the NaN/Inf was born, goes on the notice line and is kept in :attr:`stop_reason`.
        log: Log the metrics.
        every_tensor: Log the norm of every recorded tensor too
            (``graddebug/norm/<layer>.<tensor>``).
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
                 every_tensor: bool = False, **watch_options: Any) -> None:
        super().__init__()
        self._session = CallbackSession(
            "GradDebugCallback", "pass it to Trainer(callbacks=[...]) or "
            "GradDebugCallback.attach(trainer), and call trainer.train() first.",
            stop_on=stop_on, log=log, every_tensor=every_tensor, notify=_notices.warning,
            watch_options=watch_options)
        self._trainer: Trainer | None = None
        self._loss: Any = None  # the open step's loss so far, where attach() follows it
        self._closed = False  # the optimizer step's graddebug step closed before the clip
        self._logging = False  # inside our own log entry's on_log

    @classmethod
    def attach(cls, trainer: Trainer, *, stop_on: Iterable[str] | str = (), log: bool = True,
               every_tensor: bool = False, **watch_options: Any) -> GradDebugCallback:
        """Add a callback to ``trainer`` that closes each step before the Trainer clips and
        logs to its ``report_to`` integrations too.

        Args:
            trainer: The Trainer.
            stop_on: As for the constructor.
            log: As for the constructor.
            every_tensor: As for the constructor.
            **watch_options: As for the constructor.

        Returns:
            The callback, to read its findings after ``trainer.train()``.
        """
        callback = cls(stop_on=stop_on, log=log, every_tensor=every_tensor, **watch_options)
        callback._trainer = trainer
        callback._follow_steps(trainer)
        trainer.add_callback(callback)
        return callback

    def _follow_steps(self, trainer: Trainer) -> None:
        """Wrap ``trainer.training_step``: sum what it returns over the micro-batches of each
        optimizer step (the Trainer's own logged loss is that sum, averaged over the logged
        steps), and close the graddebug step after the last micro-batch, before the clip."""
        original = trainer.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            self._loss = loss if self._loss is None else self._loss + loss
            if getattr(trainer.accelerator, "sync_gradients", True):
                self._close(trainer.control)
                self._closed = True
            return loss

        trainer.training_step = training_step  # type: ignore[method-assign]

    def _close(self, control: TrainerControl) -> None:
        loss, self._loss = self._loss, None
        if self._session.close(loss).stop:
            control.should_training_stop = True

    # -- Trainer events -------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: Any = None, **kwargs: Any) -> None:
        """Start watching ``model`` (unless bound to a Watcher already): with :meth:`attach`,
        with the accelerator's GradScaler under fp16 and the Trainer's ``max_grad_norm``."""
        self._closed = False
        trainer = self._trainer
        clip = None
        scaler = None
        if trainer is not None:
            scaler = getattr(trainer.accelerator, "scaler", None)
            if args.max_grad_norm and args.max_grad_norm > 0:
                clip = HostClip(float(args.max_grad_norm), "total", _TORCH_EPS)
        self._session.start(model, scaler=scaler, clip=clip)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:
        """Close the graddebug step, unless it closed before the clip (:meth:`attach`)."""
        if self._closed:
            self._closed = False
            return
        # Given as Trainer(callbacks=[...]): the Trainer has unscaled (AMP) and clipped the
        # gradients in place by now; the close reads them as they are, what the optimizer
        # applies.
        self._close(control)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        """When the Trainer logs its training loss, log the metrics of the steps since the
        last log: into ``state.log_history`` and, with :meth:`attach`, to every other
        callback but the console's (the progress bar and the printer)."""
        if self._logging or not logs or "loss" not in logs:
            return
        metrics = self._session.take_metrics()
        if not metrics:
            return
        state.log_history.append({**metrics, "step": state.global_step})
        trainer = self._trainer
        if trainer is None:
            return
        self._logging = True
        try:
            for callback in trainer.callback_handler.callbacks:
                if callback is not self and not isinstance(callback, _CONSOLE):
                    callback.on_log(args, state, control, logs=dict(metrics), **kwargs)
        finally:
            self._logging = False

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Stop watching: remove every hook."""
        self._session.finish()
