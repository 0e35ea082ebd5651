"""The Keras callback of the torch and JAX backends: one graddebug step per training batch of
``model.fit`` (and ``train_on_batch``, which runs no callback: close those with ``dbg.step()``).

It speaks Keras's language (``on_train_batch_end``, ``self.model.stop_training``) and leaves
the rest to :class:`graddebug.integrations.session.CallbackSession`: the stop-on check, the
notices, the metrics added to each epoch's ``logs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import keras

from graddebug.errors import ConfigError
from graddebug.integrations.session import CallbackSession

if TYPE_CHECKING:
    from graddebug.adapter import CallbackContext, WatchContext

__all__ = ["KerasCallback", "build_callback"]


class KerasCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Closes a graddebug step after every training batch; logs each epoch's metrics;
    optionally stops training.

    Get it from the Watcher: ``model.fit(..., callbacks=[dbg.callback()])``.

    Args:
        context: The Watcher.
        prepare: Called with the model when training begins, before its first batch: binds
            the model's optimizer, so that its gradients are recorded.
        stop_on: Issues that stop training (``model.stop_training = True``) at the batch where
            they first appear; ``("nonfinite",)`` is TerminateOnNaN that names the layer.
        log: Add the metrics of each epoch's steps to the epoch's ``logs``.
        every_tensor: Add the norm of every recorded tensor too.
        loss: Returns the loss of the batch just trained, or None; recorded as the loss row
            of the step the batch closes.

    Raises:
        ConfigError: An unknown ``stop_on`` issue, or a ``log``/``every_tensor`` that is not a
            bool.
        WatcherStateError: ``context`` is not an active Watcher.
    """

    def __init__(self, context: CallbackContext, prepare: Callable[[Any], None],
                 stop_on: Iterable[str] = (), *, log: bool = True,
                 every_tensor: bool = False,
                 loss: Callable[[], float | None] | None = None) -> None:
        super().__init__()
        self._session = CallbackSession(
            "dbg.callback()", "get it inside `with graddebug.watch(model) as dbg:`.",
            stop_on=stop_on, log=log, every_tensor=every_tensor)
        self._session.bind(context)
        self._prepare = prepare
        self._loss = loss
        self.stop_on = self._session.stop_on

    @property
    def stop_reason(self) -> str | None:
        """Why this callback stopped training, naming the layer; None while it has not."""
        return self._session.stop_reason

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Bind the model's optimizer; start the session."""
        self._prepare(self.model)
        self._session.start(self.model)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Close the batch's step, with its loss; stop training on a finding named in
        ``stop_on``."""
        closed = self._session.close()
        if self._loss is not None:
            self._session.record_loss(self._loss())
        if closed.stop:
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        """Add the metrics of the epoch's steps to the epoch's ``logs``."""
        if logs is not None:
            logs.update(self._session.take_metrics())

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Give the Watcher its own notices back (the ``with`` block keeps the Watcher)."""
        self._session.finish()


def build_callback(context: WatchContext, prepare: Callable[[Any], None],
                   options: dict[str, Any],
                   loss: Callable[[], float | None] | None = None) -> KerasCallback:
    """The Keras callback of ``dbg.callback(**options)``, bound to ``context``'s Watcher.

    ``prepare`` and ``loss`` are the backend's, as for :class:`KerasCallback`.

    Raises:
        ConfigError: An option that is not the callback's.
    """
    unknown = set(options) - {"stop_on", "log", "every_tensor"}
    if unknown:
        raise ConfigError(
            f"dbg.callback() got unknown options {sorted(unknown)!r}; it takes stop_on=, "
            "log= and every_tensor=.")
    return KerasCallback(context.watcher, prepare, loss=loss, **options)
