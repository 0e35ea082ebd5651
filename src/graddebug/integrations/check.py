"""One-shot checks: run a few forward/backward steps of a model and return their Report.

This module is imported by ``import graddebug``, so it stays cheap at import time: the Watcher
(and with it pandas) is imported when :func:`check` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from graddebug.errors import ConfigError

if TYPE_CHECKING:
    from graddebug.report.report import Report

__all__ = ["check", "split_batch"]


class _Unset:
    """The default of ``targets=``: no targets were given, so ``batch`` may be a pair."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


def split_batch(batch: Any, targets: Any = _UNSET) -> tuple[Any, tuple[Any, ...]]:
    """Split a batch into the model's input and the extra arguments of the loss function.

    The rule: with ``targets=`` given, ``batch`` is the input as it is, and the loss is
    ``loss_fn(output, targets)``, or ``loss_fn(output)`` for ``targets=None``. Without it, a
    ``tuple`` or ``list`` of exactly two items is ``(inputs, targets)``; anything else (a tensor,
    a dict, a tuple of another length) is the input, and the loss is ``loss_fn(output)``. A model
    whose single input is itself a pair therefore takes ``targets=`` explicitly.

    Args:
        batch: The model's input, or an ``(inputs, targets)`` pair.
        targets: The loss function's second argument; leave it out to apply the rule above.

    Returns:
        ``(inputs, loss_args)``, where the loss is ``loss_fn(model(inputs), *loss_args)``.
    """
    if not isinstance(targets, _Unset):
        return batch, () if targets is None else (targets,)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], (batch[1],)
    return batch, ()


def check(
    model: Any,
    batch: Any,
    loss_fn: Callable[..., Any],
    steps: int = 1,
    *,
    targets: Any = _UNSET,
    optimizer: Any = None,
    **options: Any,
) -> Report:
    """Run ``steps`` forward, backward and recording steps of ``model`` and return the Report.

    Meant for tests and notebooks: ``graddebug.check(model, (x, y), F.cross_entropy)
    .assert_healthy()``. The gradients are zeroed before each step, and the gradients of the
    last step stay on the model, as after a plain ``backward()``.

    Args:
        model: A model a graddebug adapter can watch (a ``torch.nn.Module``, a Keras model, a
            Flax NNX module).
        batch: The model's input, or an ``(inputs, targets)`` pair: a tuple or list of exactly
            two items is taken as the pair unless ``targets=`` is given (see
            :func:`split_batch`).
        loss_fn: Called as ``loss_fn(output)``, or ``loss_fn(output, targets)`` with targets;
            must return a scalar.
        steps: How many steps to run on the same batch.
        targets: The loss function's second argument. When given, ``batch`` is the model's
            input unchanged; ``targets=None`` calls ``loss_fn(output)``.
        optimizer: Applied after each backward pass. Without one, the weights do not change
            and every step sees the same gradients.
        **options: Options of :func:`graddebug.watch` (``layers=``, ``thresholds=``,
            ``outputs=``, ...). ``ops=True`` adds op-level capture: ``nonfinite`` and
            ``cut_graph`` findings then name the operation and its source line.

    Returns:
        The :class:`graddebug.Report` of the run.

    Raises:
        ConfigError: ``steps`` is not a positive int, ``loss_fn`` is not callable, an option is
            unknown or unusable, or ``loss_fn`` does not return a scalar.
        NoAdapterError: No installed adapter watches ``model``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r} must be a positive int (the number of steps to run).")
    if not callable(loss_fn):
        raise ConfigError(
            f"loss_fn={loss_fn!r} is not callable; pass a function called as loss_fn(output) "
            "or loss_fn(output, targets) that returns a scalar loss."
        )
    if model is None:
        raise ConfigError("check() needs a model; for tensors without a model use watch().")
    from graddebug.capture.watcher import Watcher
    from graddebug.integrations.stopping import check_watch_options

    check_watch_options(options, "check()", ("steps", "targets", "optimizer"))
    inputs, loss_args = split_batch(batch, targets)
    with Watcher(model, **options) as dbg:
        for _ in range(steps):
            dbg.train_step(inputs, loss_args, loss_fn, optimizer)
    return dbg.report(metadata={"check": {"steps": steps, "optimizer": optimizer is not None}})
