"""The host's gradient clipping, seen from the records: what a training framework's clip makes of
the parameter gradients graddebug measured before it.

The training callbacks close a graddebug step where the gradients are complete and not yet
clipped (see each callback), so ``norm`` is the gradient the backward pass produced, which the
diagnoses judge: an explosion clipped to ``max_grad_norm=1.0`` still looks like one. The host
then clips by a rule it states in its arguments, and this module works out, with no pass over
the gradients, the norm each parameter's gradient has after it: the ``clipped_norm`` column.

- ``"total"``: every gradient is scaled by ``min(1, max_norm / (total + eps))``, where
  ``total`` is the norm of all of them together: ``torch.nn.utils.clip_grad_norm_`` (the
  Trainer's ``max_grad_norm``, Lightning's ``gradient_clip_val``, ``eps = 1e-6``) and Keras
  ``global_clipnorm`` (``eps = 0``).
- ``"each"``: each gradient is scaled by ``max_norm / max(norm, max_norm)``: Keras ``clipnorm``.

Clipping by value (Lightning's ``gradient_clip_algorithm="value"``, Keras ``clipvalue``) cannot
be worked out from norms: ``clipped_norm`` stays NaN there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from graddebug.errors import ConfigError
from graddebug.records import Kind, Record

__all__ = ["HostClip", "clipped"]

_PARAMETER = Kind.PARAMETER.value
_CLIPPED = Record._fields.index("clipped_norm")


@dataclass(frozen=True)
class HostClip:
    """How a host clips the parameter gradients after graddebug measured them.

    Attributes:
        max_norm: The host's limit (``max_grad_norm``, ``gradient_clip_val``, ``clipnorm``).
        rule: ``"total"`` (the norm of all gradients together) or ``"each"`` (each gradient's
            own norm).
        eps: What the host adds to the total before dividing (``1e-6`` in torch).

    Raises:
        ConfigError: ``max_norm`` is not a positive number, or ``rule`` is unknown.
    """

    max_norm: float
    rule: Literal["total", "each"] = "total"
    eps: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_norm, (int, float)) and self.max_norm > 0
                and math.isfinite(self.max_norm)):
            raise ConfigError(
                f"HostClip(max_norm={self.max_norm!r}): the limit must be a positive finite "
                "number; a host that does not clip needs no HostClip."
            )
        if self.rule not in ("total", "each"):
            raise ConfigError(f"HostClip(rule={self.rule!r}): use 'total' or 'each'.")

    def factors(self, norms: Sequence[float]) -> list[float]:
        """The factor the host multiplies each gradient by, from the gradients' norms."""
        if self.rule == "each":
            return [self.max_norm / max(n, self.max_norm) if math.isfinite(n) else math.nan
                    for n in norms]
        total = math.sqrt(math.fsum(n * n for n in norms))
        factor = min(1.0, self.max_norm / (total + self.eps)) if math.isfinite(total) else math.nan
        return [factor] * len(norms)


def clipped(records: list[Record], clip: HostClip) -> list[Record]:
    """``records`` with ``clipped_norm`` filled in on the parameter rows, as ``clip`` leaves
    them (the other rows unchanged, in order).

    Args:
        records: One step's rows, whose parameter rows are the gradients the host clips.
        clip: The host's rule.
    """
    at = [i for i, r in enumerate(records) if r.kind == _PARAMETER]
    if not at:
        return records
    factors = clip.factors([records[i].norm for i in at])
    out = list(records)
    for i, factor in zip(at, factors, strict=True):
        row = records[i]
        out[i] = tuple.__new__(Record, (*row[:_CLIPPED], row.norm * factor,
                                        *row[_CLIPPED + 1:]))
    return out
