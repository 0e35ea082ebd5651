"""Forward hooks taken off the modules on the steps ``every=`` skips.

A module with any forward hook leaves torch's fast call path for one that collects and calls
its hooks: on a model of many small layers that is a measurable part of a step even when the
hooks return at once, and graddebug's own early returns as much again (see the Performance
page). On a step ``every=`` skips
the hooks have nothing to do (interventions and compiled graphs, which need them there, keep
them), so the adapter takes them off the module between the steps, and puts them back before
the next recorded step.

Parking takes the hooks' entries out of the module's hook dictionaries, as ``RemovableHandle``
would, and puts the same entries back (same ids, so the handles still remove them on exit). A
module is parked only where every entry of its forward and forward-pre hook dictionaries is
graddebug's and it has no backward hook: torch then calls it the fast way, and nothing else
sees a change. Hooks another library adds to a parked module while it is parked keep running;
graddebug's come back in front of them, as they were registered first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookParking"]

# (hook dictionary, id, entry) of one parked entry.
_Entry = tuple[dict[int, Any], int, Any]


def _dicts(handle: RemovableHandle) -> list[dict[int, Any]]:
    """The dictionaries ``handle`` removes its id from: the hooks and any flags."""
    refs = [handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())]
    return [d for d in (ref() for ref in refs) if d is not None]


class HookParking:
    """The module hooks of one watch that may be parked, module by module."""

    def __init__(self) -> None:
        self._hooks: dict[int, tuple[nn.Module, list[RemovableHandle]]] = {}
        self._parked: dict[int, list[_Entry]] = {}
        self._away = False

    def add(self, module: nn.Module, handles: Iterable[RemovableHandle]) -> None:
        """Let ``handles`` (forward and forward-pre hooks on ``module``) be parked."""
        self._hooks.setdefault(id(module), (module, []))[1].extend(handles)

    @property
    def parked(self) -> bool:
        """Whether :meth:`park` ran since the last :meth:`restore` (whether or not a module
        could be parked)."""
        return self._away

    def park(self) -> None:
        """Take the hooks off every module where they are the only ones (once until the next
        :meth:`restore`)."""
        if self._away:
            return
        self._away = True
        for key, (module, handles) in self._hooks.items():
            ids = {h.id for h in handles}
            if not _only_ours(module, ids):
                continue
            dicts = {id(d): d for h in handles for d in _dicts(h)}
            # In each dictionary's own order: a value-flow hook is prepended to the others.
            self._parked[key] = [(d, i, d.pop(i)) for d in dicts.values()
                                 for i in [i for i in d if i in ids]]

    def restore(self) -> None:
        """Put every parked hook back, in front of any hook added while it was parked."""
        for entries in self._parked.values():
            by_dict: dict[int, tuple[dict[int, Any], list[tuple[int, Any]]]] = {}
            for hooks, hook_id, entry in entries:
                by_dict.setdefault(id(hooks), (hooks, []))[1].append((hook_id, entry))
            for hooks, ours in by_dict.values():
                others = list(hooks.items())
                hooks.clear()
                hooks.update(ours)
                hooks.update(others)
        self._parked.clear()
        self._away = False

    def clear(self) -> None:
        """Forget every hook (they are removed on exit; parked ones are gone already)."""
        self._hooks.clear()
        self._parked.clear()
        self._away = False


def _only_ours(module: nn.Module, ids: set[int]) -> bool:
    """Whether the hooks ``ids`` are every forward hook of ``module`` and it has no backward
    hook: parked, it then takes torch's fast call path."""
    return (set(module._forward_hooks) | set(module._forward_pre_hooks)) <= ids and not (
        module._backward_hooks or module._backward_pre_hooks)
