"""Mixed precision: the ``torch.amp.GradScaler`` given to ``watch(scaler=...)``.

Under a loss scaler every gradient of a backward pass is multiplied by the scale, and the
scaler divides the parameter gradients in place (``unscale_``, called by ``scaler.step`` or by
the user before clipping). Activation gradients are captured during backward, so they always
carry the scale; parameter gradients carry it until ``unscale_``. The statistics of one step
are divided by the scale ``scaler.scale()`` applied to that step's loss: activation rows always,
parameter rows whose gradients were still scaled when the step closed. ``zero_frac`` and the
NaN/Inf flags do not depend on the scale.

A step whose scaled gradients overflowed (the scaler found Inf or NaN, skipped the optimizer
step and lowered the scale) gets one ``skipped_step`` event. ``scaler.step`` does not call
``optimizer.step()`` then, so under ``watch(optimizer=...)`` the step is closed by
``scaler.step`` itself and the step count stays that of ``scaler.step`` calls.

The instance's ``scale``, ``unscale_``, ``step`` and ``update`` are wrapped while the Watcher is
active (instance attributes, removed on exit) to see which backward pass and which gradients
each call belongs to. Nothing is read from the device in them: the scale and the scaler's
Inf/NaN verdict are copied to the host asynchronously when the step closes, and read after the
step's single host sync.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from graddebug.adapter import StepResult
from graddebug.capture.layers import FailOpen, keep_label
from graddebug.errors import ConfigError
from graddebug.records import Event, EventKind, Kind, Record

__all__ = ["LossScaling", "check_scaler", "is_grad_scaler"]

_PARAMETER = Kind.PARAMETER.value
_SKIPPED = EventKind.SKIPPED_STEP.value


def _scaler_types() -> tuple[type, ...]:
    """``torch.amp.GradScaler`` (torch 2.3+; ``torch.cuda.amp.GradScaler`` derives from it)
    and, on older torch, ``torch.cuda.amp.GradScaler``."""
    found = [getattr(torch.amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None)]
    return tuple(t for t in found if isinstance(t, type))


def is_grad_scaler(value: Any) -> bool:
    """Whether ``value`` is a ``torch.amp.GradScaler`` (``ShardedGradScaler`` included)."""
    return isinstance(value, _scaler_types())


def check_scaler(scaler: Any) -> Any:
    """Check ``watch(scaler=...)``.

    Returns:
        The scaler when it scales, None when it is None or disabled (``enabled=False``, or a
        CUDA scaler without CUDA): statistics are then recorded as they are.

    Raises:
        ConfigError: ``scaler`` is not a ``torch.amp.GradScaler``.
    """
    if scaler is None:
        return None
    if not is_grad_scaler(scaler):
        raise ConfigError(
            f"scaler= got a {type(scaler).__name__}, not a torch.amp.GradScaler; pass "
            "the GradScaler whose scale(loss) the loop back-propagates, e.g. "
            "watch(model, scaler=torch.amp.GradScaler('cuda'))."
        )
    checked: Any = scaler
    return checked if checked.is_enabled() else None


def _param_ids(optimizer: Any) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


@dataclass
class _Pass:
    """What the scaler did between two step closes, for the gradients of one backward pass
    (or of several, under gradient accumulation).

    A pass starts when a step closes, and again at the first ``scale()`` after an ``update()``:
    an ``update()`` that comes after the step closed (``dbg.step()`` right after backward)
    belongs to no open step.
    """

    scale: Tensor | None = None
    """A copy of the scale at the pass's first ``scale()``; None while nothing was scaled."""
    found: Tensor | None = None
    """The scaler's combined Inf/NaN flag, kept by ``update()``, which clears its own."""
    updated: bool = False
    unscaled: set[int] = field(default_factory=set)
    """Parameters (by ``id``) whose gradients ``unscale_`` divided in place."""
    unscaled_optimizers: set[int] = field(default_factory=set)
    self_unscaled: set[int] = field(default_factory=set)
    """Parameters of fused optimizers (``_step_supports_amp_scaling``), which divide their
    gradients in place inside ``step()`` unless the step is skipped."""


