"""The interface between the framework-free core and a framework adapter, and the base class
that holds what every adapter shares.

The Watcher (:mod:`graddebug.capture.watcher`) talks to an adapter through :class:`Adapter`
only; an adapter talks back through :class:`WatchContext` only. Training callbacks (Keras,
Lightning) use the same two protocols and the :class:`StepResult` that ``Watcher.step()``
returns, never an adapter's private state.

An adapter imports this module, :mod:`graddebug.capture.layers`, :mod:`graddebug.records`, the
errors and the integration helpers, and nothing else of the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import numpy as np

from graddebug.capture.layers import FailOpen, Intervention, LayerSpec
from graddebug.errors import ConfigError
from graddebug.records import Event, Record

if TYPE_CHECKING:
    import pandas as pd

    from graddebug.report.report import Report

__all__ = [
    "Adapter",
    "AdapterFactory",
    "BaseAdapter",
    "Distribution",
    "StepResult",
    "WatchContext",
    "WatchOptions",
]

L = TypeVar("L")


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
            ``nonfinite`` or ``cut_graph`` finding (``WatchContext.capture_ops`` says when).
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


class WatchContext(Protocol):
    """What an adapter, or a training callback, may ask of the Watcher that owns it."""

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
    def adapter(self) -> Adapter | None:
        """The adapter serving the Watcher, once one was chosen."""

    @property
    def distribution(self) -> Distribution:
        """This process's rank, the world size and the backend (known once entered)."""

    def internal_error(self, exc: BaseException, where: str) -> None:
        """Report a bug caught inside a hook: record it, or raise when ``strict=True``."""

    def warn_once(self, key: str, message: str) -> None:
        """Warn (a ``GradDebugWarning``) once per ``key``: for gaps in the records that are
        neither bugs nor the user's errors, such as tensors a hook has to skip."""

    def step(self, grads: Sequence[Any] | None = None) -> StepResult | None:
        """Close the open step; return its result, or None when it was not recorded."""

    def findings(self) -> pd.DataFrame:
        """The findings so far (used by callbacks that stop training on a finding)."""

    def frame(self) -> pd.DataFrame:
        """The record frame so far."""

    def report(self, metadata: Mapping[str, Any] | None = None) -> Report:
        """The run so far, as a Report."""


