"""The adapter protocol: what the framework-free core asks of a framework adapter, and what an
adapter may ask back.

Every adapter implements :class:`Adapter`: install and remove its hooks, tap a tensor, say
whether anything arrived, close a step, and name what it matched. What only some frameworks
can do is a capability of its own, a ``runtime_checkable`` protocol that the Watcher tests
where the adapter declares it (:mod:`graddebug.adapter.capabilities` checks the
declaration against the class once it is built):

==========================  ===============================================================
:class:`StepClock`          an optimizer's step closes a graddebug step (torch)
:class:`GradientSource`     the optimizer hands over the parameter gradients (Keras)
:class:`Distributed`        the run spans processes or replicas
:class:`CompiledTiers`      compiled graphs learn each step's statistics tier in advance
:class:`ReadAhead`          answering "anything pending?" reads state the close reuses
:class:`TrainStep`          ``graddebug.check``'s train step
:class:`TrainingCallback`   a training callback (``dbg.callback()``)
:class:`SessionGraphs`      graphs run by a session (``tf.compat.v1``): fetches and hooks
==========================  ===============================================================

An adapter receives a :class:`WatchContext`, the side of the Watcher that hooks see. A training
callback receives a :class:`CallbackContext`, the side a training loop sees. Neither is the
Watcher itself, and the user's Watcher shows neither's hook-facing members.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from graddebug.adapter.options import WatchOptions
from graddebug.capture.layers import Intervention
from graddebug.records import FINDING_DTYPES, Event, Finding, Record

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
    "HostSide",
    "ReadAhead",
    "SessionGraphs",
    "StepClock",
    "StepResult",
    "TrainStep",
    "Training",
    "TrainingCallback",
    "WatchContext",
]


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
    peer_events: list[Event] = field(default_factory=list)
    """The events other ranks recorded at this step (:mod:`graddebug.adapter.rankevents`),
    for this process's live findings; each rank writes only its own :attr:`events`."""
    shared: bool = False
    """The records combine every rank already (:mod:`graddebug.adapter.ranks`): each carries
    its own ``rank``, every rank holds the same, and only rank 0 writes them to a run's
    files."""
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
class TrainStep(Protocol):
    """Capability: run a training step for ``graddebug.check`` (and ``dbg.train_step``)."""

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


@runtime_checkable
class TrainingCallback(Protocol):
    """Capability: build the framework's training callback (``dbg.callback()``)."""

    def callback(self, **options: Any) -> Any:
        """Return the framework's training callback bound to the Watcher (a Keras callback
        for ``model.fit``, a Lightning callback).

        Raises:
            ConfigError: The options are not the callback's.
        """


@runtime_checkable
class Training(TrainStep, TrainingCallback, Protocol):
    """Both :class:`TrainStep` and :class:`TrainingCallback`, as one protocol.

    Kept for code written before the two were separate capabilities; an adapter declares the
    two, and the Watcher asks for each on its own.
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
