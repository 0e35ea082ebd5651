"""The layers of a Keras model by unique name, their nesting, and who owns each variable."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import keras

from graddebug.capture.layers import select_layers

__all__ = ["LayerIndex", "children", "short_name"]


def children(layer: Any) -> list[Any]:
    """The layers directly inside ``layer``."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def short_name(var: Any) -> str:
    """A variable's own name without scope or suffix: ``"kernel"``, ``"bias"``."""
    return str(var.name).rsplit("/", 1)[-1].split(":", 1)[0]


class LayerIndex:
    """Every layer below a model, by its Keras name, or ``outer/inner`` where nested models
    repeat a name.

    A model with no sub-layers (a bare ``Dense``) is its own only layer.

    Args:
        model: A Keras layer or model.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.named: dict[str, Any] = {}
        self.parents: dict[str, str] = {}
        self._owners: dict[int, tuple[str, str]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Walk the model again: sub-layers and variables may appear on its first call."""
        found: list[tuple[Any, Any]] = []  # (layer, parent layer or None), in walk order
        seen: set[int] = set()

        def walk(layer: Any, parent: Any) -> None:
            for child in children(layer):
                if isinstance(child, keras.layers.InputLayer) or id(child) in seen:
                    continue
                seen.add(id(child))
                found.append((child, parent))
                walk(child, child)

        walk(self.model, None)
        clashes = {n for n in (c.name for c, _ in found)
                   if sum(c.name == n for c, _ in found) > 1}
        names: dict[int, str] = {}
        for child, parent in found:
            name = child.name
            if name in clashes and parent is not None:
                name = f"{names[id(parent)]}/{name}"
            names[id(child)] = name
        self.named = {names[id(c)]: c for c, _ in found} or {self.model.name: self.model}
        self.parents = {names[id(c)]: names[id(p)] for c, p in found if p is not None}
        for name, layer in [(self.model.name, self.model), *self.named.items()]:
            for var in getattr(layer, "_trainable_variables", []):
                self._owners.setdefault(id(var), (name, short_name(var)))

    def owner(self, var: Any) -> tuple[str, str]:
        """``(layer name, short name)`` of a variable; the model's name if no layer owns it."""
        if id(var) not in self._owners:
            self.refresh()
        return self._owners.get(id(var), (self.model.name, short_name(var)))

    def ancestors(self, name: str) -> Iterator[str]:
        """The layers that contain ``name``, innermost first."""
        while name in self.parents:
            name = self.parents[name]
            yield name

    def select(self, layers: Sequence[Any] | None) -> dict[str, Any]:
        """The layers ``layers=`` names: leaf layers by default, else names, globs and types.

        Raises:
            UnknownNameError: A name, glob or type matches no layer.
            ConfigError: An entry is neither a string nor a type.
        """
        named = self.named
        if layers is None:
            leaves = {n: layer for n, layer in named.items() if not children(layer)}
            return leaves or dict(named)
        return select_layers(named, layers, noun="layer", owner=type(self.model).__name__)
