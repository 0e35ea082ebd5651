"""The interface between the framework-free core and a framework adapter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import pandas as pd

from graddebug.interventions import Intervention
from graddebug.records import Event, Record

__all__ = ["Adapter", "AdapterFactory", "StepResult", "WatchContext", "WatchOptions"]


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
    """

    layers: Sequence[Any] | None = None
    keep: frozenset[str] = frozenset()
    intervene: Mapping[str, Intervention] = field(default_factory=dict)
    outputs: bool = True
    param_stats: Literal["norm", "full"] = "norm"
    optimizer: Any = None
    every: int = 1


@dataclass
class StepResult:
    """What an adapter hands back when a recorded step closes."""

    records: list[Record] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    kept: dict[str, np.ndarray] = field(default_factory=dict)


class WatchContext(Protocol):
    """What an adapter may ask of the Watcher that owns it."""

    @property
    def recording(self) -> bool:
        """Whether the current step is recorded (``every=`` skips the others)."""

    @property
    def step_index(self) -> int:
        """Index of the open step."""

    def internal_error(self, exc: BaseException, where: str) -> None:
        """Report a bug caught inside a hook: record it, or raise when ``strict=True``."""

    def step(self, grads: Sequence[Any] | None = None) -> None:
        """Close the open step, as the user's ``Watcher.step`` does (used by optimizer hooks)."""

    def findings(self) -> pd.DataFrame:
        """The findings so far (used by callbacks that stop training on a finding)."""


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

    def has_pending(self) -> bool:
        """Whether gradients were captured in the open step."""

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
        """Return the framework's training callback (a Keras callback for ``model.fit``).

        Raises:
            ConfigError: The framework has no such callback.
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
