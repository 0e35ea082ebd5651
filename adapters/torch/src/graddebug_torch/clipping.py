"""A user's own ``torch.nn.utils.clip_grad_norm_`` between ``backward()`` and the step's close.

The close measures the parameter gradients as it finds them: after such a clip, they are the
clipped ones, and an explosion clipped to a norm of 1.0 no longer looks like one. While the
adapter is attached, ``torch.nn.utils.clip_grad_norm_`` (also reached as
``torch.nn.utils.clip_grad.clip_grad_norm_``) is wrapped: on a recorded step each call keeps
the factor it scaled the gradients by, ``min(1, max_norm / (total + 1e-6))`` as torch computes
it, on the device. The close divides the measured norms by it, so that ``norm`` is the gradient
backward produced, which the diagnoses judge, and ``clipped_norm`` the one the optimizer
applies: no second pass over the gradients, and the factors are read after the step's sync.

A function bound before ``watch`` was entered (``from torch.nn.utils import clip_grad_norm_`` at
the top of a module) is not seen; ``torch.nn.utils.clip_grad_norm_(...)`` at the call is. The
Lightning and Trainer callbacks close their step before their host clips and say how it clips
(:mod:`graddebug.integrations.clipping`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from graddebug.adapter import StepResult, WatchContext
from graddebug.records import Kind, Record
from graddebug_torch.params import TorchParam

__all__ = ["UserClips"]

_PARAMETER = Kind.PARAMETER.value
_EPS = 1e-6  # what clip_grad_norm_ adds to the total norm before dividing
_MODULES = (torch.nn.utils, torch.nn.utils.clip_grad)
_NAME = "clip_grad_norm_"

Key = tuple[str, str]


class UserClips:
    """The clips of the open step, and the wrapper that sees them.

    Args:
        context: The Watcher's side for hooks (is the step recorded).
        params: The watched parameters.
        received: The gradients that arrived in the open step, by index in ``params``.
    """

    def __init__(self, context: WatchContext, params: Sequence[TorchParam],
                 received: Callable[[], Mapping[int, Tensor]]) -> None:
        self._ctx = context
        self._keys = {id(p.param): (i, (p.layer, p.tensor)) for i, p in enumerate(params)}
        self._received = received
        self._pending: list[tuple[list[Key], Tensor]] = []
        self._wrapped: list[tuple[Any, Callable[..., Any], Callable[..., Any]]] = []
        self._attached = False

    def attach(self) -> None:
        """Wrap ``clip_grad_norm_`` where torch exposes it, when there are parameters."""
        if not self._keys:
            return
        self._attached = True
        for module in _MODULES:
            original = getattr(module, _NAME)
            wrapper = functools.wraps(original)(functools.partial(self._clip, original))
            setattr(module, _NAME, wrapper)
            self._wrapped.append((module, original, wrapper))

    def detach(self) -> None:
        """Put the originals back (a wrapper someone set on top of ours stays, and ours under
        it passes every call through)."""
        self._attached = False
        self._pending = []
        for module, original, wrapper in reversed(self._wrapped):
            if getattr(module, _NAME) is wrapper:
                setattr(module, _NAME, original)
        self._wrapped = []

    def _clip(self, original: Callable[..., Tensor], parameters: Any, max_norm: float,
              *args: Any, **kwargs: Any) -> Tensor:
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        total = original(params, max_norm, *args, **kwargs)
        ctx = self._ctx
        if not (self._attached and ctx.active and ctx.recording) or torch.compiler.is_compiling():
            return total
        received = self._received()
        keys = [entry[1] for p in params if p.grad is not None
                and (entry := self._keys.get(id(p))) is not None and entry[0] in received]
        if keys:
            factor = torch.clamp(float(max_norm) / (total.detach() + _EPS), max=1.0)
            self._pending.append((keys, factor))
        return total

    def restore(self, result: StepResult) -> StepResult:
        """``result`` with the parameter rows of the gradients clipped since the last close
        given back their norm before the clip (``norm``, and ``mean``, ``std`` and ``absmax``
        scaled alike) and their norm after it (``clipped_norm``). Called after the step's sync:
        reading the factors waits for nothing."""
        pending, self._pending = self._pending, []
        if not pending:
            return result
        factors: dict[Key, float] = {}
        for keys, factor in pending:
            value = float(factor)
            for key in keys:
                factors[key] = factors.get(key, 1.0) * value  # clipped twice: both factors
        result.records = [_unclipped(r, factors[(r.layer, r.tensor)])
                          if r.kind == _PARAMETER and (r.layer, r.tensor) in factors else r
                          for r in result.records]
        return result


def _unclipped(row: Record, factor: float) -> Record:
    """A parameter row measured after a clip by ``factor``, as it was before, with its norm
    after the clip in ``clipped_norm``."""
    if not factor > 0:  # a NaN total: the clip made the gradients NaN; nothing to undo
        return row._replace(clipped_norm=row.norm)
    return row._replace(norm=row.norm / factor, mean=row.mean / factor,
                        std=row.std / factor, absmax=row.absmax / factor,
                        clipped_norm=row.norm)
