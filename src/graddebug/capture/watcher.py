"""The Watcher: a context manager that owns one capture session, its adapter, its step states
and its buffer (:mod:`graddebug.capture.buffer`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from enum import Enum
from types import TracebackType
from typing import Any, Literal

import pluggy

from graddebug.adapter import (
    Adapter,
    CompiledTiers,
    Distributed,
    Distribution,
    GradientSource,
    ReadAhead,
    SessionGraphs,
    StepClock,
    StepResult,
    Training,
)
from graddebug.capture.buffer import RunBuffer, gc_paused
from graddebug.capture.context import HookSide
from graddebug.capture.escalation import Escalation
from graddebug.capture.kept import KEEP_STEPS, check_keep_steps
from graddebug.capture.layers import Intervention, is_op_site
from graddebug.capture.metadata import run_metadata
from graddebug.capture.options import build_options, check_tensorboard
from graddebug.capture.results import RunResults
from graddebug.config import Thresholds
from graddebug.errors import (
    ConfigError,
    GradDebugError,
    UnknownNameError,
    WatcherStateError,
    close_matches,
)
from graddebug.plugins import find_adapter, get_plugin_manager
from graddebug.runs.layout import now
from graddebug.runs.writer import DEFAULT_FLUSH_EVERY

__all__ = ["StepState", "Watcher", "watch"]


class StepState(Enum):
    """Where the Watcher stands between two steps."""

    OPEN = "open"
    """Gradients arrived (or nothing was closed yet): the next close records them."""
    CLOSED_BY_USER = "closed_by_user"
    """``dbg.step()`` closed the last step and nothing arrived since."""
    CLOSED_BY_OPTIMIZER = "closed_by_optimizer"
    """The optimizer given to ``watch(optimizer=...)`` closed the last step and nothing
    arrived since."""


class Watcher(RunResults):
    """Captures gradients of a model, of named tensors, or of taps, and diagnoses them.

    Use it as a context manager; see :func:`watch` for the options. Everything it installed is
    removed when the ``with`` block ends, also when the block raised.
    """

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
    ) -> None:
        self._options = build_options(
            params=params, layers=layers, keep=keep, intervene=intervene, every=every,
            outputs=outputs, param_stats=param_stats, optimizer=optimizer,
            flush_every=flush_every, strict=strict, log_dir=log_dir, scaler=scaler, ops=ops,
            escalate=escalate, full_stats_every=full_stats_every)
        if model is None and (self._options.ops or self._options.escalate):
            option = "ops" if self._options.ops else "escalate"
            raise ConfigError(
                f"{option}=True captures the operations of a model's forward pass, and no "
                f"model was given: watch(model, {option}=True). Without a model, tap() the "
                "tensors to watch."
            )
        self.strict = bool(strict)
        self.every = self._options.every
        self.tensorboard = check_tensorboard(tensorboard)
        self._model = model
        self._params = params
        buffer = RunBuffer(log_dir, flush_every, self._describe,
                           lambda exc, where: self._hooks.internal_error(exc, where),
                           keep_steps=check_keep_steps(keep_steps),
                           warn=lambda key, message: self._hooks.warn_once(key, message))
        super().__init__(buffer, Thresholds.coerce(thresholds),
                         plugin_manager or get_plugin_manager())
        self._hooks = HookSide(
            self, buffer, every=self.every, full_stats_every=self._options.full_stats_every,
            escalation=(Escalation(self.thresholds)
                        if self._options.escalate and not self._options.ops else None),
            ops=self._options.ops, strict=self.strict)
        self._adapter: Adapter | None = None
        # The capabilities asked on every step, found once the adapter is built.
        self._read_ahead: ReadAhead | None = None
        self._tiers_sink: CompiledTiers | None = None
        self._closed = StepState.OPEN  # who closed the last step; OPEN before the first
        self._started = ""

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Watcher:
        hooks = self._hooks
        if hooks.active:
            raise WatcherStateError("this Watcher is already active; use one `with` per Watcher.")
        target = self._model
        if target is None and self._params is not None:
            target = next(iter(self._params.values()))
        hooks.active = True
        self._started = self._started or now()
        try:
            if target is not None:
                adapter = self._attach(target)
                if self._options.optimizer is not None:
                    self._follow(adapter, self._options.optimizer)
                if isinstance(adapter, Distributed):
                    self._buffer.distribution = adapter.distribution()
            self._buffer.start()
        except BaseException:
            hooks.active = False
            if self._adapter is not None:
                self._adapter.detach()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        adapter = self._adapter
        try:
            # Warnings about gaps would only bury the exception that ends the block.
            with self._hooks.quiet(exc_type is not None):
                if adapter is not None and adapter.has_pending():
                    # A run that ends (or crashes) mid-step keeps what it captured.
                    self._close(None, StepState.CLOSED_BY_USER)
        finally:
            self._hooks.active = False
            if adapter is not None:
                adapter.detach()
            self._buffer.finish(self.findings)
            self._notify(self._pm.hook.graddebug_run_finished, watcher=self)
        if exc_type is None:
            self._check_unmatched()

    def _attach(self, target: object) -> Adapter:
        factory = find_adapter(self._pm, target)
        adapter = self._adapter = factory(self._hooks, self._model, self._params, self._options)
        self._read_ahead = adapter if isinstance(adapter, ReadAhead) else None
        self._tiers_sink = adapter if isinstance(adapter, CompiledTiers) else None
        adapter.attach()
        return adapter

    def _follow(self, adapter: Adapter, optimizer: Any) -> None:
        """Bind ``watch(optimizer=...)``: its steps close graddebug steps where the adapter
        keeps a step clock, and hand over the gradients where it takes them from there."""
        follows = False
        if isinstance(adapter, GradientSource):
            adapter.take_gradients(optimizer)
            follows = True
        if isinstance(adapter, StepClock):
            adapter.follow_optimizer(optimizer, self._optimizer_stepped)
            follows = True
        if not follows:
            raise ConfigError(
                f"optimizer={type(optimizer).__name__} cannot be followed: the "
                f"{adapter.name or type(adapter).__name__} adapter neither steps with an "
                "optimizer nor takes gradients from one. Drop optimizer= and call dbg.step() "
                "after each optimizer step."
            )

    def _check_unmatched(self) -> None:
        wanted = self._options.named
        if not wanted:
            return
        adapter = self._adapter
        matched = adapter.matched_names() if adapter is not None else set()
        known = adapter.known_names() if adapter is not None else []
        unmatched = sorted(wanted - matched)
        if unmatched:
            details = "; ".join(f"{n!r}{close_matches(n, known)}" for n in unmatched)
            sites = (" Op-site names and globs ('<layer>.<op>@<file>:<line>') match the ops "
                     "of forward passes recorded with ops=True; see the tensor column of the "
                     "frame's op rows." if any(is_op_site(n) for n in unmatched) else "")
            raise UnknownNameError(
                f"keep=/intervene= names matched no layer and no tap during the run: {details} "
                f"Known names: {', '.join(known[:20]) or 'none'}.{sites}"
            )

    # -- where the run stands ---------------------------------------------------------

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
        return self._adapter

    @property
    def distribution(self) -> Distribution:
        """Where this Watcher runs: its rank, the world size and the backend, as the adapter
        found them on entering (rank 0 of 1 in one process, and before entering)."""
        return self._buffer.distribution

    @property
    def step_state(self) -> StepState:
        """Whether the current step is open, or was closed by ``dbg.step()`` or by the
        optimizer with nothing captured since."""
        if self._closed is StepState.OPEN or (
                self._adapter is not None and self._adapter.has_pending()):
            return StepState.OPEN
        return self._closed

    # -- steps --------------------------------------------------------------------------------

    def step(self, grads: Sequence[Any] | None = None) -> StepResult | None:
        """Close the current step: record parameter gradients and move to the next step.

        Call it once per optimizer step, after ``backward()`` (before or after
        ``optimizer.step()``; before ``zero_grad()``).

        A second call with nothing captured since the last one (no backward in between)
        records nothing and warns once: ``p.grad`` still holds the gradients already recorded,
        and recording them again would invent a step.

        Args:
            grads: Parameter gradients in the order of the watched parameters, for frameworks
                that do not store them on the parameters (TensorFlow). Torch reads ``p.grad``.
                In a ``tf.compat.v1`` graph: what ``session.run`` returned for
                :meth:`fetches`.

        Returns:
            The step's records, events and kept gradients; None when ``every=`` skipped it, or
            when nothing arrived since the last ``dbg.step()``.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or after the optimizer given
                to ``watch(optimizer=...)`` has closed the step already.
            GradientCountError: ``grads`` does not line up with the watched parameters: another
                count, or the first entry whose type, shape or dtype is not its parameter's.
        """
        hooks = self._hooks
        if not hooks.active:
            raise WatcherStateError(
                "step() was called outside the `with graddebug.watch(...)` block; "
                "call it inside the block, once per optimizer step."
            )
        # The adapter is asked whether anything arrived only where the answer matters: in
        # TensorFlow it reads the buffers, a host transfer.
        adapter, closed = self._adapter, self._closed
        if closed is StepState.CLOSED_BY_OPTIMIZER and not (
                adapter is not None and adapter.has_pending()):
            optimizer = type(self._options.optimizer).__name__
            raise WatcherStateError(
                f"dbg.step() found no gradient to record: {optimizer}.step() has closed this "
                "step already, as it does each step under watch(optimizer=...). Leave "
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
        return self._close(grads, StepState.CLOSED_BY_USER)

    def _optimizer_stepped(self) -> None:
        """Called by the adapter after each step of the optimizer given to ``watch``: close
        the step, unless ``dbg.step()`` closed it already and nothing arrived since."""
        if self.step_state is StepState.CLOSED_BY_USER:
            self._closed = StepState.CLOSED_BY_OPTIMIZER
            return
        try:
            self._close(None, StepState.CLOSED_BY_OPTIMIZER)
        except GradDebugError:
            raise
        except Exception as exc:  # fail-open: the user's optimizer step has already happened
            self._hooks.internal_error(exc, f"{type(self._options.optimizer).__name__}.step")

    def _pending_for_close(self) -> bool:
        """Whether anything arrived, asked right before a close (see :class:`ReadAhead`)."""
        if self._read_ahead is not None:
            return self._read_ahead.pending_for_close()
        return self._adapter is not None and self._adapter.has_pending()

    def _close(self, grads: Sequence[Any] | None, by: StepState) -> StepResult | None:
        adapter, hooks = self._adapter, self._hooks
        step, recording = hooks.step, hooks.recording
        result = None
        try:
            if adapter is not None:
                with gc_paused():
                    result = adapter.close_step(step, grads, record=recording)
                    if recording:
                        self._buffer.add(step, result)
                        self._pick_tier(result)
                if recording and hooks.escalation is not None:
                    self._escalate(result)
                if recording:
                    self._notify(self._pm.hook.graddebug_step_recorded, watcher=self,
                                 step=step, result=result)
        finally:
            self._closed = by
        hooks.step += 1
        return result if recording else None

    def _pick_tier(self, result: StepResult) -> None:
        """Let the rows of the step just recorded decide the next step's tier, and tell an
        adapter whose compiled graphs learn it in advance."""
        hooks = self._hooks
        try:
            hooks.tiers.after(hooks.step, result)
            if self._tiers_sink is not None:
                self._tiers_sink.next_step_full(hooks.tiers.full(hooks.step + self.every))
        except Exception as exc:  # fail-open: the next steps then keep their tier
            hooks.internal_error(exc, "tiers")

    def _escalate(self, result: StepResult) -> None:
        """Arm op-level capture for the next recorded step after a finding (escalate=True)."""
        hooks = self._hooks
        assert hooks.escalation is not None
        try:
            hooks.escalation.after(hooks.step, result, hooks.step + self.every)
        except GradDebugError:
            raise
        except Exception as exc:  # fail-open: escalation only adds detail
            hooks.internal_error(exc, "escalate")

    def _notify(self, hook: Any, **kwargs: Any) -> None:
        # A subscriber's bug (a third-party logger) must not stop training: fail open.
        try:
            hook(**kwargs)
        except Exception as exc:
            self._hooks.internal_error(exc, f"{hook.name} plugin")

    # -- log_dir --------------------------------------------------------------------------

    def _describe(self) -> tuple[dict[str, Any], dict[str, float]]:
        """The run's metadata and thresholds, for its JSON file."""
        return self._run_metadata(), self.thresholds.as_dict()

    def _run_metadata(self) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "every": self.every, "strict": self.strict,
            "params": list(self._params) if self._params is not None else None}
        log = self._buffer.log
        if log is not None:
            settings.update(log_dir=str(log.path), flush_every=log.flush_every)
        return run_metadata(adapter=self._adapter.name if self._adapter is not None else None,
                            model=self._model, options=self._options, settings=settings,
                            started=self._started, distribution=self._buffer.distribution)

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
            raise WatcherStateError(
                f"tap(..., {name!r}) was called outside the `with graddebug.watch(...)` block."
            )
        if not isinstance(name, str) or not name:
            raise ConfigError(f"tap name {name!r} must be a non-empty string.")
        given = Intervention(clip_value=clip_value, clip_norm=clip_norm, mask=mask, scale=scale)
        intervention = given if given.active else self._options.intervene.get(name)
        adapter = self._adapter if self._adapter is not None else self._attach(tensor)
        return adapter.tap(tensor, name, intervention)

    def callback(self, **options: Any) -> Any:
        """Return a training callback bound to this Watcher (a Keras callback for
        ``model.fit``, a Lightning callback for a torch model), which closes a step after each
        batch.

        Args:
            **options: Options of the framework's callback, e.g. ``stop_on=("nonfinite",)``.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or without a model.
            ConfigError: The framework has no such callback.
        """
        return self._trainer("callback").callback(**options)

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
        return self._graph_adapter("fetches").fetches(grads)

    def session_hook(self, grads: Any = None) -> Any:
        """A ``tf.compat.v1.train.SessionRunHook`` for ``MonitoredTrainingSession(hooks=[...])``
        that adds :meth:`fetches` to each ``run`` and closes a step with what it fetched.

        Args:
            grads: As for :meth:`fetches`.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or before a tap or
                ``params=`` chose an adapter.
            ConfigError: The Watcher watches no ``tf.compat.v1`` graph.
        """
        return self._graph_adapter("session_hook").session_hook(grads)

    def _graph_adapter(self, what: str) -> SessionGraphs:
        adapter = self._adapter
        if not self.active or adapter is None:
            raise WatcherStateError(
                f"{what}() needs an active Watcher that watches a graph: call it inside "
                "`with graddebug.watch(params=...)`, after the graph's taps are built."
            )
        if not isinstance(adapter, SessionGraphs):
            framework = adapter.name or "a framework"
            runs = (f"reads statistics through a tf.compat.v1 Session, and this Watcher "
                    f"watches {framework} code, which runs none" if what == "fetches" else
                    f"is a tf.compat.v1.train.SessionRunHook, and this Watcher watches "
                    f"{framework} code, which runs no session")
            raise ConfigError(f"{what}() {runs}; close each step with dbg.step() instead.")
        return adapter

    def _trainer(self, what: str) -> Training:
        adapter = self._adapter
        if not self.active or adapter is None:
            raise WatcherStateError(
                f"{what}() needs an active Watcher with a model: `with graddebug.watch(model) "
                "as dbg: model.fit(..., callbacks=[dbg.callback()])`."
            )
        if not isinstance(adapter, Training):
            raise ConfigError(
                f"{what}() needs a framework that trains models, and the "
                f"{adapter.name or type(adapter).__name__} adapter has no training loop; "
                "close each step with dbg.step()."
            )
        return adapter

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
        trainer = self._trainer("train_step")
        before = self.step_index
        grads = trainer.train_step(inputs, loss_args, loss_fn, optimizer)
        if self.step_index == before:
            self._close(grads, StepState.CLOSED_BY_USER)

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        adapter = self._adapter.name if self._adapter is not None else "none"
        return (f"<Watcher {state} adapter={adapter} step={self.step_index} "
                f"records={self._buffer.rows}>")


