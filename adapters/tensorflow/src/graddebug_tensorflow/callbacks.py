"""A Keras callback that records a graddebug step per batch of ``model.fit``.

Keras hands the callback the gradients the optimizer is about to apply, before the optimizer
clips them (``clipnorm``, ``global_clipnorm`` act inside ``optimizer.apply``): ``norm`` is the
gradient before the clip, which the diagnoses judge, and ``clipped_norm`` the gradient after
it, worked out from the optimizer's settings (:mod:`graddebug.integrations.clipping`;
``clipvalue`` leaves it NaN).

Keras logs through the ``logs`` of its callback events, and keeps those of each epoch
(``History``, ``CSVLogger``, the ``TensorBoard`` callback): at each epoch's end the callback
adds the metrics of the epoch's steps to them (:mod:`graddebug.integrations.metrics`). Keras
has no logger of its own (its progress bar prints, and cannot be silenced by a level), so the
notice of a new finding goes through Python's ``logging``, to the ``graddebug`` logger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import keras

from graddebug.integrations.clipping import HostClip
from graddebug.integrations.session import CallbackSession

if TYPE_CHECKING:
    from graddebug.adapter import CallbackContext

__all__ = ["GradDebugCallback", "keras_clip"]


def keras_clip(optimizer: Any) -> HostClip | None:
    """How a Keras optimizer clips the gradients it applies (a ``LossScaleOptimizer``'s inner
    optimizer clips), or None where it does not clip by norm."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        optimizer = inner
    clipnorm = getattr(optimizer, "clipnorm", None)
    if clipnorm and clipnorm > 0:
        return HostClip(float(clipnorm), "each")
    global_clipnorm = getattr(optimizer, "global_clipnorm", None)
    if global_clipnorm and global_clipnorm > 0:
        return HostClip(float(global_clipnorm), "total")
    return None


class GradDebugCallback(keras.callbacks.Callback):
    """Closes a graddebug step after every training batch; logs each epoch's metrics;
    optionally stops training.

    Get it from the Watcher: ``model.fit(..., callbacks=[dbg.callback()])``. It takes the
    parameter gradients from the model's optimizer, so ``model.fit`` needs no other change.

    Args:
        context: The Watcher.
        take_gradients: Takes the parameter gradients from an optimizer
            (:meth:`graddebug.adapter.GradientSource.take_gradients` of the adapter).
        stop_on: Issues that stop training (``model.stop_training = True``) at the batch where
            they first appear; ``("nonfinite",)`` is TerminateOnNaN that names the layer.
        log: Add the metrics of each epoch's steps to the epoch's ``logs``.
        every_tensor: Add the norm of every recorded tensor too
            (``graddebug/norm/<layer>.<tensor>``).
        take_loss: Records the loss that the model's ``compute_loss`` returns in training
            (:meth:`~graddebug_tensorflow.adapter.TensorFlowAdapter.take_loss`), or None.
        step_loss: The loss so recorded in the step closed last, or None.

    Attributes:
        stop_reason: Why training was stopped, naming the layer; None while it was not.

    Raises:
        ConfigError: An unknown ``stop_on`` issue, or a ``log``/``every_tensor`` that is not a
            bool.
        WatcherStateError: ``context`` is not an active Watcher.
    """

    def __init__(self, context: CallbackContext, take_gradients: Callable[[Any], None],
                 stop_on: Iterable[str] = (), *, log: bool = True, every_tensor: bool = False,
                 take_loss: Callable[[Any], None] | None = None,
                 step_loss: Callable[[], float | None] | None = None) -> None:
        super().__init__()
        self._session = CallbackSession(
            "dbg.callback()", "get it inside `with graddebug.watch(model) as dbg:`.",
            stop_on=stop_on, log=log, every_tensor=every_tensor)
        self._session.bind(context)
        self._take_gradients = take_gradients
        self._take_loss = take_loss
        self._step_loss = step_loss
        self.stop_on = self._session.stop_on

    @property
    def stop_reason(self) -> str | None:
        """Why this callback stopped training, naming the layer; None while it has not."""
        return self._session.stop_reason

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Take parameter gradients from the optimizer that ``fit`` uses, and the loss from
        the model's ``compute_loss``; learn how the optimizer clips."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            self._take_gradients(optimizer)
        if self._take_loss is not None:
            self._take_loss(self.model)
        self._session.start(self.model, clip=keras_clip(optimizer))

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Close the batch's step, with its loss; stop training on a finding named in
        ``stop_on``.

        The loss is the one the batch's gradients were computed from, recorded inside the
        compiled step and read with the step's statistics: ``logs["loss"]`` is the mean over
        the epoch so far (weighted by batch size), which cannot give a batch's loss exactly.
        It is recorded just after the close (``record_loss``), the close being the read.
        """
        closed = self._session.close()
        loss = self._step_loss() if self._step_loss is not None else None
        self._session.record_loss(loss)
        if closed.stop:
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Add the metrics of the epoch's steps to the epoch's ``logs``."""
        if logs is not None:
            logs.update(self._session.take_metrics())

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Give the Watcher its own notices back (the ``with`` block keeps the Watcher)."""
        self._session.finish()
