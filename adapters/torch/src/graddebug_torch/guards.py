"""What the torch adapter refuses or skips: modules another live Watcher hooks already, tensors
inside ``torch.func`` transforms, and masks on the ``meta`` device. Also which module a live
Watcher hooks under a given ``id``, for the operators of compiled graphs."""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from graddebug.capture.layers import Intervention
from graddebug.errors import ConfigError, WatcherStateError

__all__ = ["FUNCTORCH_WARNING", "ModuleOwners", "check_mask_device", "hooked_module",
           "in_functorch_transform", "transform_running"]

# Every module hooked by a live Watcher, with the id of its ModuleOwners and the watched model's
# class. Process-wide on purpose: two Watchers know nothing of each other otherwise. Weak keys:
# a module that is garbage-collected leaves no entry behind.
_HOOKED: weakref.WeakKeyDictionary[nn.Module, tuple[int, str]] = weakref.WeakKeyDictionary()
# The same modules by id: a compiled graph names a module by its id (graddebug_torch.compiled).
_BY_ID: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()


class ModuleOwners:
    """The modules one adapter hooks, claimed so that no other live Watcher hooks them too.

    A module shared by two watched models would otherwise be recorded by both Watchers,
    whichever model called it.
    """

    def __init__(self) -> None:
        self._claimed: list[nn.Module] = []

    def claim(self, modules: Mapping[str, nn.Module], owner: str) -> None:
        """Claim ``modules`` (by layer name) for the model class ``owner``.

        Raises:
            WatcherStateError: One of them is hooked by another live Watcher; nothing is
                claimed then.
        """
        for name, module in modules.items():
            held = _HOOKED.get(module)
            if held is not None and held[0] != id(self):
                self.release()
                raise WatcherStateError(
                    f"module {name!r} of {owner} is already watched by another active Watcher "
                    f"(of a {held[1]}); a module shared by two watched models would be recorded "
                    "by both, whichever model called it. Watch the model that contains both "
                    "once, or leave the shared module out of one Watcher with layers=."
                )
            _HOOKED[module] = (id(self), owner)
            _BY_ID[id(module)] = module
            self._claimed.append(module)

    def release(self) -> None:
        """Give back every module claimed (on exit, or when entering failed)."""
        for module in self._claimed:
            held = _HOOKED.get(module)
            if held is not None and held[0] == id(self):
                del _HOOKED[module]
                _BY_ID.pop(id(module), None)
        self._claimed.clear()


def hooked_module(token: int) -> nn.Module | None:
    """The module of ``id`` ``token`` if a live Watcher hooks it, else None."""
    return _BY_ID.get(token)


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jacrev, ...) is running: tensors inside
    it are functorch wrappers, on which tensor hooks crash or see the wrong gradient.

    False while dynamo traces (``torch.compile``): the interpreter stack it shows then is that
    of its own tracing, not a transform of the user's.
    """
    if torch.compiler.is_compiling():
        return False
    return transform_running()


def transform_running() -> bool:
    """:func:`in_functorch_transform` for a caller that knows dynamo is not tracing it (a
    forward hook runs once per layer and step: one check fewer)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


FUNCTORCH_WARNING = (
    "graddebug: a watched module ran inside a torch.func transform (grad, vmap, jacrev, ...); "
    "graddebug does not hook tensors inside those transforms, so these calls are not recorded "
    "and interventions do not apply to them. Gradients that reach p.grad (backward()) are "
    "recorded as usual."
)


def check_mask_device(spec: Intervention | None, name: str) -> None:
    """A mask on the ``meta`` device holds no values and could never be applied.

    Raises:
        ConfigError: It is on the ``meta`` device.
    """
    mask = spec.mask if spec is not None else None
    if isinstance(mask, Tensor) and mask.device.type == "meta":
        raise ConfigError(
            f"the mask for {name!r} is on the 'meta' device, which holds shapes but no values, "
            "so it cannot mask a gradient; build it on the CPU or on the model's device."
        )
