"""The model index of the torch adapter: every layer of a model by name, which of them
``layers=`` selects, how each is treated, and the parameters they own.

:class:`graddebug_torch.adapter.TorchAdapter` reads a model only through a :class:`ModelIndex`,
given to its constructor. The default, :class:`ModuleIndex`, walks a ``torch.nn.Module``:
layers by their qualified names (wrappers' parts removed, the root named by its class),
parameters from ``named_parameters()``. A model whose layers torch does not list itself (Keras
on the torch backend keeps its sub-layers in its own tracker) passes an index of its own, and
the adapter's hooks, close and names follow it unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Protocol

from torch import nn

from graddebug.capture.layers import select_layers
from graddebug_torch.outputs import CHANNELS_FIRST, KEEPS_FINITE, WEIGHTED, watched_by_default
from graddebug_torch.params import TorchParam, model_params
from graddebug_torch.wrappers import class_name, clean_name

__all__ = ["ModelIndex", "ModuleIndex"]


class ModelIndex(Protocol):
    """What the torch adapter needs to know of a model, whoever names its layers.

    Every layer is a ``torch.nn.Module`` (its forward hooks are the capture); names are the
    model's own, as they appear in the records.
    """

    @property
    def layers(self) -> dict[str, nn.Module]:
        """Every layer of the model by name: the ones ``keep=`` and ``intervene=`` may add to
        the selection."""

    def select(self, layers: Sequence[Any] | None) -> dict[str, nn.Module]:
        """The layers ``layers=`` names (None: those watched by default), by name.

        Raises:
            UnknownNameError: A name, glob or type matches no layer.
        """

    def layer_names(self) -> Iterable[str]:
        """Every layer name of the model, watched or not (for suggestions)."""

    def name(self, qualified: str) -> str:
        """The layer name of a module's qualified name within the model (``""`` is the
        model itself); a layer name is its own."""

    def params(self, chosen: Collection[str] | None,
               keep: Collection[str]) -> list[TorchParam]:
        """The watched parameters: every one of the model, or those of the ``chosen`` layers
        and their children (by layer name), each owner chain in layer names or qualified
        names that :meth:`name` maps.

        Raises:
            ConfigError: A parameter cannot be watched (the message says why).
        """

    def channels_first(self, layer: nn.Module) -> bool:
        """Whether ``layer``'s outputs put units on axis 1."""

    def keeps_finite(self, layer: nn.Module) -> bool:
        """Whether ``layer`` cannot make a non-finite output from finite inputs (its forward
        check is skipped)."""

    def weighted(self, layer: nn.Module) -> bool:
        """Whether ``layer``'s output is fixed by its input and its own parameters."""


class ModuleIndex:
    """The index of a ``torch.nn.Module`` (or of no model, for ``params=`` and taps alone).

    Args:
        root: The unwrapped model (:func:`graddebug_torch.wrappers.unwrap`), or None.
    """

    def __init__(self, root: nn.Module | None) -> None:
        self.root = root
        self._layers: dict[str, nn.Module] = {}
        if root is not None:
            self._layers = {self.name(n): m for n, m in root.named_modules()}

    @property
    def layers(self) -> dict[str, nn.Module]:
        """Every module by layer name."""
        return self._layers

    def select(self, layers: Sequence[Any] | None) -> dict[str, nn.Module]:
        """The modules ``layers=`` selects; by default, :func:`watched_by_default`."""
        if self.root is None:
            return {}
        if layers is None:
            return {n: m for n, m in self._layers.items() if watched_by_default(m)}
        return select_layers(self._layers, layers, noun="module", owner=class_name(self.root))

    def layer_names(self) -> list[str]:
        """Every module's layer name, watched or not."""
        return list(self._layers)

    def name(self, qualified: str) -> str:
        """Wrappers' parts removed (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``),
        the root named by its class."""
        name = clean_name(qualified)
        if name or self.root is None:
            return name
        return class_name(self.root)

    def params(self, chosen: Collection[str] | None,
               keep: Collection[str]) -> list[TorchParam]:
        """``named_parameters()`` of the model, or of the chosen modules and their children.

        Raises:
            ConfigError: A parameter is not initialized yet (a lazy module).
        """
        if self.root is None:
            return []
        return model_params(self.root, self.name, chosen, keep)

    def channels_first(self, layer: nn.Module) -> bool:
        """Convolutions and batch norms put channels on axis 1."""
        return isinstance(layer, CHANNELS_FIRST)

    def keeps_finite(self, layer: nn.Module) -> bool:
        """torch's own modules that cannot make NaN/Inf from finite inputs (exact types)."""
        return type(layer) in KEEPS_FINITE

    def weighted(self, layer: nn.Module) -> bool:
        """torch's own modules whose output is fixed by their input and parameters."""
        return type(layer) in WEIGHTED
