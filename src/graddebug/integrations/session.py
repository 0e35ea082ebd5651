"""What a training-framework callback that watches a model shares, whichever the framework
(Lightning, the Hugging Face Trainer, Keras): its options, the Watcher it enters or borrows, one
graddebug step per optimizer step, the metrics of the steps since the host last logged
(:mod:`graddebug.integrations.metrics`), the notice of new findings through the host's logger,
the host's clip (:mod:`graddebug.integrations.clipping`), the stop-on check, and the frames
afterwards.

A callback holds a :class:`CallbackSession` and calls it from the host's own events; it adds
only what its host says differently (where gradients are complete, how metrics are logged, how
training is stopped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from graddebug.errors import ConfigError, WatcherStateError
from graddebug.integrations.clipping import HostClip, clipped
from graddebug.integrations.metrics import IntervalMetrics
from graddebug.integrations.stopping import (
    check_watch_options,
    nonfinite,
    parse_stop_on,
    stop_reason,
)

if TYPE_CHECKING:
    import pandas as pd

    from graddebug.adapter import CallbackContext, HostSide
    from graddebug.capture.watcher import Watcher
    from graddebug.report.report import Report

__all__ = ["CallbackSession", "ClosedStep", "SessionResults"]

log = logging.getLogger("graddebug")

S = TypeVar("S", bound="SessionResults")


@dataclass
class ClosedStep:
    """What closing one graddebug step gave a callback.

    Attributes:
        recorded: The step was recorded (``every=`` skips the others).
        stop: Training should stop now; the reason is in :attr:`CallbackSession.stop_reason`.
    """

    recorded: bool
    stop: bool


class CallbackSession:
    """A callback's Watcher, from the start of training to its end.

    Args:
        where: The callback's name, for messages (``"GradDebugCallback"``).
        start_hint: How to start one, for the message when results are asked too early.
        stop_on: Issues that stop training at the first step that shows them.
        log: Whether the callback logs metrics through its host.
        every_tensor: Log the norm of every recorded tensor too, not only the compact set.
        notify: Where the notice of new findings goes (the host's logger); None for the
            ``graddebug`` logger.
        watch_options: Options of :func:`graddebug.watch`, except ``optimizer=``.

    Raises:
        ConfigError: An unknown ``stop_on`` issue or watch option, ``optimizer=``, or a
            ``log``/``every_tensor`` that is not a bool.
    """

    def __init__(self, where: str, start_hint: str, *, stop_on: Iterable[str] | str = (),
                 log: bool = True, every_tensor: bool = False,
                 notify: Callable[[str], None] | None = None,
                 watch_options: dict[str, Any] | None = None) -> None:
        options = dict(watch_options or {})
        self.stop_on = parse_stop_on(stop_on, where)
        for name, value in (("log", log), ("every_tensor", every_tensor)):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}({name}={value!r}): pass True or False.")
        self.log = log
        self.metrics = IntervalMetrics(every_tensor=every_tensor)
        self._notify = notify
        self._clip: HostClip | None = None
        self._lines: list[str] = []  # the notice of the step being closed
        self._found = 0  # findings the step being closed brought
        self._host: HostSide | None = None
        self._saved: tuple[Any, Any, Any] | None = None  # a bound Watcher's own host side
        if "optimizer" in options:
            raise ConfigError(
                f"{where} closes a step at each optimizer step by itself; leave out optimizer=."
            )
        check_watch_options(options, where, ("stop_on", "log", "every_tensor"))
        self._where = where
        self._hint = start_hint
        self._options = options
        self.watcher: Watcher | None = None
        self.stop_reason: str | None = None
        self._owned = True
        self._own: Watcher | None = None  # the Watcher this session entered

    @property
    def owned(self) -> bool:
        """Whether the session enters a Watcher of its own (a stand-alone callback), rather
        than serving one a ``with`` block holds."""
        return self._owned

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

    def start(self, model: Any, *, scaler: Any = None, clip: HostClip | None = None) -> None:
        """Training starts: enter a Watcher on ``model`` (unless bound to one), and tell it
        where notices go and how the host clips.

        Args:
            model: The model the host trains.
            scaler: The host's loss scaler (mixed precision), watched as ``watch(scaler=...)``
                unless the callback's options name one.
            clip: How the host clips the gradients after each close, or None.
        """
        self.stop_reason = None
        self._clip = clip
        self.metrics.take()
        if self._owned:
            self.finish()  # a previous run that raised may have left its Watcher open
            from graddebug.capture.watcher import Watcher

            options = self._options
            if scaler is not None and options.get("scaler") is None:
                options = {**options, "scaler": scaler}
            watcher = Watcher(model, **options)
            watcher.__enter__()
            self.watcher = self._own = watcher
        self._speak_for_host()

    def _speak_for_host(self) -> None:
        """Route the Watcher's notices and findings through this session, and its rows
        through the host's clip; a bound Watcher gets its own back at :meth:`finish`."""
        if self.watcher is None:
            return
        host = self.watcher.host
        if self._host is not host:
            self._saved = (host.notify, host.amend, host.findings)
        self._host = host
        host.notify = self._lines.append
        host.findings = self._count
        host.amend = partial(clipped, clip=self._clip) if self._clip is not None else None

    def _count(self, findings: Any) -> None:
        self._found += len(findings)

    def close(self, loss: Any = None) -> ClosedStep:
        """Close the graddebug step at an optimizer step. Parameter gradients are measured as
        the close finds them; the host's clip, where it comes after, fills ``clipped_norm``.
        The step goes into the metrics of the current logging interval, and its notice, if it
        brought findings, to the host's logger (with the stop, if it stops training).

        Args:
            loss: The step's loss, where the host knows it by now.

        Returns:
            Whether the step was recorded and whether to stop.
        """
        watcher = self.watcher
        if watcher is None or not watcher.active:
            return ClosedStep(False, False)
        step = watcher.step_index
        self._lines.clear()
        self._found = 0
        result = watcher.step(loss=loss)
        if result is None:
            return ClosedStep(False, False)
        self.metrics.add(result.records, self._found)
        stop = bool(self.stop_on) and self.stop_reason is None and nonfinite(result)
        lines = list(self._lines)
        if stop:
            self.stop_reason = stop_reason(watcher.findings(), step, result)
            lines = ([f"{lines[0]} Training stops (stop_on)."] if lines
                     else [self.stop_reason])
        for line in lines:
            self.say(line)
        return ClosedStep(True, stop)

    def say(self, line: str) -> None:
        """Log one line through the host's logger (the ``graddebug`` logger without one),
        unless the ``graddebug`` logger is silenced below WARNING."""
        if not log.isEnabledFor(logging.WARNING):
            return
        if self._notify is not None:
            self._notify(line)
        else:
            log.warning(line)

    def take_metrics(self) -> dict[str, float]:
        """The metrics of the steps since the host last logged, to log now (empty when
        logging is off or no step was recorded since); starts the next interval."""
        metrics = self.metrics.take()
        return metrics if self.log else {}

    def record_loss(self, loss: Any) -> None:
        """The loss of the step closed last, for hosts that report it after the close."""
        watcher = self.watcher
        if watcher is not None and watcher.active and loss is not None:
            watcher.record_loss(loss)

    def finish(self, exception: BaseException | None = None) -> None:
        """Training ended (or failed): give a bound Watcher its host side back, and leave the
        Watcher this session entered, if any."""
        host, self._host = self._host, None
        if host is not None and self._saved is not None:
            host.notify, host.amend, host.findings = self._saved
            self._saved = None
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
                 every_tensor: bool = False, **watch_options: Any) -> None:
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
              log: bool = True, every_tensor: bool = False) -> S:
        """Return a callback that serves an active Watcher instead of making its own: the
        ``with`` block keeps owning the Watcher, and the callback closes its steps, logs and
        stops (``dbg.callback()`` returns one for a torch model).

        Args:
            context: The Watcher.
            stop_on: As for the constructor.
            log: As for the constructor.
            every_tensor: As for the constructor.

        Raises:
            WatcherStateError: ``context`` is not active.
        """
        callback = cls(stop_on=stop_on, log=log, every_tensor=every_tensor)
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
