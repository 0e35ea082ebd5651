"""The adapter protocol: what the framework-free core asks of a framework adapter, and what an
adapter may ask back.

Every adapter implements :class:`Adapter`: install and remove its hooks, tap a tensor, say
whether anything arrived, close a step, and name what it matched. What only some frameworks
can do is a capability of its own, a ``runtime_checkable`` protocol that the Watcher tests
with ``isinstance`` once the adapter is built:

==========================  ===============================================================
:class:`StepClock`          an optimizer's step closes a graddebug step (torch)
:class:`GradientSource`     the optimizer hands over the parameter gradients (Keras)
:class:`Distributed`        the run spans processes or replicas
:class:`CompiledTiers`      compiled graphs learn each step's statistics tier in advance
:class:`ReadAhead`          answering "anything pending?" reads state the close reuses
:class:`Training`           ``graddebug.check``'s train step and a training callback
:class:`SessionGraphs`      graphs run by a session (``tf.compat.v1``): fetches and hooks
==========================  ===============================================================

An adapter receives a :class:`WatchContext`, the side of the Watcher that hooks see. A training
callback receives a :class:`CallbackContext`, the side a training loop sees. Neither is the
Watcher itself, and the user's Watcher shows neither's hook-facing members.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from graddebug.capture.layers import Intervention
from graddebug.config import Thresholds
from graddebug.records import FINDING_DTYPES, Event, Finding, Record

if TYPE_CHECKING:
    import pandas as pd
    import pluggy

__all__ = [
    "Adapter",
    "AdapterFactory",
    "CallbackContext",
    "CompiledTiers",
    "Distributed",
    "Distribution",
    "GradientSource",
    "HostSide",
    "ReadAhead",
    "SessionGraphs",
    "StepClock",
    "StepResult",
    "Training",
    "WatchContext",
    "WatchOptions",
]


@dataclass(frozen=True)
class WatchOptions:
    """The options of ``graddebug.watch`` (and of :class:`~graddebug.capture.watcher.Watcher`),
    validated by the core and read by the Watcher and its adapter. This docstring is where the
    options are documented; ``watch``, the README and the callbacks that take watch options
    point here.

    Attributes:
        params: ``{"W": W, ...}``: tensors (torch) or variables (TF) recorded as parameters,
            for code without a model; None with a model.
        layers: Names, globs (``"encoder.*"``) or layer types to capture; None for the default
            (every leaf module and every module that owns parameters in torch, every leaf
            layer in Keras). With ``ops=True`` it also takes op-site names or globs, kept in
            :attr:`op_sites`.
        keep: Layer or tap names whose full gradients are kept as dense numpy arrays
            (``dbg.tensors(step)``); bfloat16 and float16 gradients as float32.
        keep_steps: How many recorded steps of ``keep=`` gradients are held, the latest (10);
            None holds every step. A warning fires once they pass 1 GiB.
        intervene: ``{name: {"clip_norm": 1.0, "clip_value":, "mask":, "scale":}}``: changes to
            the gradient at a layer output or tap, by name, applied in flight in the order
            mask, scale, clip by value, clip by norm; the rows record ``pre_norm`` too.
        every: Record one step in ``every`` (steps 0, every, 2*every, ...); interventions act
            on every step.
        outputs: Capture the gradient at layer outputs (False records parameters only, the
            cheapest mode).
        param_stats: ``"norm"`` (default) computes only the norm of parameter gradients (one
            fused pass); ``"full"`` adds mean, std and absmax.
        optimizer: The user's optimizer. torch: each of its steps closes a graddebug step, so
            the loop needs no ``dbg.step()``. Keras: the gradients it applies are recorded, so
            ``dbg.step()`` needs none.
        scaler: The loss scaler of mixed-precision training (``torch.amp.GradScaler``), or
            None: statistics are divided by its scale, and the steps it skips on overflow are
            marked (``skipped_step`` events, an ``overflow`` finding), not taken for NaN
            faults. Keras needs none: a ``LossScaleOptimizer`` is found through the model's or
            ``optimizer=``'s optimizer.
        thresholds: The diagnoses' thresholds (given as a :class:`graddebug.Thresholds` or a
            dict of overrides).
        strict: Raise on a bug inside a graddebug hook instead of recording it as an
            ``internal_error`` finding.
        log_dir: A new (or empty) directory to stream the run to while it trains (Parquet
            parts and a JSON file; :func:`graddebug.load` reads it, also after a crash). Only
            rows not yet written stay in memory; ``frame()`` reads the run back.
        flush_every: With ``log_dir``, write a part every this many recorded steps (and at
            least every 30 s).
        plugin_manager: The pluggy manager whose adapters and detectors serve the Watcher;
            None for the process-wide one (built-in plugins and installed entry points).
        tensorboard: A directory to stream TensorBoard event files to while it trains
            (per-tensor norms as scalars, norms over layers as histograms); needs
            ``pip install graddebug[tensorboard]``.
        ops: Op-level capture on every recorded step: the operation and source line behind
            NaN/Inf and cut graphs (the ``source`` column of ``nonfinite`` and ``cut_graph``
            findings); torch also records the gradient at the output of every operation of the
            forward pass (rows of kind ``"op"``, ``tensor`` the op site
            ``<layer>.<op>@<file>:<line>``). ``layers=``, ``keep=`` and ``intervene=`` then
            also take op-site names or globs (``"block.torch.log@*"``).
        escalate: Op-level capture for one recorded step only, the one after a layer-level
            ``nonfinite`` or ``cut_graph`` finding (once per issue and layer;
            :attr:`WatchContext.capture_ops` says when), so that a recurring problem gets its
            source line without paying for ``ops=True`` on every step.
        full_stats_every: One recorded step in this many (10) measures the per-unit extremes
            of layer-output gradients (``absmax``, ``zero_frac``); so do the step after a
            NaN/Inf or a 10x jump in a layer output's norm, and every recorded step when
            ``every`` > 1. The others leave those two columns NaN; 1 measures everything on
            every recorded step. See :mod:`graddebug.capture.tiers` (the Watcher decides,
            :attr:`WatchContext.full_stats` tells the adapter).
        op_sites: The op-site names or globs that ``layers=`` asks for, besides its layers
            (derived from ``layers=``, not an option of its own).
    """

    layers: Sequence[Any] | None = None
    keep: frozenset[str] = frozenset()
    intervene: Mapping[str, Intervention] = field(default_factory=dict)
    outputs: bool = True
    param_stats: Literal["norm", "full"] = "norm"
    optimizer: Any = None
    every: int = 1
    scaler: Any = None
    ops: bool = False
    escalate: bool = False
    op_sites: frozenset[str] = frozenset()
    full_stats_every: int = 10
    params: Mapping[str, Any] | None = None
    keep_steps: int | None = 10
    thresholds: Thresholds = field(default_factory=Thresholds)
    strict: bool = False
    log_dir: str | os.PathLike[str] | None = None
    flush_every: int = 100
    plugin_manager: pluggy.PluginManager | None = None
    tensorboard: Path | None = None

    @property
    def named(self) -> set[str]:
        """The names that ``keep=`` and ``intervene=`` ask for, and the op sites ``layers=``
        asks for: each must match something by the end of the run."""
        return set(self.keep) | set(self.intervene) | set(self.op_sites)


@dataclass(frozen=True)
class Distribution:
    """Where a Watcher runs among the processes of a distributed run.

    Attributes:
        rank: This process's rank (``torch.distributed.get_rank()``); 0 in one process. Rows
            of replicas inside one process (``tf.distribute``) carry their replica's index
            themselves.
        world_size: Number of ranks, or of replicas in one process; 1 when not distributed.
        backend: The process group's backend (``"nccl"``, ``"gloo"``) or the strategy's
            class name; ``""`` when not distributed.
        processes: Number of processes that write the run's files, when that is not
            ``world_size`` (1 for the replicas of one process); None otherwise.
    """

    rank: int = 0
    world_size: int = 1
    backend: str = ""
    processes: int | None = None

    @property
    def writers(self) -> int:
        """Number of processes that write the run's files."""
        return self.world_size if self.processes is None else self.processes


