"""A Keras callback that records a graddebug step per batch of ``model.fit``."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import keras

from graddebug.errors import ConfigError
from graddebug.records import EventKind, Issue

if TYPE_CHECKING:
    from graddebug.adapter import WatchContext
    from graddebug_tensorflow.adapter import TensorFlowAdapter

__all__ = ["GradDebugCallback"]

logger = logging.getLogger("graddebug")

_STOPPABLE = (Issue.NONFINITE.value,)


class GradDebugCallback(keras.callbacks.Callback):
    """Closes a graddebug step after every training batch; optionally stops training.

    Get it from the Watcher: ``model.fit(..., callbacks=[dbg.callback()])``. It takes the
    parameter gradients from the model's optimizer, so ``model.fit`` needs no other change.

    Args:
        adapter: The TensorFlow adapter of the active Watcher.
        context: The Watcher.
        stop_on: Issues that stop training (``model.stop_training = True``) at the batch where
            they first appear; ``("nonfinite",)`` is TerminateOnNaN that names the layer.

    Attributes:
        stop_reason: Why training was stopped, naming the layer; None while it was not.
    """

    def __init__(
        self, adapter: TensorFlowAdapter, context: WatchContext, stop_on: Iterable[str] = ()
    ) -> None:
        super().__init__()
        stop = tuple([stop_on] if isinstance(stop_on, str) else stop_on)
        unknown = [s for s in stop if s not in _STOPPABLE]
        if unknown:
            raise ConfigError(
                f"stop_on={stop!r}: {unknown[0]!r} cannot stop training; "
                f"supported: {', '.join(_STOPPABLE)}."
            )
        self._adapter = adapter
        self._context = context
        self.stop_on = stop
        self.stop_reason: str | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Take parameter gradients from the optimizer that ``fit`` uses."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            self._adapter.wrap_optimizer(optimizer)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Close the batch's step; stop training on a finding named in ``stop_on``."""
        step = self._context.step_index
        self._context.step()
        if Issue.NONFINITE.value in self.stop_on and self._nonfinite():
            self.stop_reason = self._reason(step)
            logger.warning("graddebug stopped training at batch %d: %s", batch,
                           self.stop_reason)
            self.model.stop_training = True

    def _nonfinite(self) -> bool:
        result = self._adapter.last_result
        return any(r.nan or r.inf or not math.isfinite(r.norm) for r in result.records) or any(
            e.event == EventKind.FORWARD_NONFINITE.value for e in result.events
        )

    def _reason(self, step: int) -> str:
        findings = self._context.findings()
        rows = findings[(findings["issue"] == Issue.NONFINITE.value) & (findings["step"] == step)]
        if rows.empty:
            return f"a gradient became non-finite at step {step}."
        return str(rows["message"].iloc[0])
