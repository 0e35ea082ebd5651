"""Framework-neutral descriptions of what to do to a gradient in flight.

Adapters apply an :class:`Intervention` in a fixed, documented order: mask, then scale, then
clip by value, then clip by norm. Clipping by norm rescales the gradient ``g`` to
``g * min(1, clip_norm / ||g||)``, with no epsilon, so the result can be checked exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from graddebug.errors import ConfigError, close_matches

__all__ = ["Intervention", "parse_interventions"]


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