class _HostCopy:
    """The scale and the Inf/NaN flag of a closing step, copied to the host without a sync.

    On CUDA the copy goes to pinned memory, queued before the step's statistics, so the step's
    single sync completes it. On the CPU the values are on the host already.
    """

    def __init__(self) -> None:
        self._kind = ""
        self._tensor: Tensor | None = None
        self._array: np.ndarray | None = None  # the values, or a view of ``_tensor``
        self._event: Any = None

    def put(self, values: Tensor) -> None:
        """Queue a copy of ``values`` (2 float32 entries)."""
        kind = values.device.type
        self._event = None
        if kind == "cuda":
            if self._kind != kind or self._tensor is None:
                self._tensor = torch.zeros(2, dtype=torch.float32, pin_memory=True)
                self._array = self._tensor.numpy()
            self._tensor.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        elif kind == "cpu":
            if self._kind != kind or self._tensor is None:
                self._array = np.zeros(2, np.float32)
                self._tensor = torch.from_numpy(self._array)
            self._tensor.copy_(values)
        else:  # other devices: a plain copy, which waits for the device
            self._array = values.to("cpu").numpy()
            self._tensor = None
        self._kind = kind

    def get(self) -> tuple[float, float]:
        """The values put last; waits only if the step's sync has not completed the copy."""
        if self._event is not None:
            self._event.synchronize()
        assert self._array is not None
        return float(self._array[0]), float(self._array[1])


@dataclass
class _Reading:
    """What one closing step needs from the scaler, taken before its statistics are fetched."""

    host: _HostCopy | None
    checked: bool
    """The scaler had checked the gradients for Inf/NaN when the step closed."""
    unscaled: frozenset[tuple[str, str]]
    """Parameters (``(layer, tensor)``) whose gradients the scaler had divided already."""
    self_unscaled: frozenset[tuple[str, str]]
    """Parameters that a fused optimizer divided, unless it skipped the step."""

    def unscale(self, step: int, result: StepResult) -> StepResult:
        """Divide ``result``'s statistics by the scale and mark a skipped step.

        Args:
            step: The step's index.
            result: What the step recorded, with the scale in its values.

        Returns:
            ``result``, changed in place.
        """
        if self.host is None or not result.records:
            return result  # nothing scaled, or no backward in this step
        scale, found = self.host.get()
        if self.checked:
            skipped = found > 0
        else:  # closed before the scaler looked: judged by its rule, on the same gradients
            skipped = any(r.kind == _PARAMETER and (r.nan or r.inf) for r in result.records)
        unscaled = self.unscaled if skipped else self.unscaled | self.self_unscaled
        if math.isfinite(scale) and scale > 0 and scale != 1:
            result.records[:] = [r if r.kind == _PARAMETER and (r.layer, r.tensor) in unscaled
                                 else _divided(r, scale) for r in result.records]
            if result.kept:
                exempt = {keep_label(layer, tensor) for layer, tensor in unscaled}
                for label, array in result.kept.items():
                    if label not in exempt and array.dtype.kind == "f":
                        np.divide(array, scale, out=array)
        if skipped:
            result.events.append(Event(step, "", "", -1, _SKIPPED, f"scale={scale!r}"))
        return result


def _divided(r: Record, scale: float) -> Record:
    """``r`` with norm, mean, std, absmax and pre_norm divided by ``scale``."""
    return tuple.__new__(Record, (*r[:7], r.norm / scale, r.mean / scale, r.std / scale,
                                  r.absmax / scale, r.zero_frac, r.nan, r.inf,
                                  r.pre_norm / scale, *r[15:]))


_NOTHING = _Reading(None, False, frozenset(), frozenset())


