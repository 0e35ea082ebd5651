"""Step boundaries: who closed the last step, closing one with the adapter, and what a close
sets in motion (the rows into the buffer, the next step's statistics tier, op-level escalation,
the ``graddebug_step_recorded`` subscribers).

The Watcher owns one :class:`Steps` and hands it the adapter once one is built; ``dbg.step()``,
the optimizer given to ``watch(optimizer=...)`` and the end of the ``with`` block close steps
through it.

A recorded step that brings new findings gives one notice line (:func:`notice_line`), logged
at WARNING through the ``graddebug`` logger; a training callback sends it through its host's
logger instead (:attr:`HostSide.notify`), so that it is seen once. Silence it by the logger's
level: ``logging.getLogger("graddebug").setLevel(logging.ERROR)``, in a callback too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

import pluggy

from graddebug.adapter import (
    Adapter,
    CallbackContext,
    CompiledTiers,
    HostSide,
    ReadAhead,
    StepResult,
)
from graddebug.adapter.capabilities import has
from graddebug.capture.buffer import RunBuffer, gc_paused
from graddebug.capture.context import HookSide
from graddebug.capture.layers import FailOpen
from graddebug.capture.live import LiveFindings
from graddebug.config import as_number
from graddebug.errors import ConfigError, FindingError, WatcherStateError
from graddebug.frames import finding_frame
from graddebug.records import Finding, Kind, Record, Severity, sums_record

__all__ = ["StepState", "Steps", "loss_record", "loss_value", "notice_line", "split_loss"]

_LOSS = Kind.LOSS.value
log = logging.getLogger("graddebug")
_MORE = 3  # other findings a notice names, after the first


def notice_line(findings: Sequence[Finding], step: int) -> str | None:
    """The notice of the findings one step brought, or None when it brought none.

    One line whatever their number: the most severe finding in full (step, layer and tensor,
    issue, cause where known, and its message, which says what to try), then the others by
    issue and place.
    """
    if not findings:
        return None
    rows = sorted(findings, key=lambda f: -Severity.rank(f.severity))

    def place(f: Finding) -> str:
        return f"{f.layer}.{f.tensor}" if f.tensor else f.layer or "(model)"

    first = rows[0]
    cause = first.cause or ""
    line = (f"graddebug: step {step}: {first.issue} at {place(first)}"
            f"{f' (cause: {cause})' if cause else ''}: {first.message}")
    others = [f"{f.issue} at {place(f)}" for f in rows[1:]]
    if others:
        more = f" and {len(others) - _MORE} more" if len(others) > _MORE else ""
        line += f" [also {', '.join(others[:_MORE])}{more}]"
    return line


def loss_value(loss: Any, where: str) -> float | None:
    """A loss handed to graddebug as a Python float (None stays None).

    Numbers are taken as they are; anything else (a tensor or array of one element, of any
    framework) through ``float()``, which reads it from the device.

    Raises:
        ConfigError: ``loss`` is not one number.
    """
    if loss is None:
        return None
    number = as_number(loss)
    if number is not None:
        return float(number)
    detach = getattr(loss, "detach", None)  # a torch loss that still requires a gradient
    try:
        if isinstance(loss, (str, bytes)):
            raise TypeError("text")
        return float(detach() if callable(detach) else loss)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"{where} takes the step's loss as one number or a one-element tensor; got "
            f"{type(loss).__name__} {getattr(loss, 'shape', '')!s}. Pass loss.mean(), or "
            "leave it out inside a compiled function."
        ) from exc


def _one_number(value: Any) -> bool:
    """Whether ``value`` is one number: a Python or numpy number, or a 0-d tensor or array of
    any framework (``ndim`` 0, or an empty ``shape``), never a list, a dict or text."""
    if as_number(value) is not None:
        return True
    if value is None or isinstance(value, (str, bytes, Mapping, list, tuple)):
        return False
    ndim = getattr(value, "ndim", None)
    if ndim is not None:
        return bool(ndim == 0)
    shape = getattr(value, "shape", None)
    try:  # a graph tensor of unknown rank has a shape that cannot be listed
        return shape is not None and len(tuple(shape)) == 0
    except (TypeError, ValueError):
        return False


def split_loss(grads: Any, loss: Any) -> tuple[Any, Any]:
    """``dbg.step(loss)``: a positional argument that is one number is the step's loss, as
    ``dbg.step(loss=...)``; anything else (a list, a pytree, what a session fetched) stays
    the gradients.

    Returns:
        ``(grads, loss)`` as ``dbg.step(grads, loss=loss)`` would take them.

    Raises:
        ConfigError: A loss was given both positionally and as ``loss=``.
    """
    if grads is None or not _one_number(grads):
        return grads, loss
    if loss is not None:
        raise ConfigError(
            "dbg.step() got two losses, one positional and one as loss=; pass it once: "
            "dbg.step(loss) or dbg.step(loss=loss).")
    return None, grads


def loss_record(step: int, loss: float) -> Record:
    """The loss row of a step (see :attr:`graddebug.records.Kind.LOSS`)."""
    return sums_record(step, _LOSS, _LOSS, _LOSS, -1, "()", 1, abs(loss), loss, abs(loss),
                       math.nan, math.isnan(loss), math.isinf(loss))


class StepState(Enum):
    """Where the Watcher stands between two steps."""

    OPEN = "open"
    """Gradients arrived (or nothing was closed yet): the next close records them."""
    CLOSED_BY_USER = "closed_by_user"
    """``dbg.step()`` closed the last step and nothing arrived since."""
    CLOSED_BY_OPTIMIZER = "closed_by_optimizer"
    """The optimizer given to ``watch(optimizer=...)`` closed the last step and nothing
    arrived since."""


class Steps:
    """Closes the steps of one Watcher.

    Args:
        hooks: The Watcher's hook side, which holds the open step's index.
        buffer: Where recorded rows go.
        plugin_manager: Whose ``graddebug_step_recorded`` subscribers hear of each step.
        watcher: The Watcher, as subscribers see it.
        optimizer: The optimizer given to ``watch(optimizer=...)``, or None (for messages).
        live: Where each recorded step's rows are diagnosed as it closes.
        raise_on: The issues whose first finding raises :class:`FindingError` from the close
            (``watch(raise_on=...)``).
    """

    def __init__(self, hooks: HookSide, buffer: RunBuffer, plugin_manager: pluggy.PluginManager,
                 watcher: CallbackContext, optimizer: Any, live: LiveFindings,
                 raise_on: frozenset[str] = frozenset()) -> None:
        self._hooks = hooks
        self._buffer = buffer
        self._pm = plugin_manager
        self._watcher = watcher
        self._optimizer = type(optimizer).__name__ if optimizer is not None else ""
        self._adapter: Adapter | None = None
        # The capabilities asked on every step, found once the adapter is built.
        self._read_ahead: ReadAhead | None = None
        self._tiers_sink: CompiledTiers | None = None
        self._closed = StepState.OPEN  # who closed the last step; OPEN before the first
        self._live = live
        self._raise_on = raise_on
        self._last_recorded: int | None = None
        self._loss_step: int | None = None  # the last recorded step that has a loss row
        self.host = HostSide()
        """What a training callback said about its host (see :class:`HostSide`)."""

    @property
    def adapter(self) -> Adapter | None:
        """The adapter steps are closed with; None until one is built."""
        return self._adapter

    def serve(self, adapter: Adapter) -> None:
        """Close steps with ``adapter`` from now on."""
        self._adapter = adapter
        self._read_ahead = (adapter if has(adapter, ReadAhead) and isinstance(adapter, ReadAhead)
                            else None)
        self._tiers_sink = (adapter if has(adapter, CompiledTiers)
                            and isinstance(adapter, CompiledTiers) else None)

    @property
    def state(self) -> StepState:
        """Whether the current step is open, or was closed by ``dbg.step()`` or by the
        optimizer with nothing captured since."""
        if self._closed is StepState.OPEN or self.pending():
            return StepState.OPEN
        return self._closed

    def pending(self) -> bool:
        """Whether the adapter captured anything in the open step."""
        return self._adapter is not None and self._adapter.has_pending()

    def by_user(self, grads: Sequence[Any] | None, loss: Any = None) -> StepResult | None:
        """``dbg.step(grads)``: close the open step, unless nothing arrived since the last
        ``dbg.step()`` (warned once) or the optimizer has closed it already (an error).
        ``loss``, as the user gave it, is read (a host transfer) on a recorded step only.

        Raises:
            WatcherStateError: The optimizer given to ``watch(optimizer=...)`` has closed the
                step already and nothing arrived since.
            ConfigError: ``loss`` is not one number.
            FindingError: The step brought a finding of an issue in ``raise_on``.
        """
        # The adapter is asked whether anything arrived only where the answer matters: in
        # TensorFlow it reads the buffers, a host transfer.
        hooks, closed = self._hooks, self._closed
        if closed is StepState.CLOSED_BY_OPTIMIZER and not self.pending():
            raise WatcherStateError(
                f"dbg.step() found no gradient to record: {self._optimizer}.step() has closed "
                "this step already, as it does each step under watch(optimizer=...). Leave "
                "dbg.step() out of the loop, or drop optimizer=."
            )
        if (grads is None and hooks.recording and closed is StepState.CLOSED_BY_USER
                and not self._pending_for_close()):
            hooks.warn_once("step-twice", (
                f"graddebug: dbg.step() was called again with no backward since the last call "
                f"(step {hooks.step}); it recorded nothing, since the gradients on the "
                "parameters are those of the step already recorded. Call dbg.step() once per "
                "optimizer step, after backward()."
            ))
            return None
        bugs = len(self._buffer.internal)
        value = loss_value(loss, "step(loss=...)") if hooks.recording else None
        result = self.close(grads, StepState.CLOSED_BY_USER, value)
        # A gap that a warning (a torch.func transform, a compiled model), an event (a cut
        # graph) or a bug of graddebug's (an internal_error) explains already is not
        # explained twice.
        if (grads is None and result is not None and not hooks.warned and not result.events
                and len(self._buffer.internal) == bugs
                and all(r.kind == _LOSS for r in result.records)):
            hooks.warn_once("step-no-gradient", (
                f"graddebug: dbg.step() closed step {hooks.step - 1} with no gradient since the "
                "last step: no watched layer output or parameter got one, so the step has no "
                "rows. Call dbg.step() once per optimizer step after loss.backward() (or after "
                "computing the gradients) and before zero_grad(); called between the forward "
                "pass and backward(), each step records the gradients of the one before."
            ))
        if result is not None:
            self._raise_for(hooks.step - 1)
        return result

    def late_loss(self, loss: float) -> None:
        """Record the loss of the step closed last, unless it has one or was not recorded."""
        step = self._last_recorded
        if step is None or step != self._hooks.step - 1 or step == self._loss_step:
            return
        self._loss_step = step
        row = loss_record(step, loss)
        self._buffer.add_rows([row])
        self._judge(self._live.observe_loss, step, row)

    def _judge(self, rule: Any, *args: Any) -> Any:
        """Run a live diagnosis; a bug in one must not stop training, so it fails open."""
        with FailOpen(self._hooks.internal_error, "live findings"):
            return rule(*args)
        return None

    def _findings_of(self, step: int) -> list[Finding]:
        """The findings ``step`` brought (none where the live rules failed)."""
        found = self._judge(self._live.new, step)
        return found if found is not None else []

    def by_optimizer(self) -> None:
        """Called by the adapter after each step of the optimizer given to ``watch``: close
        the step, unless ``dbg.step()`` closed it already and nothing arrived since.

        Raises:
            FindingError: The step brought a finding of an issue in ``raise_on``.
        """
        if self.state is StepState.CLOSED_BY_USER:
            self._closed = StepState.CLOSED_BY_OPTIMIZER
            return
        # Fail-open: the user's optimizer step has already happened.
        result = None
        with FailOpen(self._hooks.internal_error, f"{self._optimizer}.step"):
            result = self.close(None, StepState.CLOSED_BY_OPTIMIZER)
        if result is not None:  # raise_on is the user's request, not a bug: it raises
            self._raise_for(self._hooks.step - 1)

    def _raise_for(self, step: int) -> None:
        """Raise :class:`FindingError` when the recorded ``step`` brought a finding of an issue
        in ``raise_on``; its message is the step's notice line, its rows those findings."""
        if not self._raise_on:
            return
        found = [f for f in self._findings_of(step) if f.issue in self._raise_on]
        line = notice_line(found, step)
        if line is not None:
            raise FindingError(
                f"{line} (raised by watch(raise_on={tuple(sorted(self._raise_on))!r}); the "
                "rows are in this error's .findings, the run so far in dbg.findings())",
                finding_frame(found))

    def _pending_for_close(self) -> bool:
        """Whether anything arrived, asked right before a close (see :class:`ReadAhead`)."""
        if self._read_ahead is not None:
            return self._read_ahead.pending_for_close()
        return self.pending()

    def close(self, grads: Sequence[Any] | None, by: StepState, loss: float | None = None
              ) -> StepResult | None:
        """Close the open step: the adapter's rows into the buffer when it is recorded, then
        the next step opens.

        Args:
            grads: Parameter gradients handed to ``dbg.step()``, or None.
            by: Who closes it.
            loss: The step's loss, where the caller knows it.

        Returns:
            The step's result; None when ``every=`` skipped it.
        """
        adapter, hooks = self._adapter, self._hooks
        step, recording = hooks.step, hooks.recording
        result = None
        try:
            if adapter is not None and not recording:
                adapter.close_step(step, grads, record=False)
            elif adapter is not None:
                with gc_paused():  # a recorded step builds its rows: many objects, no cycle
                    result = adapter.close_step(step, grads, record=True)
                    self._amend(result)
                    if loss is not None:
                        result.records.append(loss_record(step, loss))
                        self._loss_step = step
                    self._buffer.add(step, result)
                    self._last_recorded = step
                    self._judge(self._live.observe, step, result)
                    result.diagnose = lambda: finding_frame(self._findings_of(step))
                    self._pick_tier(result)
                    self._judge(self._notice, step, result)
                if hooks.escalation is not None:
                    self._escalate(result)
                self.notify(self._pm.hook.graddebug_step_recorded, watcher=self._watcher,
                            step=step, result=result)
        finally:
            self._closed = by
        hooks.step += 1
        return result if recording else None

    def _amend(self, result: StepResult) -> None:
        """Let the host side change the step's rows (fail-open: they stay as they were)."""
        amend = self.host.amend
        if amend is None:
            return
        with FailOpen(self._hooks.internal_error, "host clip"):
            result.records[:] = amend(result.records)

    def _notice(self, step: int, result: StepResult) -> None:
        """Send the notice of the findings the step brought, once, where the host side says.

        The step's findings are diagnosed here only where someone hears of them: a logger
        that shows warnings, or a callback that counts them."""
        host = self.host
        if host.findings is None and not log.isEnabledFor(logging.WARNING):
            return
        found = self._findings_of(step)
        result.diagnose = lambda: finding_frame(found)
        if host.findings is not None:
            host.findings(found)
        line = notice_line(found, step) if found and log.isEnabledFor(logging.WARNING) else None
        if line is None:
            return
        if host.notify is not None:
            host.notify(line)
        else:
            log.warning(line)

    def _pick_tier(self, result: StepResult) -> None:
        """Let the rows of the step just recorded decide the next step's tier, and tell an
        adapter whose compiled graphs learn it in advance."""
        hooks = self._hooks
        with FailOpen(hooks.internal_error, "tiers"):  # the next steps then keep their tier
            hooks.tiers.after(hooks.step, result)
            if self._tiers_sink is not None:
                self._tiers_sink.next_step_full(hooks.tiers.full(hooks.step + hooks.every))

    def _escalate(self, result: StepResult) -> None:
        """Arm op-level capture for the next recorded step after a finding (escalate=True)."""
        hooks = self._hooks
        assert hooks.escalation is not None
        with FailOpen(hooks.internal_error, "escalate"):  # escalation only adds detail
            hooks.escalation.after(hooks.step, result, hooks.step + hooks.every)

    def notify(self, hook: Any, **kwargs: Any) -> None:
        """Call a plugin hook; a subscriber's bug (a third-party logger) must not stop
        training, so it fails open."""
        with FailOpen(self._hooks.internal_error, f"{hook.name} plugin"):
            hook(**kwargs)
