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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from graddebug.capture.layers import Intervention
from graddebug.records import Event, Record

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Adapter",
    "AdapterFactory",
    "CallbackContext",
    "CompiledTiers",
    "Distributed",
    "Distribution",
    "GradientSource",
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
    """The options of one ``watch`` call, validated by the core, read by the adapter.

    Attributes:
        layers: Which layers to capture (names, globs or framework types); None for the default
            (every leaf layer).
        keep: Layer or tap names whose full gradients are kept as numpy arrays.
        intervene: Interventions by layer or tap name.
        outputs: Capture the gradient at layer outputs (False records parameters only).
        param_stats: ``"norm"`` computes only the norm of parameter gradients (one fused pass);
            ``"full"`` adds mean, std and absmax.
        optimizer: The user's optimizer; when given, the adapter closes a step each time the
            optimizer applies gradients (and, in TensorFlow, takes the gradients from it).
        every: Record one step in ``every`` (steps 0, every, 2*every, ...).
        scaler: The user's loss scaler (``torch.amp.GradScaler``), or None. The adapter
            divides recorded statistics by the scale of each backward pass and reports the
            steps the scaler skips (an :attr:`~graddebug.records.EventKind.SKIPPED_STEP`
            event) instead of their overflowed gradients as faults.
        ops: Op-level capture on every recorded step: the gradient at the output of each
            operation of the forward pass (rows of kind ``"op"``), and the op-level events
            that name the operation and source line behind NaN/Inf and cut graphs.
        escalate: Op-level capture on the next recorded step after a layer-level
            ``nonfinite`` or ``cut_graph`` finding (:attr:`WatchContext.capture_ops` says when).
        full_stats_every: One recorded step in this many measures the per-unit extremes of
            layer-output gradients (``absmax``, ``zero_frac``); see
            :mod:`graddebug.capture.tiers` (the Watcher decides, :attr:`WatchContext.full_stats`
            tells the adapter).
        op_sites: Op-site names or globs (``"block.torch.log@*"``) that ``layers=`` asks for,
            besides its layers; op sites are named ``<layer>.<op>@<file>:<line>``.
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
class StepResult:
    """What a recorded step produced: ``Watcher.step()`` returns it (None for a step that
    ``every=`` skipped), and training callbacks read it."""

    records: list[Record] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    kept: dict[str, np.ndarray] = field(default_factory=dict)


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

    def step(self, grads: Sequence[Any] | None = None) -> StepResult | None:
        """Close the open step; return its result, or None when it was not recorded."""

    def findings(self) -> pd.DataFrame:
        """The findings so far (callbacks that stop training on a finding read them)."""


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
