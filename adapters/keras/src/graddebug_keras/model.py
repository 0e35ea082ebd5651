"""A Keras model's layers by name, on every backend: each layer by its Keras ``name``
(``outer/inner`` where nested models repeat one), leaf layers watched by default; which layer
owns each variable, with the variable's short name (``"kernel"``, ``"bias"``); and the marker of
the functions Keras compiled, dropped so that the next ``fit`` traces the wrapped calls.

The TensorFlow adapter and the torch and JAX backends of this package all name a model's layers
and variables through :class:`LayerIndex`, so that one model's runs line up across backends.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import keras

from graddebug.capture.layers import select_layers

__all__ = ["COMPILED", "LayerIndex", "channels_first", "children", "reset_compiled",
           "short_name"]

COMPILED = ("train_function", "test_function", "predict_function")
"""The attributes where a Keras model keeps the functions ``fit``, ``evaluate`` and ``predict``
compiled: a function traced before a layer's ``call`` was wrapped (or unwrapped) would go on
running the old one."""


def reset_compiled(model: Any) -> None:
    """Drop the functions Keras compiled for ``model``, so that its next call traces again."""
    for attr in COMPILED:
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)


def children(layer: Any) -> list[Any]:
    """The layers directly inside ``layer``."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def short_name(var: Any) -> str:
    """A variable's own name without scope or suffix: ``"kernel"``, ``"bias"`` (a
    ``tf.Variable``'s ``"scope/W:0"`` is ``"W"``)."""
    return str(var.name).rsplit("/", 1)[-1].split(":", 1)[0]


def channels_first(layer: Any) -> bool:
    """Whether ``layer``'s outputs put units on axis 1."""
    return getattr(layer, "data_format", None) == "channels_first"


class LayerIndex:
    """Every layer below a model, by its Keras name, or ``outer/inner`` where nested models
    repeat a name; their nesting; and who owns each variable.

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
        counts: dict[str, int] = {}
        for child, _ in found:
            counts[child.name] = counts.get(child.name, 0) + 1
        names: dict[int, str] = {}
        for child, parent in found:
            name = child.name
            if counts[name] > 1 and parent is not None:
                name = f"{names[id(parent)]}/{name}"
            names[id(child)] = name
        self.named = {names[id(c)]: c for c, _ in found} or {self.model.name: self.model}
        self.parents = {names[id(c)]: names[id(p)] for c, p in found if p is not None}
        for name, layer in [(self.root, self.model), *self.named.items()]:
            for var in getattr(layer, "_trainable_variables", []):
                self._owners.setdefault(id(var), (name, short_name(var)))

    @property
    def root(self) -> str:
        """The model's own name (owner of the variables no sub-layer owns)."""
        return str(self.model.name)

    def owner(self, var: Any) -> tuple[str, str]:
        """``(layer name, short name)`` of a variable; the model's name if no layer owns it.
        A variable not seen yet walks the model again first."""
        if id(var) not in self._owners:
            self.refresh()
        return self._owners.get(id(var), (self.root, short_name(var)))

    def ancestors(self, name: str) -> Iterator[str]:
        """The layers that contain ``name``, innermost first."""
        while name in self.parents:
            name = self.parents[name]
            yield name

    def chain(self, name: str) -> tuple[str, ...]:
        """``name``, then the layers that contain it, innermost first, then the model."""
        out = [name, *self.ancestors(name)]
        if out[-1] != self.root:
            out.append(self.root)
        return tuple(out)

    def layer_names(self) -> list[str]:
        """Every layer name of the model, watched or not, and the model's own (for
        suggestions)."""
        return list(dict.fromkeys([*self.named, self.root]))

    def select(self, layers: Sequence[Any] | None) -> dict[str, Any]:
        """The layers ``layers=`` names: leaf layers by default, else names, globs and types.

        Raises:
            UnknownNameError: A name, glob or type matches no layer.
            ConfigError: An entry is neither a string nor a type.
        """
        if layers is None:
            leaves = {n: layer for n, layer in self.named.items() if not children(layer)}
            return leaves or dict(self.named)
        return select_layers(self.named, layers, noun="layer", owner=type(self.model).__name__)

    def variables(self) -> Iterator[tuple[str, str, Any]]:
        """``(layer, short name, variable)`` of every trainable variable, in the model's
        ``trainable_variables`` order (the order of the gradients Keras computes)."""
        for var in self.model.trainable_variables:
            layer, short = self.owner(var)
            yield layer, short, var
