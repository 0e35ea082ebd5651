"""What a training-framework callback that watches a model shares, whichever the framework
(Lightning, the Hugging Face Trainer): its options, the Watcher it enters or borrows, one
graddebug step per optimizer step with the norms to log and the stop-on check, and the frames
afterwards.

A callback holds a :class:`CallbackSession` and calls it from the host's own events; it adds
only what its host says differently (where gradients are complete, how metrics are logged, how
training is stopped).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from graddebug.errors import ConfigError, WatcherStateError
from graddebug.integrations.stopping import (
    check_watch_options,
    nonfinite,
    parse_stop_on,
    stop_reason,
)

if TYPE_CHECKING:
    import pandas as pd

    from graddebug.adapter import CallbackContext
    from graddebug.capture.watcher import Watcher
    from graddebug.report.report import Report

__all__ = ["CallbackSession", "ClosedStep", "SessionResults"]

log = logging.getLogger("graddebug")

S = TypeVar("S", bound="SessionResults")


@dataclass
class ClosedStep:
    """What closing one graddebug step gave a callback.

    Attributes:
        metrics: ``graddebug/<layer>.<tensor>/norm`` for every recorded tensor (empty when the
            step was not recorded or logging is off).
        stop: Training should stop now; the reason is in :attr:`CallbackSession.stop_reason`.
    """

    metrics: dict[str, float]
    stop: bool


class CallbackSession:
    """A callback's Watcher, from the start of training to its end.

    Args:
        where: The callback's name, for messages (``"GradDebugCallback"``).
        start_hint: How to start one, for the message when results are asked too early.
        stop_on: Issues that stop training at the first step that shows them.
        log: Whether the callback logs norms.
        watch_options: Options of :func:`graddebug.watch`, except ``optimizer=``.

    Raises:
        ConfigError: An unknown ``stop_on`` issue or watch option, or ``optimizer=``.
    """

    def __init__(self, where: str, start_hint: str, *, stop_on: Iterable[str] | str = (),
                 log: bool = True, watch_options: dict[str, Any] | None = None) -> None:
        options = dict(watch_options or {})
        self.stop_on = parse_stop_on(stop_on, where)
        self.log = log
        if "optimizer" in options:
            raise ConfigError(
                f"{where} closes a step at each optimizer step by itself; leave out optimizer=."
            )
        check_watch_options(options, where, ("stop_on", "log"))
        self._where = where
        self._hint = start_hint
        self._options = options
        self.watcher: Watcher | None = None
        self.stop_reason: str | None = None
        self._owned = True
        self._own: Watcher | None = None  # the Watcher this session entered

    def bind(self, context: CallbackContext) -> None:
        """Serve an active Watcher instead of making one: its ``with`` block stays in charge.

        Args:
            context: The Watcher, as the adapter that builds the callback sees it
                (:attr:`graddebug.adapter.WatchContext.watcher`).

        Raises:
            WatcherStateError: ``context`` is not an active Watcher.
        """
        from graddebug.capture.watcher import Watcher

        if not isinstance(context, Watcher) or not context.active:
            raise WatcherStateError(f"a bound {self._where} needs an active Watcher.")
        self.watcher, self._owned = context, False

    def start(self, model: Any, *, scaler: Any = None) -> None:
        """Training starts: enter a Watcher on ``model`` (unless bound to one).

        Args:
            model: The model the host trains.
            scaler: The host's loss scaler (mixed precision), watched as ``watch(scaler=...)``
                unless the callback's options name one.
        """
        self.stop_reason = None
        if not self._owned:
            return
        self.finish()  # a previous run that raised may have left its Watcher open
        from graddebug.capture.watcher import Watcher

        options = self._options
        if scaler is not None and options.get("scaler") is None:
            options = {**options, "scaler": scaler}
        watcher = Watcher(model, **options)
        watcher.__enter__()
        self.watcher = self._own = watcher

    def close(self, loss: Any = None) -> ClosedStep:
        """Close the graddebug step at an optimizer step. Parameter gradients are measured as
        the close finds them, after any unscaling or clipping in place since backward.

        Args:
            loss: The step's loss, where the host knows it by now.

        Returns:
            The norms to log and whether to stop.
        """
        watcher = self.watcher
        if watcher is None or not watcher.active:
            return ClosedStep({}, False)
        step = watcher.step_index
        result = watcher.step(loss=loss)
        if result is None:
            return ClosedStep({}, False)
        metrics = ({f"graddebug/{r.layer}.{r.tensor}/norm": r.norm for r in result.records}
                   if self.log else {})
        stop = bool(self.stop_on) and self.stop_reason is None and nonfinite(result)
        if stop:
            self.stop_reason = stop_reason(watcher.findings(), step, result)
            log.warning(self.stop_reason)
        return ClosedStep(metrics, stop)

    def record_loss(self, loss: Any) -> None:
        """The loss of the step closed last, for hosts that report it after the close."""
        watcher = self.watcher
        if watcher is not None and watcher.active and loss is not None:
            watcher.record_loss(loss)

    def finish(self, exception: BaseException | None = None) -> None:
        """Training ended (or failed): leave the Watcher this session entered, if any."""
        watcher, self._own = self._own, None
        if watcher is None or not watcher.active:
            return
        exc_info: tuple[type[BaseException] | None, BaseException | None,
                        TracebackType | None] = (None, None, None)
        if exception is not None:
            exc_info = (type(exception), exception, exception.__traceback__)
        watcher.__exit__(*exc_info)

    def require(self) -> Watcher:
        """The Watcher, once training started.

        Raises:
            WatcherStateError: Training has not started yet.
        """
        if self.watcher is None:
            raise WatcherStateError(f"{self._where} has no Watcher yet: {self._hint}")
        return self.watcher

    def frame(self) -> pd.DataFrame:
        """The Watcher's record frame (one row per step and tensor)."""
        return self.require().frame()

    def findings(self) -> pd.DataFrame:
        """The Watcher's findings."""
        return self.require().findings()

    def report(self) -> Report:
        """The run as a :class:`graddebug.Report`."""
        return self.require().report()


