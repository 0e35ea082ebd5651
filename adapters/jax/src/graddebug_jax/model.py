"""The modules and parameters of a Flax NNX model by their ``nnx`` graph paths, and the wrapped
``__call__`` that passes a watched module's outputs through the identities of :mod:`.outputs`.

Python looks special methods up on the type, so a module's ``__call__`` is wrapped on its class
(on the class of the MRO that defines it), once per class and for as long as some Watcher needs
it. The wrapper acts only for modules that carry a watch label, a static attribute set on
attach and removed on detach. A static attribute is part of the module's graph definition, so
it survives ``nnx.jit``, ``nnx.split``/``nnx.merge`` and the copies NNX transforms make, and
the change of definition makes a compiled step trace once more on entering and leaving the
``with`` block, with and without the identities. Other instances of the class run unchanged.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from graddebug.capture.layers import select_layers

__all__ = ["LABEL", "ModelIndex", "OutputHook", "floating_leaves", "patch_calls", "path_name"]

LABEL = "_graddebug_label"
"""The static attribute that marks a watched module: ``(watch id, layer name)``, and a
generation after :meth:`_Patches.relabel`."""

OutputHook = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
"""``hook(layer_name, call, args, kwargs) -> output``: runs a watched module's ``call`` (the
original ``__call__`` bound to the module) and returns its output, watched."""

# The Watchers whose modules run now, by watch id; the wrapped calls find their hook here.
# Per process, as the patched classes are.
_HOOKS: dict[int, OutputHook] = {}
_PATCHED: dict[type, tuple[Any, int]] = {}  # class -> (original __call__, watchers using it)
_LOCK = threading.Lock()
_INSIDE = threading.local()


def path_name(path: Sequence[Any]) -> str:
    """``("layers", 0, "kernel")`` -> ``"layers.0.kernel"``; key objects of
    ``jax.tree_util`` paths are read for their key, index or name, and a trailing ``value``
    (an NNX variable's leaf) is dropped."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(str(key))
    if len(parts) > 1 and parts[-1] in ("value", "raw_value"):
        parts.pop()
    return ".".join(parts)


class ModelIndex:
    """The modules of an NNX model by name, and which of them are watched by default.

    The root module is named by its class; the others by their graph path
    (``layers.0``, ``blocks.1.attn``). By default every leaf module and every module that owns
    parameters is watched, as in the torch adapter.

    Args:
        model: The ``nnx.Module``.
    """

    def __init__(self, model: nnx.Module) -> None:
        self.model = model
        self.root = type(model).__name__
        self.named: dict[str, nnx.Module] = {}
        children: dict[str, int] = {}
        for path, module in nnx.iter_modules(model):
            name = path_name(path) if path else self.root
            self.named[name] = module
            if path:
                parent = path_name(path[:-1]) if len(path) > 1 else self.root
                children[parent] = children.get(parent, 0) + 1
        self.params: dict[str, tuple[str, str]] = {}  # param path -> (layer, tensor)
        for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            name = path_name(path)
            owner, _, short = name.rpartition(".")
            self.params[name] = (self._module_of(owner), short)
        owners = {layer for layer, _ in self.params.values()}
        self.defaults = {name: m for name, m in self.named.items()
                         if not children.get(name) or name in owners}

    def _module_of(self, path: str) -> str:
        """The nearest module at or above ``path`` (a parameter may sit in an ``nnx.Dict``)."""
        while path and path not in self.named:
            path = path.rpartition(".")[0]
        return path or self.root

    def select(self, layers: Sequence[Any] | None) -> dict[str, nnx.Module]:
        """The modules ``layers=`` chooses (the defaults for None).

        Raises:
            UnknownNameError: A name or glob matches no module.
        """
        if layers is None:
            return dict(self.defaults)
        return select_layers(self.named, layers, noun="module", owner=self.root)

    def param_name(self, path: str) -> tuple[str, str]:
        """``(layer, tensor)`` of a parameter path (``"layers.0.kernel"``); a path not in the
        model is split at its last dot."""
        known = self.params.get(path)
        if known is not None:
            return known
        owner, _, short = path.rpartition(".")
        return (self._module_of(owner), short or path)


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        label: tuple[Any, ...] | None = getattr(self, LABEL, None)
        hook = _HOOKS.get(label[0]) if label is not None else None
        inside: set[int] = getattr(_INSIDE, "ids", None) or set()
        if label is None or hook is None or id(self) in inside:  # or a wrapped super() call
            return original(self, *args, **kwargs)
        _INSIDE.ids = inside | {id(self)}
        try:
            return hook(label[1], functools.partial(original, self), args, kwargs)
        finally:
            _INSIDE.ids = inside

    return __call__


def _defining_class(module: nnx.Module) -> type:
    for cls in type(module).__mro__:
        if "__call__" in vars(cls):
            return cls
    return type(module)


class _Patches:
    """The labels and class patches of one Watcher; ``remove()`` gives them back."""

    def __init__(self, watch_id: int, modules: Mapping[str, nnx.Module]) -> None:
        self._id = watch_id
        self._modules = dict(modules)
        self._classes: list[type] = []
        self._generation = 0

    def install(self, hook: OutputHook) -> None:
        with _LOCK:
            _HOOKS[self._id] = hook
            for name, module in self._modules.items():
                setattr(module, LABEL, (self._id, name))
                cls = _defining_class(module)
                if cls in self._classes:
                    continue
                original, users = _PATCHED.get(cls, (vars(cls)["__call__"], 0))
                if users == 0:
                    type.__setattr__(cls, "__call__", _wrap(original))
                _PATCHED[cls] = (original, users + 1)
                self._classes.append(cls)

    def relabel(self) -> None:
        """Give every label a new generation: the graph definitions change, so compiled
        steps trace once more (and see what changed on the host side)."""
        with _LOCK:
            self._generation += 1
            for name, module in self._modules.items():
                setattr(module, LABEL, (self._id, name, self._generation))

    def remove(self) -> None:
        with _LOCK:
            _HOOKS.pop(self._id, None)
            for module in self._modules.values():
                if LABEL in vars(module):
                    delattr(module, LABEL)
            for cls in self._classes:
                original, users = _PATCHED[cls]
                if users == 1:
                    type.__setattr__(cls, "__call__", original)
                    del _PATCHED[cls]
                else:
                    _PATCHED[cls] = (original, users - 1)
            self._classes.clear()


def patch_calls(watch_id: int, modules: Mapping[str, nnx.Module],
                hook: OutputHook) -> _Patches:
    """Label ``modules`` and wrap their classes' ``__call__`` so that each output goes through
    ``hook``; the handle's ``remove()`` undoes both."""
    patches = _Patches(watch_id, modules)
    patches.install(hook)
    return patches


def floating_leaves(output: Any) -> Iterator[tuple[str, Any]]:
    """The floating-point arrays of a module's output with their ``tensor`` labels:
    ``"output"`` for one array, ``"output.0"`` or ``"output.key"`` inside a pytree."""
    leaves = jax.tree_util.tree_flatten_with_path(output)[0]
    for path, leaf in leaves:
        if isinstance(leaf, jax.Array) and jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
            yield ("output" if not path else f"output.{path_name(path)}"), leaf
