"""The Watcher: a context manager that owns one capture session, its adapter, its step states
and its buffer (:mod:`graddebug.capture.buffer`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import pluggy

from graddebug.adapter import Adapter, Distributed, Distribution, HostSide, StepResult
from graddebug.adapter.capabilities import has, verify_adapter
from graddebug.adapter.options import WATCH_OPTIONS
from graddebug.capture.buffer import RunBuffer
from graddebug.capture.capabilities import (
    callback,
    follow,
    refuse_at_watch,
    refuse_options,
    session_graphs,
    train_step,
)
from graddebug.capture.context import HookSide
from graddebug.capture.escalation import Escalation
from graddebug.capture.kept import KEEP_STEPS, check_keep_steps
from graddebug.capture.layers import Intervention
from graddebug.capture.metadata import run_metadata
from graddebug.capture.options import (
    EarlyNames,
    build_options,
    check_without_model,
    configured,
    unmatched_error,
)
from graddebug.capture.results import RunResults
from graddebug.capture.steps import Steps, StepState, loss_value, split_loss
from graddebug.config import Thresholds, disabled
from graddebug.errors import ConfigError, WatcherStateError
from graddebug.plugins import find_adapter, get_plugin_manager
from graddebug.runs.layout import now
from graddebug.runs.writer import DEFAULT_FLUSH_EVERY

__all__ = ["StepState", "Watcher"]


class Watcher(RunResults):
    """Captures gradients of a model, of named tensors, or of taps, and diagnoses them.

    Use it as a context manager, usually through :func:`watch`, or :meth:`start` and :meth:`stop`
    it. Everything it installed is removed when the block ends, also when the block raised.

    Args:
        model: A model of a framework whose adapter is installed (a ``torch.nn.Module``, a
            Keras model, a Flax NNX module); None with ``params=`` or for taps only.

    Every other argument is an option of :func:`watch`; each is documented on
    :class:`graddebug.adapter.WatchOptions`. An option that the model's adapter does not
    honour raises :class:`~graddebug.errors.UnsupportedOptionError` here, when set.
    """

    @configured
    def __init__(
        self,
        model: Any = None,
        *,
        params: Mapping[str, Any] | None = None,
        layers: Sequence[Any] | str | type | None = None,
        keep: Sequence[str] | str | None = None,
        keep_steps: int | None = KEEP_STEPS,
        intervene: Mapping[str, Any] | None = None,
        every: int = 1,
        outputs: bool = True,
        param_stats: Literal["norm", "full"] = "norm",
        optimizer: Any = None,
        scaler: Any = None,
        thresholds: Thresholds | Mapping[str, float] | None = None,
        strict: bool = False,
        log_dir: str | os.PathLike[str] | None = None,
        flush_every: int = DEFAULT_FLUSH_EVERY,
        plugin_manager: pluggy.PluginManager | None = None,
        tensorboard: str | os.PathLike[str] | None = None,
        ops: bool = False,
        escalate: bool = False,
        full_stats_every: int = 10,
        raise_on: Sequence[str] | str = (),
    ) -> None:
        arguments = locals()  # the options, by the names WatchOptions' fields give them
        given = {name: arguments[name] for name in WATCH_OPTIONS}
        given.update(keep_steps=check_keep_steps(keep_steps),
                     thresholds=Thresholds.coerce(thresholds))
        self._options = options = build_options(given)
        check_without_model(model, options)
        self._model = model
        buffer = RunBuffer(log_dir, options.flush_every, self._describe,
                           lambda exc, where: self._hooks.internal_error(exc, where),
                           keep_steps=options.keep_steps,
                           warn=lambda key, message: self._hooks.warn_once(key, message))
        super().__init__(buffer, options.thresholds, plugin_manager or get_plugin_manager())
        self._hooks = HookSide(
            self, buffer, every=options.every, full_stats_every=options.full_stats_every,
            escalation=(Escalation(self.thresholds)
                        if options.escalate and not options.ops else None),
            ops=options.ops, strict=options.strict, dead_fraction=self.thresholds.dead_fraction)
        self._steps = Steps(self._hooks, buffer, self._pm, self, options.optimizer,
                            self._live, options.raise_on)
        self._started = ""
        self._early = EarlyNames(options.named)
        self._disabled = disabled()
        refuse_at_watch(self._pm, model, options)

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Watcher:
        hooks = self._hooks
        if hooks.active:
            raise WatcherStateError("this Watcher is already active (in a `with` block, or "
                                    "started); use one `with` per Watcher, or stop() it first.")
        target = self._model
        if target is None and self._options.params is not None:
            target = next(iter(self._options.params.values()))
        hooks.active = True
        self._started = self._started or now()
        if self._disabled:  # GRADDEBUG_DISABLE (logged once, by configured): attach nothing
            return self
        try:
            if target is not None:
                adapter = self._attach(target)
                if self._options.optimizer is not None:
                    follow(adapter, self._options.optimizer, self._steps.by_optimizer)
                if has(adapter, Distributed) and isinstance(adapter, Distributed):
                    self._buffer.distribution = adapter.distribution()
            self._early.start(self.adapter)
            self._buffer.start()
        except BaseException:
            hooks.active = False
            if self.adapter is not None:
                self.adapter.detach()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        adapter = self.adapter
        try:
            # Warnings about gaps would only bury the exception that ends the block.
            with self._hooks.quiet(exc_type is not None):
                if adapter is not None and adapter.has_pending():
                    # A run that ends (or crashes) mid-step keeps what it captured.
                    self._steps.close(None, StepState.CLOSED_BY_USER)
        finally:
            self._hooks.active = False
            if adapter is not None:
                adapter.detach()
            self._buffer.finish(self.findings)
            self._steps.notify(self._pm.hook.graddebug_run_finished, watcher=self)
        if exc_type is None and (error := unmatched_error(
                self._options.named, self.adapter, "during the run")) is not None:
            raise error

    def start(self) -> Watcher:
        """Start watching without ``with`` (notebooks; ``dbg = graddebug.watch(model).start()``):
        the same as entering the block. Returns this Watcher.

        Raises:
            WatcherStateError: It was started (or entered) already; call :meth:`stop` first.
        """
        return self.__enter__()

    def stop(self) -> None:
        """Stop watching: the same as leaving the ``with`` block without an exception (hooks
        removed, the run finished).

        Raises:
            WatcherStateError: It was not started, or was stopped already.
            UnknownNameError: A ``keep=``/``intervene=`` name matched no layer and no tap.
        """
        if not self.active:
            raise WatcherStateError("dbg.stop() was called on a Watcher that is not running: "
                                    "start it first (dbg.start() or `with`), and stop it once.")
        self.__exit__(None, None, None)

    def _attach(self, target: object) -> Adapter:
        factory = find_adapter(self._pm, target)
        options = self._options
        refuse_options(factory, options, model=self._model is not None)
        adapter = factory(self._hooks, self._model, options.params, options)
        verify_adapter(type(adapter))
        refuse_options(adapter, options, model=self._model is not None)
        self._steps.serve(adapter)
        adapter.attach()
        return adapter

    # -- where the run stands ---------------------------------------------------------

    @property
    def every(self) -> int:
        """The watch's ``every=``: one step in this many is recorded."""
        return self._options.every

    @property
    def strict(self) -> bool:
        """The watch's ``strict=``: a bug inside a hook raises instead of being recorded."""
        return self._options.strict

    @property
    def tensorboard(self) -> Path | None:
        """The watch's ``tensorboard=`` directory, or None."""
        return self._options.tensorboard

    @property
    def active(self) -> bool:
        """Whether the ``with`` block is running."""
        return self._hooks.active

    @property
    def step_index(self) -> int:
        """Index of the open step, counted from 0."""
        return self._hooks.step

    @property
    def adapter(self) -> Adapter | None:
        """The adapter serving this Watcher (None before a model, a param or a tap chose one).

        Its protocol is :class:`graddebug.adapter.Adapter`; its hooks and buffers are private.
        """
        return self._steps.adapter

    @property
    def distribution(self) -> Distribution:
        """Where this Watcher runs: its rank, the world size and the backend, as the adapter
        found them on entering (rank 0 of 1 in one process, and before entering)."""
        return self._buffer.distribution

    @property
    def step_state(self) -> StepState:
        """Whether the current step is open, or was closed by ``dbg.step()`` or by the
        optimizer with nothing captured since."""
        return self._steps.state

    @property
    def host(self) -> HostSide:
        """What a training callback closing this Watcher's steps says about its host: where
        notice lines go and how the host clips (see :class:`graddebug.adapter.HostSide`)."""
        return self._steps.host

    # -- steps --------------------------------------------------------------------------------

    def step(self, grads: Any = None, *, loss: Any = None) -> StepResult | None:
        """Close the current step: record parameter gradients and move to the next step.

        Call it once per optimizer step, after ``backward()`` (before or after
        ``optimizer.step()``; before ``zero_grad()``).

        A second call with nothing captured since the last one (no backward in between)
        records nothing and warns once: ``p.grad`` still holds the gradients already recorded,
        and recording them again would invent a step. A step with no gradient at all (before
        ``backward()``) warns once, saying so.

        Args:
            grads: Parameter gradients in the order of the watched parameters, for frameworks
                that do not store them on the parameters (TensorFlow; a pytree in JAX). Torch
                reads ``p.grad``. In a ``tf.compat.v1`` graph: what ``session.run`` returned
                for :meth:`fetches`. One number instead (a 0-d tensor or array of any
                framework, a Python or numpy number) is the loss: ``dbg.step(loss)`` is
                ``dbg.step(loss=loss)``.
            loss: The step's loss (a Python number, or a one-element tensor or array of any
                framework; read on recorded steps only, a host transfer), recorded as a
                ``kind="loss"`` row and judged by the ``loss_spike`` rule. Optional: the
                training callbacks pass it themselves.

        Returns:
            The step's records, events and kept gradients; None when ``every=`` skipped it, or
            when nothing arrived since the last ``dbg.step()``.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or after the optimizer given
                to ``watch(optimizer=...)`` has closed the step already.
            GradientCountError: ``grads`` does not line up with the watched parameters: another
                count, or the first entry whose type, shape or dtype is not its parameter's.
            ConfigError: ``loss`` is not one number, or a loss was given twice.
            UnknownNameError: At the first step by which every layer and tap has run, a
                ``keep=``/``intervene=`` name matched none of them.
            FindingError: The step brought a finding of an issue in ``raise_on=``.
        """
        if not self.active:
            raise WatcherStateError(
                "step() was called outside the `with graddebug.watch(...)` block (or before "
                "dbg.start()); call it inside the block, once per optimizer step.")
        grads, loss = split_loss(grads, loss)
        result = self._steps.by_user(grads, loss)
        if result is not None:
            self._early.after_step(self.adapter, result, self.step_index - 1)
        return result

    def record_loss(self, loss: Any) -> None:
        """Record the loss of the step closed last, for loops and hosts that learn it only
        after the step closed (``watch(optimizer=...)``, Lightning's ``on_train_batch_end``).

        A step that has a loss already keeps it; nothing is recorded before the first close,
        nor for a step that ``every=`` skipped.

        Args:
            loss: As ``step(loss=...)``.

        Raises:
            WatcherStateError: Called outside the ``with`` block.
            ConfigError: ``loss`` is not one number.
        """
        if not self.active:
            raise WatcherStateError(
                "record_loss() was called outside the `with graddebug.watch(...)` block.")
        value = loss_value(loss, "record_loss(loss)")
        if value is None:
            raise ConfigError("record_loss(loss) needs a loss; None records nothing.")
        self._steps.late_loss(value)

    # -- log_dir --------------------------------------------------------------------------

    def _describe(self) -> tuple[dict[str, Any], dict[str, float]]:
        """The run's metadata and thresholds, for its JSON file."""
        settings: dict[str, Any] = {
            "every": self.every, "strict": self.strict,
            "params": list(self._options.params) if self._options.params is not None else None}
        log = self._buffer.log
        if log is not None:
            settings.update(log_dir=str(log.path), flush_every=log.flush_every)
        metadata = run_metadata(adapter=self.adapter.name if self.adapter is not None else None,
                                model=self._model, options=self._options, settings=settings,
                                started=self._started, distribution=self._buffer.distribution)
        return metadata, self.thresholds.as_dict()

    # -- the user's other calls -----------------------------------------------------------

    def tap(
        self,
        tensor: Any,
        name: str,
        *,
        clip_value: float | None = None,
        clip_norm: float | None = None,
        mask: Any = None,
        scale: float | None = None,
    ) -> Any:
        """Record the gradient that reaches ``tensor`` under ``name``, optionally altering it.

        Interventions given here take precedence over ``intervene={name: ...}``. They apply in
        the order mask, scale, clip by value, clip by norm.

        Args:
            tensor: Any tensor of a supported framework that takes part in the loss.
            name: The ``layer`` value of its rows.
            clip_value: Clamp gradient entries to ``[-clip_value, clip_value]``.
            clip_norm: Rescale the gradient to an L2 norm of at most ``clip_norm``.
            mask: Boolean/0-1 tensor broadcasting to the gradient, or ``grad -> grad``.
            scale: Multiply the gradient by this factor.

        Returns:
            The tensor to use downstream.

        Raises:
            WatcherStateError: Called outside the ``with`` block.
            MaskShapeError: ``mask`` does not broadcast to the tensor.
        """
        if not self.active:
            raise WatcherStateError(f"tap(..., {name!r}) was called outside the "
                                    "`with graddebug.watch(...)` block.")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"tap name {name!r} must be a non-empty string.")
        given = Intervention(clip_value=clip_value, clip_norm=clip_norm, mask=mask, scale=scale)
        intervention = given if given.active else self._options.intervene.get(name)
        if self._disabled:
            return tensor
        adapter = self.adapter if self.adapter is not None else self._attach(tensor)
        return adapter.tap(tensor, name, intervention)

    def callback(self, **options: Any) -> Any:
        """Return a training callback bound to this Watcher (a Keras callback for
        ``model.fit``, a Lightning callback for a torch model), which closes a step after each
        batch.

        Args:
            **options: Options of the framework's callback, e.g. ``stop_on=("nonfinite",)``.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or without a model.
            ConfigError: The adapter builds no training callback (it does not declare
                :class:`graddebug.adapter.TrainingCallback`).
        """
        return callback(self.adapter if self.active else None).callback(**options)

    def fetches(self, grads: Any = None) -> Any:
        """What to fetch in a ``tf.compat.v1`` session's ``run`` for the step to be recorded.

        Call it once the graph is built (taps and gradients), and hand what the session
        returned for it to :meth:`step`::

            fetches = dbg.fetches(grads=grads_and_vars)
            out = sess.run({"train": train_op, "dbg": fetches})
            dbg.step(out["dbg"])

        Args:
            grads: The ``params=`` gradients as graph tensors: a list aligned with
                ``params=``, or ``(gradient, variable)`` pairs (``compute_gradients``); None
                for those of the optimizer given to ``watch(optimizer=...)``.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or before a tap or
                ``params=`` chose an adapter.
            ConfigError: The Watcher watches no ``tf.compat.v1`` graph.
        """
        return session_graphs(self.adapter if self.active else None, "fetches").fetches(grads)

    def session_hook(self, grads: Any = None) -> Any:
        """A ``tf.compat.v1.train.SessionRunHook`` for ``MonitoredTrainingSession(hooks=[...])``
        that adds :meth:`fetches` to each ``run`` and closes a step with what it fetched.

        Args and errors: as for :meth:`fetches`.
        """
        adapter = self.adapter if self.active else None
        return session_graphs(adapter, "session_hook").session_hook(grads)

    def train_step(
        self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any, optimizer: Any = None
    ) -> None:
        """Run one forward/backward pass of the watched model and close the step.

        This is what :func:`graddebug.check` repeats; ``loss_fn(model(inputs), *loss_args)``
        is the loss. When the Watcher was given ``optimizer=``, its step closes the step.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or without a model.
            ConfigError: The adapter runs no training steps.
        """
        trainer = train_step(self.adapter if self.active else None)
        before = self.step_index
        grads = trainer.train_step(inputs, loss_args, loss_fn, optimizer)
        if self.step_index == before:
            self._steps.close(grads, StepState.CLOSED_BY_USER)

    def __repr__(self) -> str:
        adapter = self.adapter.name if self.adapter is not None else "none"
        return (f"<Watcher {'active' if self.active else 'inactive'} adapter={adapter} "
                f"step={self.step_index} records={self._buffer.rows}>")
