"""Every hook graddebug calls, in one place. Plugins implement them with ``@graddebug.hookimpl``.

Built-in detectors and adapters are plugins like any other; a third party can add an adapter
(for JAX, say) or a detector by shipping a package with an entry point in the ``graddebug``
group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from graddebug.adapter import AdapterFactory, CallbackContext, StepResult
    from graddebug.config import Thresholds
    from graddebug.detectors import Evidence
    from graddebug.records import Finding

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("graddebug")
hookimpl = pluggy.HookimplMarker("graddebug")


@hookspec(firstresult=True)
def graddebug_adapter(target: object) -> AdapterFactory | None:
    """Claim an object to watch: a model, a tensor or a variable.

    Implemented by framework adapters (``graddebug_torch``, ``graddebug_tensorflow``). An
    implementation must decide by type without importing a framework the user has not imported:
    look the framework up in ``sys.modules`` and return None when it is absent.

    Args:
        target: The model given to ``watch``, else the first value of ``params=``, else the
            first tensor given to ``tap``.

    Returns:
        A callable that builds the adapter (see :class:`graddebug.adapter.AdapterFactory`), or
        None to let another plugin answer. The first non-None answer wins.
    """


@hookspec
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Diagnose recorded gradients.

    Implemented by each detector (``graddebug.detectors.*``) and by third-party detectors.
    Called when ``Watcher.findings()`` needs fresh results, never from a training hook.

    Args:
        evidence: The record frame, the structural events, and helpers to order layers.
        thresholds: The run's thresholds.

    Returns:
        The findings this detector sees; an empty list when the gradients look healthy.
    """


@hookspec(firstresult=True)
def graddebug_demo(steps: int, seed: int) -> object | None:
    """Train the built-in demonstration model under ``watch`` and return its run.

    Implemented by framework adapters (the torch adapter trains a deep sigmoid MLP whose first
    layers get no gradient); ``graddebug demo`` calls it, so that the command line imports no
    adapter. An implementation returns None when its framework is not installed.

    Args:
        steps: Training steps to run.
        seed: Seed of the model and the data.

    Returns:
        The :class:`graddebug.Report` of the run, whose ``metadata["demo"]`` describes the
        model and the data in a sentence; or None to let another plugin answer. (Typed
        ``object`` here: the hook specs sit below the report layer and name none of its
        types.)
    """


@hookspec
def graddebug_step_recorded(watcher: CallbackContext, step: int, result: StepResult) -> None:
    """Receive the records of one recorded step, as soon as the Watcher has stored them.

    Implemented by loggers that stream a run elsewhere while it trains: the built-in
    TensorBoard writer (:mod:`graddebug.integrations.tensorboard`), or a third-party plugin
    for wandb or MLflow. Called once per recorded step (``every=`` skips the others), from the
    code that closes the step (``dbg.step()``, the optimizer given to ``watch``, or a
    training callback), so an implementation should be quick and keep no tensor.

    An exception raised by an implementation fails open, as a bug in graddebug's own hooks
    does: it becomes an ``internal_error`` finding plus one warning, and training goes on
    (``strict=True`` raises it instead). Implementations after the failing one are skipped
    for that step.

    Args:
        watcher: The Watcher that recorded the step (``watcher.tensorboard`` and its other
            public attributes say how it was configured).
        step: The step's index.
        result: The step's records (one :class:`graddebug.records.Record` per tensor), its
            structural events and its kept gradients.
    """


@hookspec
def graddebug_run_finished(watcher: CallbackContext) -> None:
    """Learn that a Watcher's ``with`` block has ended (normally or by an exception).

    Implemented by the same loggers as :func:`graddebug_step_recorded`, to flush and close
    what they opened. Errors fail open in the same way.

    Args:
        watcher: The Watcher whose run ended; its frames and findings stay readable.
    """