@dataclass
class HostSide:
    """What a training callback tells the Watcher about its host, for the steps it closes
    (:attr:`CallbackContext.host`): a callback knows where its host's log lines go and how the
    host clips the gradients after the step closed, which the Watcher does not.

    Attributes:
        notify: Where notice lines go instead of the ``graddebug`` logger (the host's logger);
            None for that logger.
        amend: Applied to each recorded step's rows before they are stored and diagnosed
            (the host's clip filling ``clipped_norm``, :mod:`graddebug.integrations.clipping`);
            None leaves them as the adapter made them.
        findings: Called with each recorded step's new findings (the callbacks count them for
            their logs), or None.
    """

    notify: Callable[[str], None] | None = None
    amend: Callable[[list[Record]], list[Record]] | None = None
    findings: Callable[[Sequence[Finding]], None] | None = None


@dataclass
class StepResult:
    """What a recorded step produced: ``Watcher.step()`` returns it (None for a step that
    ``every=`` skipped), and training callbacks read it."""

    records: list[Record] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    kept: dict[str, np.ndarray] = field(default_factory=dict)
    diagnose: Callable[[], pd.DataFrame] | None = field(default=None, repr=False,
                                                        compare=False)
    """Set by the Watcher on the steps it returns: what :attr:`findings` calls. Adapters leave
    it None."""

    @property
    def findings(self) -> pd.DataFrame:
        """The findings this step brought: those first seen when it closed, in the columns of
        ``Watcher.findings()``. Diagnosed when first read, so that a loop that never asks pays
        only for the history rules; empty on a result no Watcher returned."""
        if self.diagnose is None:
            import pandas as pd

            return pd.DataFrame({name: pd.Series(dtype=dtype)
                                 for name, dtype in FINDING_DTYPES.items()})
        return self.diagnose()