class Adapter(Protocol):
    """One framework's implementation of capture and intervention.

    The Watcher calls ``attach`` on entering the ``with`` block and ``detach`` on leaving it,
    exceptions included. Between them the adapter's hooks record into its own per-step buffers
    and ``close_step`` turns them into records, with at most one host sync.
    """

    name: str

    def attach(self) -> None:
        """Install hooks. Raise a typed error for names that match nothing."""

    def detach(self) -> None:
        """Remove every hook and restore everything that was changed."""

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Record (and optionally alter) the gradient that reaches ``tensor``; return the
        tensor to use downstream."""

    def has_pending(self, closing: bool = False) -> bool:
        """Whether gradients were captured, or an optimizer stepped, in the open step.

        ``closing``: the Watcher closes the step right after a True answer, with no
        gradients handed over, so an adapter that had to read its state to answer may keep
        what it read for that :meth:`close_step` (one host transfer, not two).
        """

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Close the open step: gather statistics if ``record``, and clear per-step state.

        Args:
            step: Index of the step being closed.
            grads: Parameter gradients the user handed to ``Watcher.step``, aligned with the
                watched parameters; None to read them from the parameters themselves.
            record: False for steps that ``every=`` skips.
        """

    def bind_optimizer(self, optimizer: Any, on_step: Callable[[], None] | None) -> None:
        """Follow ``optimizer``: record the gradients it applies where the framework keeps
        none on the parameters (TensorFlow), and call ``on_step`` after each of its steps
        where the framework can (torch).

        Raises:
            ConfigError: ``optimizer`` is not an optimizer of this framework, or holds none of
                the watched parameters.
        """

    def distribution(self) -> Distribution:
        """This process's rank, the world size and the backend (read on entering)."""

    def next_step_full(self, full: bool) -> None:
        """Say whether the next step measures every statistic of layer outputs (called after
        each recorded step closes, once the Watcher has read its rows; see
        :attr:`WatchContext.full_stats`), for adapters whose compiled graphs cannot ask."""

    def matched_names(self) -> set[str]:
        """Names from ``keep=`` and ``intervene=`` that matched a layer or a tap so far."""

    def known_names(self) -> list[str]:
        """Every layer and tap name seen so far, for suggestions in error messages."""

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
            ConfigError: The framework has no such callback.
        """

    def fetches(self, grads: Any) -> Any:
        """Return what a graph-and-session framework (TF1 graphs) must fetch in the user's
        ``session.run`` for the step to be recorded; ``Watcher.step`` takes back what the
        session returned for it.

        Args:
            grads: Parameter gradients (graph tensors) aligned with the watched parameters,
                or ``(gradient, variable)`` pairs; None for those already known.

        Raises:
            ConfigError: The framework runs no sessions.
        """

    def session_hook(self, grads: Any) -> Any:
        """Return a session hook that adds :meth:`fetches` to every ``session.run`` and closes
        a step with what it fetched.

        Raises:
            ConfigError: The framework runs no sessions.
        """


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


class BaseAdapter:
    """The bookkeeping every adapter shares; subclasses add only what is framework-specific.

    It keeps the watched layers and taps by name (:class:`LayerSpec`), hands out forward-order
    depths, tracks which ``keep=``/``intervene=`` names matched something, and applies the
    fail-open rule.

    Args:
        context: The Watcher.
        options: The validated ``watch`` options.
    """

    name: str = ""
    """The adapter's name (the framework), as run metadata records it."""

    def __init__(self, context: WatchContext, options: WatchOptions) -> None:
        self._ctx = context
        self._options = options
        self._layers: dict[str, LayerSpec] = {}
        self._matched: set[str] = set()
        self._next_depth = 0
        self._guards: dict[str, FailOpen] = {}

    # -- names and depths --------------------------------------------------------------------

    def _take_depth(self) -> int:
        """The next forward-order index."""
        depth = self._next_depth
        self._next_depth += 1
        return depth

    def _add_layers(self, named: Mapping[str, L], selected: Mapping[str, L],
                    channels_first: Callable[[L], bool],
                    keeps_finite: Callable[[L], bool] | None = None) -> dict[str, L]:
        """Register the ``layers=`` selection, plus every layer ``keep=``/``intervene=`` name.

        Args:
            named: Every layer of the model by name.
            selected: The layers ``layers=`` chose.
            channels_first: Whether a layer's outputs put units on axis 1.
            keeps_finite: Whether a layer cannot make a non-finite output from finite inputs,
                so that its forward check can find nothing (None: every layer can).

        Returns:
            The layers to hook, by name.
        """
        options = self._options
        wanted = options.named & named.keys()
        chosen = dict(selected)
        for extra in wanted:
            chosen.setdefault(extra, named[extra])
        for name, layer in chosen.items():
            keep = name in options.keep
            intervention = options.intervene.get(name)
            self._layers[name] = LayerSpec(
                name=name,
                channels_first=channels_first(layer),
                keep=keep,
                intervention=intervention,
                capture=options.outputs or keep or intervention is not None,
                check_forward=keeps_finite is None or not keeps_finite(layer),
            )
        self._matched |= wanted
        return chosen

    def _add_param_keys(self, keys: Iterable[str]) -> None:
        """Register the ``params=`` keys as layers of their own, in the order given."""
        for key in keys:
            self._layers.setdefault(key, LayerSpec(name=key, depth=self._take_depth()))
            if key in self._options.named:
                self._matched.add(key)

    def _tap_layer(self, name: str, intervention: Intervention | None) -> LayerSpec:
        """The layer entry of a tap, created at its first call; ``intervention`` replaces the
        previous one."""
        layer = self._layers.get(name)
        if layer is None:
            layer = self._layers[name] = LayerSpec(name=name, keep=name in self._options.keep)
        if name in self._options.named:
            self._matched.add(name)
        layer.intervention = intervention
        return layer

    def _depth_of(self, chain: Iterable[str]) -> int:
        """The depth of the first layer of ``chain`` (an owner, then its ancestors) that ran
        forward; -1 when none did."""
        for name in chain:
            layer = self._layers.get(name)
            if layer is not None and layer.depth >= 0:
                return layer.depth
        return -1

    def _model_layer_names(self) -> Iterable[str]:
        """Every layer name of the model, watched or not (for suggestions)."""
        return ()

    # -- shared parts of the Adapter protocol ----------------------------------------------

    def matched_names(self) -> set[str]:
        """Names from ``keep=``/``intervene=`` that matched a layer, a param key or a tap."""
        return set(self._matched)

    def known_names(self) -> list[str]:
        """Every watched layer, model layer and tap name."""
        return list(dict.fromkeys([*self._layers, *self._model_layer_names()]))

    def distribution(self) -> Distribution:
        """One process, not distributed (adapters of distributed frameworks override it)."""
        return Distribution()

    def next_step_full(self, full: bool) -> None:
        """Nothing to do where hooks ask :attr:`WatchContext.full_stats` as they run."""

    # -- graphs run by sessions (TF1): only adapters of such graphs override these -------------

    def fetches(self, grads: Any) -> Any:
        """Refuse: only tensors of a ``tf.compat.v1`` graph are read through ``session.run``.

        Raises:
            ConfigError: Always, naming this adapter.
        """
        raise ConfigError(
            f"fetches() reads statistics through a tf.compat.v1 Session, and this Watcher "
            f"watches {self.name or 'a framework'} code, which runs none; close each step with "
            "dbg.step() instead."
        )

    def session_hook(self, grads: Any) -> Any:
        """Refuse: only tensors of a ``tf.compat.v1`` graph are read through ``session.run``.

        Raises:
            ConfigError: Always, naming this adapter.
        """
        raise ConfigError(
            f"session_hook() is a tf.compat.v1.train.SessionRunHook, and this Watcher watches "
            f"{self.name or 'a framework'} code, which runs no session; close each step with "
            "dbg.step() instead."
        )

    def _fail_open(self, where: str) -> FailOpen:
        """``with self._fail_open(layer): ...`` around the body of every hook.

        One guard per ``where``, reused: it holds no state of its own, and hooks run once per
        layer and step, where each allocation adds to the garbage collector's work.
        """
        guard = self._guards.get(where)
        if guard is None:
            guard = self._guards[where] = FailOpen(self._ctx.internal_error, where)
        return guard
