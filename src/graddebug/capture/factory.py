"""``graddebug.watch``: the factory of a :class:`~graddebug.capture.watcher.Watcher`, with the
Watcher's own parameters for type checkers and ``help()``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from graddebug.capture.watcher import Watcher

__all__ = ["watch"]

P = ParamSpec("P")
T = TypeVar("T")


def _signature_of(cls: Callable[P, T]) -> Callable[[Callable[..., T]], Callable[P, T]]:
    """Give the decorated factory the parameters of ``cls``: for type checkers through the
    ParamSpec, and for ``help()`` and ``inspect.signature`` through ``__signature__``."""
    def apply(factory: Callable[..., T]) -> Callable[P, T]:
        signature = inspect.signature(cls).replace(return_annotation=getattr(cls, "__name__", ""))
        factory.__signature__ = signature  # type: ignore[attr-defined]
        return factory
    return apply


@_signature_of(Watcher)
def watch(model: Any = None, **options: Any) -> Watcher:
    """Watch the gradients of a model, of named tensors, or of tapped tensors.

    ``with graddebug.watch(model) as dbg:`` around an existing training loop, with ``dbg.step()``
    after each optimizer step, records gradient statistics of every leaf layer's output and of
    every parameter. The keyword options are those of :class:`Watcher`, each documented once,
    on :class:`graddebug.adapter.WatchOptions`.

    Args:
        model: A ``torch.nn.Module`` or a Keras model; None with ``params=`` or for taps only.
        **options: The options of :class:`graddebug.adapter.WatchOptions` (``params``,
            ``layers``, ``keep``, ``keep_steps``, ``intervene``, ``every``, ``outputs``,
            ``param_stats``, ``optimizer``, ``scaler``, ``thresholds``, ``strict``,
            ``log_dir``, ``flush_every``, ``plugin_manager``, ``tensorboard``, ``ops``,
            ``escalate``, ``full_stats_every``).

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