class LossScaling:
    """The loss scaler of one Watcher (a no-op without one).

    Args:
        scaler: The ``watch(scaler=...)`` value.
        params: The watched parameters, as ``(layer, tensor, tensor object)``.
        guard: The fail-open guard of the wrappers' own bookkeeping.

    Raises:
        ConfigError: ``scaler`` is not a ``torch.amp.GradScaler``.
    """

    def __init__(self, scaler: Any, params: Sequence[tuple[str, str, Tensor]],
                 guard: FailOpen) -> None:
        self._scaler = check_scaler(scaler)
        self._keys = {id(t): (layer, name) for layer, name, t in params}
        self._guard = guard
        self._pass = _Pass()
        self._host = _HostCopy()
        self._patched: list[tuple[str, Any, Any]] = []  # (name, wrapper, what it shadowed)
        self._bound: Any = None
        self._on_step: Callable[[], None] | None = None
        self._stepped = False

    @property
    def active(self) -> bool:
        """Whether a scaler is followed."""
        return bool(self._patched)

    # -- set-up ------------------------------------------------------------------------------

    def attach(self) -> None:
        """Wrap the scaler's ``scale``, ``unscale_``, ``step`` and ``update``."""
        scaler = self._scaler
        if scaler is None:
            return
        own = vars(scaler)
        wrappers = {"scale": self._scale, "unscale_": self._unscale, "step": self._step,
                    "update": self._update}
        for name, method in wrappers.items():
            original = getattr(scaler, name)
            wrapper = functools.wraps(original)(functools.partial(method, original))
            self._patched.append((name, wrapper, own.get(name)))
            setattr(scaler, name, wrapper)

    def follow(self, optimizer: Any, on_step: Callable[[], None]) -> Callable[[], None]:
        """Close the steps that ``scaler.step(optimizer)`` skips with ``on_step`` too.

        Returns:
            What the optimizer's step post-hook calls instead of ``on_step``.
        """
        if self._scaler is None:
            return on_step
        self._bound, self._on_step = optimizer, on_step

        def stepped() -> None:
            self._stepped = True
            on_step()

        return stepped

    def detach(self) -> None:
        """Restore the scaler's methods; wrappers that another patch now shadows stay, inert."""
        scaler, patched = self._scaler, self._patched
        self._patched = []
        self._bound = self._on_step = None
        self._pass = _Pass()
        for name, wrapper, shadowed in reversed(patched):
            if vars(scaler).get(name) is not wrapper:
                continue
            if shadowed is None:
                delattr(scaler, name)
            else:
                setattr(scaler, name, shadowed)

    # -- closing a step ----------------------------------------------------------------------

    def read(self) -> _Reading:
        """Queue the host copy of the closing step's scale and Inf/NaN flag; call it before
        the step's statistics are fetched, and :meth:`_Reading.unscale` after."""
        current = self._pass
        if not self.active or current.scale is None:
            return _NOTHING
        with self._guard:
            found = current.found if current.updated else self._found()
            scale = current.scale
            flag = found if found is not None else scale.new_zeros(())
            self._host.put(torch.stack([scale, flag.to(scale.device, torch.float32)]))
            keys = self._keys
            return _Reading(
                self._host, found is not None,
                frozenset(keys[i] for i in current.unscaled if i in keys),
                frozenset(keys[i] for i in current.self_unscaled if i in keys))
        return _NOTHING  # the guard caught a bug: statistics stay as recorded

    def next_pass(self) -> None:
        """A step closed (recorded or not): what the scaler does next belongs to the next."""
        done = self._pass
        if (done.scale is not None or done.found is not None or done.updated or done.unscaled
                or done.unscaled_optimizers or done.self_unscaled):  # else: reused as it is
            self._pass = _Pass()

    def _found(self) -> Tensor | None:
        """The scaler's combined Inf/NaN flag of the optimizers it checked so far, or None."""
        scaler = self._scaler
        states = getattr(scaler, "_per_optimizer_states", {})
        flags = [t for state in states.values() for t in state["found_inf_per_device"].values()]
        if not flags:
            return None
        first: Tensor = flags[0]
        if len(flags) == 1:
            return first
        return torch.stack([t.to(first.device, non_blocking=True) for t in flags]).sum()

    # -- the wrappers --------------------------------------------------------------------------

    def _scale(self, original: Callable[..., Any], outputs: Any) -> Any:
        out = original(outputs)
        with self._guard:
            if self._patched:
                if self._pass.updated:
                    self._pass = _Pass()
                live = getattr(self._scaler, "_scale", None)
                if self._pass.scale is None and live is not None:
                    self._pass.scale = live.detach().clone()
        return out

    def _unscale(self, original: Callable[..., Any], optimizer: Any) -> None:
        original(optimizer)
        with self._guard:
            if self._patched:
                self._pass.unscaled |= _param_ids(optimizer)
                self._pass.unscaled_optimizers.add(id(optimizer))

    def _step(self, original: Callable[..., Any], optimizer: Any, *args: Any,
              **kwargs: Any) -> Any:
        with self._guard:
            current = self._pass
            if (self._patched and getattr(optimizer, "_step_supports_amp_scaling", False)
                    and id(optimizer) not in current.unscaled_optimizers):
                current.self_unscaled |= _param_ids(optimizer)
        self._stepped = False
        out = original(optimizer, *args, **kwargs)
        if (self._patched and optimizer is self._bound and not self._stepped
                and self._on_step is not None):
            self._on_step()  # the scaler skipped optimizer.step(): close the step here
        return out

    def _update(self, original: Callable[..., Any], new_scale: Any = None) -> None:
        with self._guard:
            if self._patched and not self._pass.updated:
                self._pass.found = self._found()
                self._pass.updated = True
        original(new_scale)

