"""The Watcher: a context manager that owns one capture session and its record buffer."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import numpy as np
import pandas as pd
import pluggy

from graddebug.adapter import Adapter, StepResult, WatchOptions
from graddebug.config import Thresholds
from graddebug.errors import (
    ConfigError,
    GradDebugInternalError,
    GradDebugWarning,
    NoAdapterError,
    UnknownNameError,
    WatcherStateError,
    close_matches,
)
from graddebug.frames import event_frame, record_frame, summary_frame
from graddebug.interventions import Intervention, parse_interventions
from graddebug.plugins import get_plugin_manager
from graddebug.records import Event, Finding, Issue, Record, Severity
from graddebug.report import Report, diagnose
from graddebug.runlog import DEFAULT_FLUSH_EVERY, RunWriter, now, run_metadata

__all__ = ["Watcher", "watch"]

# Frameworks graddebug knows how to serve, by top-level module: adapter name and install hint.
_KNOWN_FRAMEWORKS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "pip install graddebug[torch]"),
    "tensorflow": ("tensorflow", "pip install graddebug[tensorflow]"),
    "keras": ("tensorflow", "pip install graddebug[tensorflow]"),
}


class Watcher:
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
        intervene: Mapping[str, Any] | None = None,
        every: int = 1,
        outputs: bool = True,
        param_stats: Literal["norm", "full"] = "norm",
        optimizer: Any = None,
        thresholds: Thresholds | Mapping[str, float] | None = None,
        strict: bool = False,
        log_dir: str | os.PathLike[str] | None = None,
        flush_every: int = DEFAULT_FLUSH_EVERY,
        plugin_manager: pluggy.PluginManager | None = None,
    ) -> None:
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ConfigError(f"flush_every={flush_every!r} must be a positive int (steps).")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"every={every!r} must be a positive int (1 records every step).")
        if param_stats not in ("norm", "full"):
            raise ConfigError(f"param_stats={param_stats!r} must be 'norm' or 'full'.")
        if params is not None and not isinstance(params, Mapping):
            raise ConfigError(
                f"params={params!r} must map names to tensors or variables, "
                'for example params={"W": W, "b": b}.'
            )
        if params is not None and not params:
            raise ConfigError("params={} is empty; pass at least one tensor, or leave it out.")
        self.thresholds = Thresholds.coerce(thresholds)
        self.strict = strict
        self.every = every
        self._model = model
        self._params = params
        self._options = WatchOptions(
            layers=_as_list(layers),
            keep=frozenset(_as_list(keep) or ()),
            intervene=parse_interventions(intervene),
            outputs=outputs,
            param_stats=param_stats,
            optimizer=optimizer,
            every=every,
        )
        self._pm = plugin_manager or get_plugin_manager()
        self._adapter: Adapter | None = None
        self._active = False
        self._step = 0
        self._records: list[Record] = []
        self._events: list[Event] = []
        self._internal: list[Finding] = []
        self._kept: dict[int, dict[str, np.ndarray]] = {}
        self._warned = False
        self._cache: dict[str, pd.DataFrame] = {}
        self._started = ""
        # With log_dir, _records and _events hold only what is not flushed yet.
        self._log = RunWriter(log_dir, flush_every=flush_every) if log_dir is not None else None
        self._flushed_internal = 0

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Watcher:
        if self._active:
            raise WatcherStateError("this Watcher is already active; use one `with` per Watcher.")
        target = self._model
        if target is None and self._params is not None:
            target = next(iter(self._params.values()))
        if target is not None:
            self._adapter = self._build_adapter(target)
            self._adapter.attach()
        self._active = True
        self._started = self._started or now()
        if self._log is not None:
            try:
                self._log.start(self._run_metadata(), self.thresholds.as_dict())
            except BaseException:
                self._active = False
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
            if adapter is not None and adapter.has_pending():
                # A run that ends (or crashes) mid-step keeps what it captured.
                self._close(None)
        finally:
            self._active = False
            if adapter is not None:
                adapter.detach()
            if self._log is not None:
                self._finish_log()
        if exc_type is None:
            self._check_unmatched()

    def _build_adapter(self, target: object) -> Adapter:
        factory = self._pm.hook.graddebug_adapter(target=target)
        if factory is None:
            raise NoAdapterError(self._no_adapter_message(target))
        adapter: Adapter = factory(self, self._model, self._params, self._options)
        return adapter

    def _no_adapter_message(self, target: object) -> str:
        cls = type(target)
        installed = sorted(
            {impl.plugin_name for impl in self._pm.hook.graddebug_adapter.get_hookimpls()}
        )
        missing = sorted(
            {hint for name, hint in _KNOWN_FRAMEWORKS.values() if name not in installed}
        )
        root = cls.__module__.split(".", 1)[0]
        lines = [
            f"graddebug cannot watch an object of type {cls.__module__}.{cls.__qualname__}: "
            "no installed adapter claims it.",
            f"Installed adapters: {', '.join(installed) or 'none'}.",
        ]
        if root in _KNOWN_FRAMEWORKS and _KNOWN_FRAMEWORKS[root][0] not in installed:
            lines.append(f"To watch {root} models: {_KNOWN_FRAMEWORKS[root][1]}")
        elif missing:
            lines.append("Adapters that are not installed: " + "; ".join(missing) + ".")
        lines.append(
            "Pass a model (torch.nn.Module, keras.Model), params={name: tensor}, "
            "or use watch() with tap(tensor, name)."
        )
        return "\n".join(lines)

    def _check_unmatched(self) -> None:
        wanted = set(self._options.keep) | set(self._options.intervene)
        if not wanted:
            return
        adapter = self._adapter
        matched = adapter.matched_names() if adapter is not None else set()
        known = adapter.known_names() if adapter is not None else []
        unmatched = sorted(wanted - matched)
        if unmatched:
            details = "; ".join(f"{n!r}{close_matches(n, known)}" for n in unmatched)
            raise UnknownNameError(
                f"keep=/intervene= names matched no layer and no tap during the run: {details} "
                f"Known names: {', '.join(known[:20]) or 'none'}."
            )

    # -- what adapters see ----------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether the ``with`` block is running."""
        return self._active

    @property
    def recording(self) -> bool:
        """Whether the open step is recorded (``every=N`` records steps 0, N, 2N, ...)."""
        return self._active and self._step % self.every == 0

    @property
    def step_index(self) -> int:
        """Index of the open step, counted from 0."""
        return self._step

    def internal_error(self, exc: BaseException, where: str) -> None:
        """Record a bug caught inside a graddebug hook, or raise it when ``strict=True``.

        Args:
            exc: The exception the hook caught.
            where: Which hook or layer it happened in.

        Raises:
            GradDebugInternalError: ``strict=True`` was given.
        """
        if self.strict:
            raise GradDebugInternalError(f"graddebug hook failed in {where}: {exc!r}") from exc
        self._internal.append(
            Finding(
                step=self._step,
                layer=where,
                tensor="",
                issue=Issue.INTERNAL_ERROR.value,
                severity=Severity.WARNING.value,
                value=math.nan,
                threshold=math.nan,
                message=(
                    f"graddebug failed inside its hook for {where!r} ({type(exc).__name__}: "
                    f"{exc}); training went on untouched but this step's records may be "
                    "incomplete. Please report it; strict=True raises instead."
                ),
            )
        )
        self._cache.clear()
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"graddebug: internal error in {where!r}: {exc!r}. Recorded as an "
                "'internal_error' finding; training continues.",
                GradDebugWarning,
                stacklevel=2,
            )

    # -- the user's calls -------------------------------------------------------------------

    def step(self, grads: Sequence[Any] | None = None) -> None:
        """Close the current step: record parameter gradients and move to the next step.

        Call it once per optimizer step, after ``backward()`` (before or after
        ``optimizer.step()``; before ``zero_grad()``).

        Args:
            grads: Parameter gradients in the order of the watched parameters, for frameworks
                that do not store them on the parameters (TensorFlow). Torch reads ``p.grad``.

        Raises:
            WatcherStateError: Called outside the ``with`` block.
        """
        if not self._active:
            raise WatcherStateError(
                "step() was called outside the `with graddebug.watch(...)` block; "
                "call it inside the block, once per optimizer step."
            )
        self._close(grads)

    def _close(self, grads: Sequence[Any] | None) -> None:
        adapter = self._adapter
        if adapter is not None:
            result = adapter.close_step(self._step, grads, record=self.recording)
            if self.recording:
                self._absorb(result)
        self._step += 1

    def _absorb(self, result: StepResult) -> None:
        self._records.extend(sorted(result.records, key=_row_order))
        self._events.extend(result.events)
        if result.kept:
            self._kept[self._step] = result.kept
        self._cache.clear()
        if self._log is not None and self._log.step_recorded():
            self._flush_log()

    # -- log_dir ------------------------------------------------------------------------------

    def _run_metadata(self) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "every": self.every, "strict": self.strict,
            "params": list(self._params) if self._params is not None else None}
        if self._log is not None:
            settings.update(log_dir=str(self._log.path), flush_every=self._log.flush_every)
        return run_metadata(adapter=self._adapter.name if self._adapter is not None else None,
                            model=self._model, options=self._options, settings=settings,
                            started=self._started)

    def _flush_log(self) -> None:
        assert self._log is not None
        if self._log.parts == 0:  # an adapter chosen by tap() is known by now
            self._log.start(self._run_metadata(), self.thresholds.as_dict())
        internal = self._internal[self._flushed_internal:]
        try:
            self._log.flush(self._records, self._events, internal)
        except Exception as exc:  # a full disk must not stop training: keep the rows, retry
            self.internal_error(exc, f"log_dir {str(self._log.path)!r}")
            return
        self._records, self._events = [], []
        self._flushed_internal += len(internal)
        self._cache.clear()

    def _finish_log(self) -> None:
        assert self._log is not None
        self._flush_log()
        try:
            self._log.finish(self.frame(), self.events(), self.findings(),
                             self._run_metadata(), self.thresholds.as_dict())
        except Exception as exc:
            self.internal_error(exc, f"log_dir {str(self._log.path)!r}")
        # The whole run is on disk; frame() reads it back when asked.
        self._cache.pop("frame", None)
        self._cache.pop("events", None)
        self._log.release()

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
        if not self._active:
            raise WatcherStateError(
                f"tap(..., {name!r}) was called outside the `with graddebug.watch(...)` block."
            )
        if not isinstance(name, str) or not name:
            raise ConfigError(f"tap name {name!r} must be a non-empty string.")
        given = Intervention(clip_value=clip_value, clip_norm=clip_norm, mask=mask, scale=scale)
        intervention = given if given.active else self._options.intervene.get(name)
        if self._adapter is None:
            self._adapter = self._build_adapter(tensor)
            self._adapter.attach()
        return self._adapter.tap(tensor, name, intervention)

    def callback(self, **options: Any) -> Any:
        """Return a training callback bound to this Watcher (a Keras callback for
        ``model.fit``), which closes a step after each batch.

        Args:
            **options: Options of the framework's callback, e.g. ``stop_on=("nonfinite",)``.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or without a model.
            ConfigError: The framework has no such callback.
        """
        if not self._active or self._adapter is None:
            raise WatcherStateError(
                "callback() needs an active Watcher with a model: "
                "`with graddebug.watch(model) as dbg: model.fit(..., callbacks=[dbg.callback()])`."
            )
        return self._adapter.callback(**options)

    def train_step(
        self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any, optimizer: Any = None
    ) -> None:
        """Run one forward/backward pass of the watched model and close the step.

        This is what :func:`graddebug.check` repeats; ``loss_fn(model(inputs), *loss_args)``
        is the loss. When the Watcher was given ``optimizer=``, its step closes the step.

        Raises:
            WatcherStateError: Called outside the ``with`` block, or without a model.
        """
        if not self._active or self._adapter is None:
            raise WatcherStateError("train_step() needs an active Watcher with a model.")
        before = self._step
        grads = self._adapter.train_step(inputs, loss_args, loss_fn, optimizer)
        if self._step == before:
            self._close(grads)

    # -- results -----------------------------------------------------------------------------

    def frame(self) -> pd.DataFrame:
        """Return one row per (step, tensor): the statistics of every recorded gradient.

        Columns, in order: ``step, layer, tensor, kind, depth, shape, numel, norm, mean, std,
        absmax, zero_frac, nan, inf``, plus ``pre_norm`` where an intervention acted.
        """
        if "frame" not in self._cache:
            self._read_frames()
        return self._cache["frame"]

    def events(self) -> pd.DataFrame:
        """Return the structural events: parameters with no gradient, detached outputs, layers
        no gradient reached, outputs that were non-finite in forward."""
        if "events" not in self._cache:
            self._read_frames()
        return self._cache["events"]

    def _read_frames(self) -> None:
        if self._log is not None:
            self._cache["frame"], self._cache["events"] = self._log.read(
                self._records, self._events)
        else:
            self._cache["frame"] = record_frame(self._records)
            self._cache["events"] = event_frame(self._events)

    def findings(self) -> pd.DataFrame:
        """Return one row per diagnosis: ``step, layer, tensor, issue, severity, value,
        threshold, message``. Empty for a healthy model."""
        if "findings" not in self._cache:
            self._cache["findings"] = diagnose(
                self.frame(),
                self.events(),
                self.thresholds,
                extra=self._internal,
                plugin_manager=self._pm,
            )
        return self._cache["findings"]

    def summary(self) -> pd.DataFrame:
        """Return the per-layer aggregate over recorded steps, in depth order."""
        if "summary" not in self._cache:
            self._cache["summary"] = summary_frame(self.frame(), self.findings())
        return self._cache["summary"]

    def report(self, metadata: Mapping[str, Any] | None = None) -> Report:
        """Return the run so far as a :class:`Report`, which outlives the model.

        Args:
            metadata: Extra facts to store with the run.
        """
        return Report(
            self.frame(),
            self.events(),
            self.findings(),
            thresholds=self.thresholds,
            metadata={**self._run_metadata(), **(metadata or {})},
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the run so far to the directory ``path``, for :func:`graddebug.load`.

        The same format as ``watch(log_dir=...)``; see :meth:`graddebug.Report.save`.

        Args:
            path: The run directory to write (a run already there is replaced).

        Returns:
            The run directory.

        Raises:
            RunFileError: ``path`` is a file or a directory that holds something else.
            MissingFrameworkError: pyarrow is missing (``pip install graddebug[report]``).
            WatcherStateError: ``path`` is this Watcher's ``log_dir`` and the block is running.
        """
        if (self._active and self._log is not None
                and Path(path).resolve() == self._log.path.resolve()):
            raise WatcherStateError(
                f"save({str(path)!r}) would replace the log_dir this Watcher is streaming to; "
                "save elsewhere, or load the log_dir once the `with` block has ended."
            )
        return self.report().save(path)

    def tensors(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Return the full gradients kept by ``keep=`` at one step.

        Keys are the layer name for a layer output (``"fc1"``), ``"fc1.output.0"`` for parts of
        tuple outputs, ``"fc1.weight"`` for parameters; a layer called several times in a step
        adds ``"fc1#1"``, ``"fc1#2"``, ...

        Args:
            step: A recorded step; None for the latest step that kept anything.

        Raises:
            WatcherStateError: Nothing was kept (``keep=`` was not given or matched nothing).
            KeyError: ``step`` kept nothing.
        """
        if not self._kept:
            raise WatcherStateError(
                "no gradients were kept; pass keep=['layer', ...] to watch() to keep them."
            )
        if step is None:
            step = max(self._kept)
        if step not in self._kept:
            raise KeyError(f"step {step!r} kept no gradients; steps that did: {sorted(self._kept)}")
        return dict(self._kept[step])

    def __repr__(self) -> str:
        state = "active" if self._active else "inactive"
        adapter = self._adapter.name if self._adapter is not None else "none"
        return (
            f"<Watcher {state} adapter={adapter} step={self._step} records={len(self._records)}>"
        )


def _row_order(record: Record) -> tuple[bool, float, str, str]:
    """Within a step: activations, then parameters; each in forward order."""
    depth = record.depth if record.depth >= 0 else math.inf
    return (record.kind != "activation", depth, record.layer, record.tensor)


def _as_list(value: Any) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, (str, type)):
        return [value]
    return list(value)


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
            - ``keep``: layer or tap names whose full gradients are kept as numpy arrays.
            - ``intervene``: ``{name: {"clip_norm": 1.0, "clip_value":, "mask":, "scale":}}``.
            - ``every``: record one step in ``every``.
            - ``outputs``: False records parameters only.
            - ``param_stats``: ``"norm"`` (default) or ``"full"`` for parameter statistics.
            - ``optimizer``: the optimizer; each of its steps closes a graddebug step, so the
              loop needs no ``dbg.step()``.
            - ``thresholds``: a :class:`Thresholds` or a dict of threshold overrides.
            - ``strict``: raise on a bug inside a hook instead of recording it.
            - ``log_dir``: a new directory to stream the run to while it trains (Parquet parts
              and a JSON file; :func:`graddebug.load` reads it, also after a crash). Only
              rows not yet written stay in memory; ``frame()`` reads the run back.
            - ``flush_every``: with ``log_dir``, write a part every this many recorded steps
              (default 100; also at least every 30 s).
            - ``plugin_manager``: use this pluggy manager instead of the default one.

    Returns:
        A :class:`Watcher`, to be entered with ``with``.

    Raises:
        ConfigError: An option has an unusable value, or ``log_dir`` is not a new directory.
        MissingFrameworkError: ``log_dir`` was given and pyarrow is missing.
        NoAdapterError: (on entering) no installed adapter claims ``model``.
        UnknownNameError: (on entering) a ``layers=`` name matches no layer.
    """
    return Watcher(model, **options)