@runtime_checkable
class CallbackContext(Protocol):
    """What a training callback (Keras, Lightning, the HF Trainer) and a run subscriber (the
    ``graddebug_step_recorded`` hook) may ask of the Watcher: the user-facing side of a run."""

    @property
    def active(self) -> bool:
        """Whether the ``with`` block is running."""

    @property
    def step_index(self) -> int:
        """Index of the open step."""

    @property
    def distribution(self) -> Distribution:
        """This process's rank, the world size and the backend (known once entered)."""

    def step(self, grads: Sequence[Any] | None = None, *, loss: Any = None
             ) -> StepResult | None:
        """Close the open step, with the step's loss where the host knows it; return its
        result, or None when it was not recorded."""

    def record_loss(self, loss: Any) -> None:
        """Record the loss of the step closed last (hosts that learn it after the close)."""

    def findings(self) -> pd.DataFrame:
        """The findings so far (callbacks that stop training on a finding read them)."""

    @property
    def host(self) -> HostSide:
        """What a training callback says about its host (its logger, its clip)."""


class WatchContext(Protocol):
    """What an adapter's hooks may ask of the Watcher that owns them."""

    @property
    def active(self) -> bool:
        """Whether the ``with`` block is running."""

    @property
    def recording(self) -> bool:
        """Whether the current step is recorded (``every=`` skips the others)."""

    @property
    def capture_ops(self) -> bool:
        """Whether op-level capture runs in the open step: on every recorded step with
        ``ops=True``; with ``escalate=True``, on the recorded step after a layer-level
        ``nonfinite`` or ``cut_graph`` finding."""

    @property
    def full_stats(self) -> bool:
        """Whether the open recorded step measures every statistic of layer-output gradients;
        otherwise their sentinel only (sum of squares and sum; ``absmax`` and ``zero_frac``
        NaN). See :mod:`graddebug.capture.tiers`."""

    @property
    def step_index(self) -> int:
        """Index of the open step."""

    @property
    def watcher(self) -> CallbackContext:
        """The user-facing side of the Watcher, for the training callbacks an adapter builds
        and for session hooks that close steps."""

    def internal_error(self, exc: BaseException, where: str) -> None:
        """Report a bug caught inside a hook: record it, or raise when ``strict=True``."""

    def warn_once(self, key: str, message: str) -> None:
        """Warn (a ``GradDebugWarning``) once per ``key``: for gaps in the records that are
        neither bugs nor the user's errors, such as tensors a hook has to skip."""


class Adapter(Protocol):
    """One framework's implementation of capture and intervention: what every adapter does.

    The Watcher calls ``attach`` on entering the ``with`` block and ``detach`` on leaving it,
    exceptions included. Between them the adapter's hooks record into its own per-step buffers
    and ``close_step`` turns them into records, with at most one host sync. What only some
    frameworks can do is one of the capability protocols of this module.
    """

    name: str

    def attach(self) -> None:
        """Install hooks. Raise a typed error for names that match nothing."""

    def detach(self) -> None:
        """Remove every hook and restore everything that was changed."""

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Record (and optionally alter) the gradient that reaches ``tensor``; return the
        tensor to use downstream."""

    def has_pending(self) -> bool:
        """Whether gradients were captured, or an optimizer stepped, in the open step."""

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Close the open step: gather statistics if ``record``, and clear per-step state.

        Args:
            step: Index of the step being closed.
            grads: Parameter gradients the user handed to ``Watcher.step``, aligned with the
                watched parameters; None to read them from the parameters themselves.
            record: False for steps that ``every=`` skips.
        """

    def matched_names(self) -> set[str]:
        """Names from ``keep=`` and ``intervene=`` that matched a layer or a tap so far."""

    def known_names(self) -> list[str]:
        """Every layer and tap name seen so far, for suggestions in error messages."""