class SessionResults:
    """What a callback holding a :class:`CallbackSession` in ``_session`` offers its user:
    the Watcher, why it stopped training, the frames, and ``bound()``.

    Mixed into the Lightning and Trainer callbacks, before the host's callback class.
    """

    _session: CallbackSession

    def __init__(self, *, stop_on: Iterable[str] | str = (), log: bool = True,
                 **watch_options: Any) -> None:
        # The signature every such callback has (bound() relies on it); each builds its own
        # session, and the host's callback class comes next in the MRO.
        super().__init__()

    @property
    def watcher(self) -> Watcher | None:
        """The Watcher of the latest training run (None before one starts)."""
        return self._session.watcher

    @property
    def stop_reason(self) -> str | None:
        """Why this callback stopped training, naming the layer; None while it has not."""
        return self._session.stop_reason

    @classmethod
    def bound(cls: type[S], context: CallbackContext, *, stop_on: Iterable[str] | str = (),
              log: bool = True) -> S:
        """Return a callback that serves an active Watcher instead of making its own: the
        ``with`` block keeps owning the Watcher, and the callback closes its steps, logs and
        stops (``dbg.callback()`` returns one for a torch model).

        Args:
            context: The Watcher.
            stop_on: As for the constructor.
            log: As for the constructor.

        Raises:
            WatcherStateError: ``context`` is not active.
        """
        callback = cls(stop_on=stop_on, log=log)
        callback._session.bind(context)
        return callback

    def frame(self) -> pd.DataFrame:
        """Return the Watcher's record frame (one row per step and tensor)."""
        return self._session.frame()

    def findings(self) -> pd.DataFrame:
        """Return the Watcher's findings."""
        return self._session.findings()

    def report(self) -> Report:
        """Return the run as a :class:`graddebug.Report`."""
        return self._session.report()
