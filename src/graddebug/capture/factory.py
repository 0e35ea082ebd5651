"""``graddebug.watch``: the factory of a :class:`~graddebug.capture.watcher.Watcher`, with the
Watcher's own parameters for type checkers and ``help()``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from graddebug.adapter.options import WATCH_OPTIONS, check_option_names
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
        model: A model of a framework whose adapter is installed (a ``torch.nn.Module``, a
            Keras model, a Flax NNX module); None with ``params=`` or for taps only.
        **options: The options of :class:`graddebug.adapter.WatchOptions`, each documented
            there (their names: :data:`graddebug.adapter.options.WATCH_OPTIONS`).

    Returns:
        A :class:`Watcher`, to be entered with ``with`` (or started with ``.start()``).

    Raises:
        ConfigError: An option has an unusable value or an unknown name (with the closest
            known ones: ``evry=`` suggests ``every``), ``log_dir`` is not a new directory,
            or ``ops=True``/``escalate=True`` was given without a model.
        UnsupportedOptionError: An option was set that the adapter of ``model`` (or of the
            first ``params=`` value) does not honour (its ``watch_options``); the message
            names the adapter and what to use instead.
        MissingFrameworkError: ``log_dir`` was given and pyarrow is missing, or
            ``tensorboard`` was given and tensorboardX is missing.
        NoAdapterError: (on entering) no installed adapter claims ``model``.
        UnknownNameError: (on entering) a ``layers=`` name matches no layer.
    """
    check_option_names(options, "watch()", WATCH_OPTIONS)
    return Watcher(model, **options)
