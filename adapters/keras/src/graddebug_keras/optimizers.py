"""Keras optimizers, on every backend: the check that an object is one, how it clips the
gradients it applies, and the instance-level wrap of one of its methods (or of a layer's or a
model's), undone on exit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from graddebug.errors import ConfigError
from graddebug.integrations.clipping import HostClip

__all__ = ["Wrapped", "check_keras_optimizer", "keras_clip"]


def check_keras_optimizer(optimizer: Any) -> None:
    """Check that ``optimizer`` is a Keras optimizer.

    Raises:
        ConfigError: It is not.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            f"optimizer={optimizer!r} is a {type(optimizer).__name__}, not a Keras optimizer; "
            "pass the keras.optimizers.Optimizer that applies the model's gradients (the "
            "model's own, model.optimizer, once compiled).")


def keras_clip(optimizer: Any) -> HostClip | None:
    """How a Keras optimizer clips the gradients it applies (a ``LossScaleOptimizer``'s inner
    optimizer clips), or None where it does not clip by norm (``clipvalue``, or no clip).

    ``clipnorm`` and ``global_clipnorm`` act inside ``optimizer.apply``, after graddebug
    measured the gradients on every backend: the callback hands the rule on to
    :class:`graddebug.integrations.session.CallbackSession`, which fills ``clipped_norm``.
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        optimizer = inner
    clipnorm = getattr(optimizer, "clipnorm", None)
    if clipnorm and clipnorm > 0:
        return HostClip(float(clipnorm), "each")
    global_clipnorm = getattr(optimizer, "global_clipnorm", None)
    if global_clipnorm and global_clipnorm > 0:
        return HostClip(float(global_clipnorm), "total")
    return None


class Wrapped:
    """``obj.attr`` replaced on the instance by ``wrap(original)`` until :meth:`restore`.

    The replacement is set with ``object.__setattr__``, past Keras's attribute tracking, and
    restore removes it again (or puts back an attribute the instance had of its own).

    Args:
        obj: The object (a Keras optimizer or layer).
        attr: The method's name.
        wrap: Builds the replacement from the original bound method.
    """

    def __init__(self, obj: Any, attr: str, wrap: Callable[[Callable[..., Any]],
                                                          Callable[..., Any]]) -> None:
        self.obj, self.attr = obj, attr
        self._had = attr in vars(obj)
        self._old = vars(obj).get(attr)
        object.__setattr__(obj, attr, wrap(getattr(obj, attr)))

    def restore(self) -> None:
        """Put the original back."""
        if self._had:
            object.__setattr__(self.obj, self.attr, self._old)
        elif self.attr in vars(self.obj):
            object.__delattr__(self.obj, self.attr)
