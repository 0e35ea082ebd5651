"""A Keras callback that records a graddebug step per batch of ``model.fit``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import keras

from graddebug.integrations.stopping import nonfinite, parse_stop_on, stop_reason

if TYPE_CHECKING:
    from graddebug.adapter import CallbackContext

__all__ = ["GradDebugCallback"]

logger = logging.getLogger("graddebug")


class GradDebugCallback(keras.callbacks.Callback):
    """Closes a graddebug step after every training batch; optionally stops training.

    Get it from the Watcher: ``model.fit(..., callbacks=[dbg.callback()])``. It takes the
    parameter gradients from the model's optimizer, so ``model.fit`` needs no other change.

    Args:
        context: The Watcher.
        take_gradients: Takes the parameter gradients from an optimizer
            (:meth:`graddebug.adapter.GradientSource.take_gradients` of the adapter).
        stop_on: Issues that stop training (``model.stop_training = True``) at the batch where
            they first appear; ``("nonfinite",)`` is TerminateOnNaN that names the layer.
        take_loss: Records the loss that the model's ``compute_loss`` returns in training
            (:meth:`~graddebug_tensorflow.adapter.TensorFlowAdapter.take_loss`), or None.
        step_loss: The loss so recorded in the step closed last, or None.

    Attributes:
        stop_reason: Why training was stopped, naming the layer; None while it was not.
    """

    def __init__(self, context: CallbackContext, take_gradients: Callable[[Any], None],
                 stop_on: Iterable[str] = (), *,
                 take_loss: Callable[[Any], None] | None = None,
                 step_loss: Callable[[], float | None] | None = None) -> None:
        super().__init__()
        self._context = context
        self._take_gradients = take_gradients
        self._take_loss = take_loss
        self._step_loss = step_loss
        self.stop_on = parse_stop_on(stop_on, "dbg.callback()")
        self.stop_reason: str | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Take parameter gradients from the optimizer that ``fit`` uses, and the loss from
        the model's ``compute_loss``."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            self._take_gradients(optimizer)
        if self._take_loss is not None:
            self._take_loss(self.model)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Close the batch's step, with its loss; stop training on a finding named in
        ``stop_on``.

        The loss is the one the batch's gradients were computed from, recorded inside the
        compiled step and read with the step's statistics: ``logs["loss"]`` is the mean over
        the epoch so far (weighted by batch size), which cannot give a batch's loss exactly.
        It is recorded just after the close (``record_loss``), the close being the read.
        """
        step = self._context.step_index
        result = self._context.step()
        loss = self._step_loss() if self._step_loss is not None else None
        if loss is not None:
            self._context.record_loss(loss)
        if (self.stop_on and self.stop_reason is None and result is not None
                and nonfinite(result)):
            self.stop_reason = stop_reason(self._context.findings(), step, result)
            logger.warning(self.stop_reason)
            self.model.stop_training = True