def watch(model: Any = None, **options: Any) -> Watcher:
    """Watch the gradients of a model, of named tensors, or of tapped tensors.

    ``with graddebug.watch(model) as dbg:`` around an existing training loop, with ``dbg.step()``
    after each optimizer step, records gradient statistics of every leaf layer's output and of
    every parameter.

    Args:
        model: A ``torch.nn.Module`` or a Keras model; None with ``params=`` or for taps only.
        **options: Keyword options of :class:`Watcher`:

            - ``params``: ``{"W": W, ...}`` tensors or variables recorded as parameters.
            - ``layers``: names, globs (``"encoder.*"``) or layer types to capture.
            - ``keep``: layer or tap names whose full gradients are kept as numpy arrays
              (dense; half-precision and bfloat16 gradients as float32).
            - ``keep_steps``: how many recorded steps of ``keep=`` gradients are held (default
              10, the latest); None holds every step. A warning fires once they pass 1 GiB.
            - ``intervene``: ``{name: {"clip_norm": 1.0, "clip_value":, "mask":, "scale":}}``.
            - ``every``: record one step in ``every``.
            - ``full_stats_every``: one recorded step in this many (default 10; also
              the step after a NaN/Inf or a 10x jump in a layer output's norm, and every
              recorded step when ``every`` > 1) measures the per-unit extremes of layer-output
              gradients; the others leave ``absmax`` and ``zero_frac`` of those rows NaN. 1
              measures everything on every recorded step.
            - ``outputs``: False records parameters only.
            - ``param_stats``: ``"norm"`` (default) or ``"full"`` for parameter statistics.
            - ``optimizer``: the optimizer; each of its steps closes a graddebug step, so the
              loop needs no ``dbg.step()``.
            - ``scaler``: the loss scaler of mixed-precision training (``torch.amp.GradScaler``):
              statistics are divided by its scale, and the steps it skips on overflow are
              marked (``skipped_step`` events, an ``overflow`` finding), not taken for NaN
              faults. Keras needs none: a ``LossScaleOptimizer`` (the ``mixed_float16``
              policy) is found through the model's or ``optimizer=``'s optimizer.
            - ``thresholds``: a :class:`Thresholds` or a dict of threshold overrides.
            - ``strict``: raise on a bug inside a hook instead of recording it.
            - ``log_dir``: a new directory to stream the run to while it trains (Parquet parts
              and a JSON file; :func:`graddebug.load` reads it, also after a crash). Only
              rows not yet written stay in memory; ``frame()`` reads the run back.
            - ``flush_every``: with ``log_dir``, write a part every this many recorded steps
              (default 100; also at least every 30 s).
            - ``plugin_manager``: use this pluggy manager instead of the default one.
            - ``tensorboard``: a directory to stream TensorBoard event files to while it
              trains (per-tensor norms as scalars, norms over layers as histograms); needs
              ``pip install graddebug[tensorboard]``.
            - ``ops``: op-level capture (torch): also record the gradient at the output of
              every operation of the forward pass (rows of kind ``"op"``, ``layer`` the
              module it ran in, ``tensor`` the op site ``op@file:line``), and name the
              operation and source line of NaN/Inf and cut graphs in ``nonfinite`` and
              ``cut_graph`` findings (their ``source`` column). ``layers=``, ``keep=`` and
              ``intervene=`` then also take op-site names or globs,
              ``"<layer>.<op>@<file>:<line>"`` (``"block.torch.log@*"``). Default False.
            - ``escalate``: op-level capture for one recorded step only, the one after a
              layer-level ``nonfinite`` or ``cut_graph`` finding (once per issue and layer),
              so that a recurring problem gets its source line without paying for ``ops=True``
              on every step. Default False.

    Returns:
        A :class:`Watcher`, to be entered with ``with``.

    Raises:
        ConfigError: An option has an unusable value, ``log_dir`` is not a new directory,
            or ``ops=True``/``escalate=True`` was given without a model.
        MissingFrameworkError: ``log_dir`` was given and pyarrow is missing, or
            ``tensorboard`` was given and tensorboardX is missing.
        NoAdapterError: (on entering) no installed adapter claims ``model``.
        UnknownNameError: (on entering) a ``layers=`` name matches no layer.
    """
    return Watcher(model, **options)
