"""Framework-neutral descriptions of what to do to a gradient in flight.

Adapters apply an :class:`Intervention` in a fixed, documented order: mask, then scale, then
clip by value, then clip by norm. Clipping by norm rescales the gradient ``g`` to
``g * min(1, clip_norm / ||g||)``, with no epsilon, so the result can be checked exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from graddebug.errors import ConfigError, GradDebugError, MaskShapeError, close_matches

__all__ = ["Intervention", "intervene_fail_open", "parse_interventions"]


@dataclass(frozen=True)
class Intervention:
    """What to do to one gradient before it flows on.

    Attributes:
        clip_value: Clamp every entry to ``[-clip_value, clip_value]``.
        clip_norm: Rescale so that the L2 norm is at most ``clip_norm``.
        mask: A boolean or 0/1 tensor that broadcasts to the gradient (entries where it is
            False/0 are zeroed), or a callable ``grad -> grad`` of the same shape.
        scale: Multiply the gradient by this factor.
    """

    clip_value: float | None = None
    clip_norm: float | None = None
    mask: Any = None
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("clip_value", "clip_norm"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0):
                raise ConfigError(f"{name}={value!r} must be a positive finite number.")
        if self.scale is not None and not _is_number(self.scale):
            raise ConfigError(f"scale={self.scale!r} must be a finite number.")

    @property
    def active(self) -> bool:
        """Whether this intervention changes anything."""
        return any(v is not None for v in (self.clip_value, self.clip_norm, self.mask, self.scale))

    @property
    def mask_is_callable(self) -> bool:
        """Whether ``mask`` is a function of the gradient rather than a tensor."""
        return callable(self.mask)


_FIELDS = ("clip_value", "clip_norm", "mask", "scale")


def _is_number(value: object) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    )


def parse_interventions(spec: Mapping[str, Any] | None) -> dict[str, Intervention]:
    """Validate ``intervene={name: {"clip_norm": 1.0, ...}}`` into Intervention objects.

    Args:
        spec: Mapping from a layer or tap name to a dict of intervention options, or to an
            :class:`Intervention`.

    Returns:
        A dict from name to Intervention.

    Raises:
        ConfigError: The spec is not a mapping, an option is unknown, or a value is unusable.
    """
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"intervene={spec!r} must map layer names to options, "
            'for example {"fc1": {"clip_norm": 1.0}}.'
        )
    out: dict[str, Intervention] = {}
    for name, options in spec.items():
        if isinstance(options, Intervention):
            out[name] = options
            continue
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"intervene[{name!r}]={options!r} must be a dict such as {{'clip_norm': 1.0}}."
            )
        for key in options:
            if key not in _FIELDS:
                raise ConfigError(
                    f"unknown intervention {key!r} for {name!r}.{close_matches(key, _FIELDS)} "
                    f"Known: {', '.join(_FIELDS)}."
                )
        out[name] = Intervention(**dict(options))
    return out


G = TypeVar("G")


def intervene_fail_open(
    spec: Intervention,
    name: str,
    grad: G,
    apply: Callable[[G, Intervention], G],
    fits: Callable[[Any, G], bool],
    on_bug: Callable[[BaseException, str], None],
) -> G:
    """Apply ``spec`` to ``grad`` with the policy every adapter follows.

    A bug of graddebug's lets the gradient flow on unaltered and is handed to ``on_bug``
    (fail-open). A mask callable is the user's code: its exception propagates, and a result
    that does not fit the gradient raises.

    Args:
        spec: The intervention.
        name: The layer or tap, for messages.
        grad: The gradient.
        apply: The framework's implementation, ``apply(grad, spec)``.
        fits: Whether a result has the gradient's type and shape, ``fits(out, grad)``.
        on_bug: Records a bug caught here (``WatchContext.internal_error``).

    Raises:
        MaskShapeError: The mask callable returned something of another shape.
    """
    try:
        out = apply(grad, spec)
    except GradDebugError:
        raise
    except Exception as exc:
        if spec.mask_is_callable:
            raise  # the user's own mask function failed: theirs to see
        on_bug(exc, name)
        return grad
    if not fits(out, grad):
        got = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
        raise MaskShapeError(
            f"the mask callable for {name!r} returned {got} for a gradient of shape "
            f"{tuple(getattr(grad, 'shape', ()))}; it must return a tensor of the same shape."
        )
    return out