@runtime_checkable
class StepClock(Protocol):
    """Capability: each step of the user's optimizer closes a graddebug step (torch's step
    post-hooks), so that ``watch(optimizer=...)`` needs no ``dbg.step()``."""

    def follow_optimizer(self, optimizer: Any, on_step: Callable[[], None]) -> None:
        """Call ``on_step`` after each step of ``optimizer``, until ``detach``.

        Raises:
            ConfigError: ``optimizer`` is not an optimizer of this framework, or holds none of
                the watched parameters.
        """


@runtime_checkable
class GradientSource(Protocol):
    """Capability: the parameter gradients come from the optimizer that applies them, where the
    framework keeps none on the parameters (Keras's ``optimizer.apply``)."""

    def take_gradients(self, optimizer: Any) -> None:
        """Record the gradients ``optimizer`` applies from now until ``detach``; binding the
        same optimizer twice changes nothing.

        Raises:
            ConfigError: ``optimizer`` is not an optimizer of this framework.
        """


@runtime_checkable
class Distributed(Protocol):
    """Capability: the run may span processes (torch.distributed) or replicas
    (``tf.distribute``); an adapter without it runs in one process."""

    def distribution(self) -> Distribution:
        """This process's rank, the world size and the backend (read on entering)."""


@runtime_checkable
class CompiledTiers(Protocol):
    """Capability: compiled graphs that cannot ask :attr:`WatchContext.full_stats` as they run
    learn the next step's tier in advance (TensorFlow's traced functions)."""

    def next_step_full(self, full: bool) -> None:
        """Say whether the next recorded step measures every statistic of layer outputs
        (called after each recorded step closes, once the Watcher has read its rows)."""


@runtime_checkable
class ReadAhead(Protocol):
    """Capability: answering :meth:`Adapter.has_pending` means reading state, a host transfer
    (TensorFlow's device buffers), which the close that follows may reuse."""

    def pending_for_close(self) -> bool:
        """As :meth:`Adapter.has_pending`; after a True answer the Watcher closes the step at
        once with no gradients handed over, so the adapter may keep what it read for that
        :meth:`Adapter.close_step` (one host transfer, not two)."""


@runtime_checkable
class Training(Protocol):
    """Capability: run a training step for ``graddebug.check``, and build the framework's
    training callback (``dbg.callback()``)."""

    def train_step(
        self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any, optimizer: Any
    ) -> Sequence[Any] | None:
        """Run one forward and backward pass for ``graddebug.check``.

        Computes ``loss_fn(model(inputs), *loss_args)``, back-propagates it, applies
        ``optimizer`` when one is given, and leaves the step open.

        Returns:
            The parameter gradients to hand to ``close_step``, or None where the framework
            stores them on the parameters.
        """

    def callback(self, **options: Any) -> Any:
        """Return the framework's training callback bound to the Watcher (a Keras callback
        for ``model.fit``, a Lightning callback).

        Raises:
            ConfigError: The options are not the callback's.
        """


@runtime_checkable
class SessionGraphs(Protocol):
    """Capability: graphs built first and run by a session (``tf.compat.v1``), whose
    statistics are read through the user's ``session.run``."""

    def fetches(self, grads: Any) -> Any:
        """Return what the user's ``session.run`` must fetch for the step to be recorded;
        ``Watcher.step`` takes back what the session returned for it.

        Args:
            grads: Parameter gradients (graph tensors) aligned with the watched parameters,
                or ``(gradient, variable)`` pairs; None for those already known.
        """

    def session_hook(self, grads: Any) -> Any:
        """Return a session hook that adds :meth:`fetches` to every ``session.run`` and closes
        a step with what it fetched."""


class AdapterFactory(Protocol):
    """Builds an adapter; returned by the ``graddebug_adapter`` hook."""

    def __call__(
        self,
        context: WatchContext,
        model: Any,
        params: Mapping[str, Any] | None,
        options: WatchOptions,
    ) -> Adapter:
        """Build the adapter for ``model`` (may be None) and ``params`` (may be None)."""
