"""The one Keras callback of every backend (TensorFlow, torch, JAX): a graddebug step per
training batch of ``model.fit`` (``train_on_batch`` runs no callback: close those steps with
``dbg.step()``).

It speaks Keras's language (``on_train_batch_end``, ``self.model.stop_training``) and leaves
the rest to :class:`graddebug.integrations.session.CallbackSession`: the stop-on check, the
notices, the metrics added to each epoch's ``logs``. What differs between backends (how the
model's optimizer and loss are bound when training begins, and where the batch's loss is read
after the close) is the adapter's, handed in as two functions.

Every backend measures the gradients the optimizer is handed, before the optimizer clips them
(``clipnorm``, ``global_clipnorm`` act inside ``optimizer.apply``): ``norm`` is the gradient
before the clip, which the diagnoses judge, and ``clipped_norm`` the gradient after it, worked
out from the optimizer's settings (:func:`graddebug_keras.optimizers.keras_clip`,
:mod:`graddebug.integrations.clipping`; ``clipvalue`` leaves it NaN).

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

from graddebug.errors import ConfigError
from graddebug.integrations.session import CallbackSession, SessionResults
from graddebug_keras.optimizers import keras_clip

if TYPE_CHECKING:
    from graddebug.adapter import WatchContext

__all__ = ["OPTIONS", "GradDebugCallback", "build_callback"]

OPTIONS = ("stop_on", "log", "every_tensor")
"""The options of ``dbg.callback()`` on a Keras model."""


class GradDebugCallback(SessionResults, keras.callbacks.Callback):  # type: ignore[misc]
    """Closes a graddebug step after every training batch; logs each epoch's metrics;
    optionally stops training.

    Stand-alone, it watches the model from the start of each ``fit`` to its end, on every
    Keras backend, with no ``with`` block::

        callback = graddebug_keras.GradDebugCallback(stop_on=("nonfinite",))
        model.fit(x, y, callbacks=[callback])
        callback.findings()

    Inside ``with graddebug.watch(model) as dbg:``, ``model.fit(..., callbacks=[dbg.callback()])``
    gives one bound to that Watcher instead. Either binds the model's optimizer when training
    begins, so ``model.fit`` needs no other change.

    Args:
        stop_on: Issues that stop training (``model.stop_training = True``) at the batch where
            they first appear; ``("nonfinite",)`` is TerminateOnNaN that names the layer.
        log: Add the metrics of each epoch's steps to the epoch's ``logs``.
        every_tensor: Add the norm of every recorded tensor too
            (``graddebug/norm/<layer>.<tensor>``).
        **watch_options: Options of :func:`graddebug.watch` (``layers=``, ``every=``,
            ``thresholds=``, ``log_dir=``, ...) for the stand-alone callback's Watcher,
            except ``optimizer=`` (the model's own is bound).

    Attributes:
        watcher: The Watcher of the latest ``fit`` (None before one starts); it keeps its
            frames after ``fit`` ends.

    Raises:
        ConfigError: An unknown ``stop_on`` issue or watch option, or a
            ``log``/``every_tensor`` that is not a bool.
    """

    def __init__(self, *, stop_on: Iterable[str] | str = (), log: bool = True,
                 every_tensor: bool = False, **watch_options: Any) -> None:
        super().__init__()
        self._session = CallbackSession(
            "GradDebugCallback", "pass it to model.fit(callbacks=[...]) and train first.",
            stop_on=stop_on, log=log, every_tensor=every_tensor,
            watch_options=watch_options)
        self._prepare: Callable[[Any], None] | None = None  # the adapter's, once known
        self._loss: Callable[[], float | None] | None = None
        self.stop_on = self._session.stop_on

    def bind_adapter(self, prepare: Callable[[Any], None],
                     loss: Callable[[], float | None] | None) -> None:
        """Take the adapter's two functions: ``prepare`` binds the model's optimizer (whose
        gradients, weights and updates it records) and its ``compute_loss`` when training
        begins; ``loss`` returns the loss of the batch just trained once its step has closed,
        or None (recorded as that step's loss row)."""
        self._prepare, self._loss = prepare, loss

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Bind the model's optimizer and loss; learn how the optimizer clips; start the
        session (stand-alone: enter a Watcher on the model, and take its adapter's
        functions)."""
        clip = keras_clip(getattr(self.model, "optimizer", None))
        if self._session.owned:
            self._session.start(self.model, clip=clip)
            own = self._session.require().callback()  # the adapter's callback, bound to it
            self.bind_adapter(own._prepare, own._loss)
            assert self._prepare is not None
            self._prepare(self.model)
            # fit made its train function before this event, and watching dropped it so that
            # the next trace holds the hooks: fit calls the attribute, made again here.
            if getattr(self.model, "train_function", True) is None:
                self.model.make_train_function()
            return
        assert self._prepare is not None, "a bound callback comes from build_callback()"
        self._prepare(self.model)
        self._session.start(self.model, clip=clip)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Close the batch's step, with its loss; stop training on a finding named in
        ``stop_on``.

        The loss is the one the batch's gradients were computed from, read with the step's
        statistics: ``logs["loss"]`` is the mean over the epoch so far (weighted by batch
        size), which cannot give a batch's loss exactly. It is recorded just after the close
        (``record_loss``), the close being the read.
        """
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
        """Stand-alone: leave the Watcher (its frames stay readable). Bound: give the Watcher
        its own notices back (the ``with`` block keeps it)."""
        self._session.finish()


def build_callback(context: WatchContext, prepare: Callable[[Any], None],
                   options: dict[str, Any],
                   loss: Callable[[], float | None] | None = None) -> GradDebugCallback:
    """The Keras callback of ``dbg.callback(**options)``, bound to ``context``'s Watcher.

    ``prepare`` and ``loss`` are the adapter's, as for :class:`GradDebugCallback`.

    Raises:
        ConfigError: An option that is not the callback's.
    """
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ConfigError(
            f"dbg.callback() got unknown options {sorted(unknown)!r}; on a Keras model it "
            "takes stop_on=, log= and every_tensor=.")
    callback = GradDebugCallback.bound(context.watcher, **options)
    callback.bind_adapter(prepare, loss)
    return callback
