"""The base class that holds what every adapter shares: layers by name, forward-order depths,
the ``keep=``/``intervene=`` names that matched, and the fail-open rule."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar, TypeVar

from graddebug.adapter.options import WatchOptions
from graddebug.adapter.protocol import WatchContext
from graddebug.capture.layers import FailOpen, Intervention, LayerSpec

__all__ = ["BaseAdapter"]

L = TypeVar("L")


def _mask(intervention: Intervention | None) -> object:
    return intervention.mask if intervention is not None else None


class BaseAdapter:
    """The bookkeeping every adapter shares; subclasses add only what is framework-specific.

    It keeps the watched layers and taps by name (:class:`LayerSpec`), hands out forward-order
    depths, tracks which ``keep=``/``intervene=`` names matched something, and applies the
    fail-open rule. A subclass declares what it can do as data: :attr:`capabilities` and
    :attr:`watch_options`.

    Args:
        context: The Watcher.
        options: The validated ``watch`` options.
    """

    name: str = ""
    """The adapter's name (the framework), as run metadata records it."""

    capabilities: ClassVar[frozenset[type]] = frozenset()
    """The capability protocols of :mod:`graddebug.adapter.protocol` that the adapter
    implements; checked against its methods when the first one is built
    (:func:`graddebug.adapter.capabilities.verify_adapter`)."""

    watch_options: ClassVar[frozenset[str]] = frozenset()
    """The options of ``watch`` that the adapter honours, among
    :data:`graddebug.adapter.options.ADAPTER_OPTIONS` (the Watcher honours the others
    itself): ``watch`` refuses any other one that the user set."""

    def __init__(self, context: WatchContext, options: WatchOptions) -> None:
        self._ctx = context
        self._options = options
        self._layers: dict[str, LayerSpec] = {}
        self._matched: set[str] = set()
        self._next_depth = 0
        self._guards: dict[str, FailOpen] = {}

    # -- names and depths --------------------------------------------------------------------

    def _take_depth(self) -> int:
        """The next forward-order index."""
        depth = self._next_depth
        self._next_depth += 1
        return depth

    def _add_layers(self, named: Mapping[str, L], selected: Mapping[str, L],
                    channels_first: Callable[[L], bool],
                    keeps_finite: Callable[[L], bool] | None = None,
                    weighted: Callable[[L], bool] | None = None) -> dict[str, L]:
        """Register the ``layers=`` selection, plus every layer ``keep=``/``intervene=`` name.

        Args:
            named: Every layer of the model by name.
            selected: The layers ``layers=`` chose.
            channels_first: Whether a layer's outputs put units on axis 1.
            keeps_finite: Whether a layer cannot make a non-finite output from finite inputs,
                so that its forward check can find nothing (None: every layer can).
            weighted: Whether a layer's output is fixed by its input and its own parameters
                (see :attr:`LayerSpec.weighted`; None: no layer is).

        Returns:
            The layers to hook, by name.
        """
        options = self._options
        wanted = options.named & named.keys()
        chosen = dict(selected)
        for extra in wanted:
            chosen.setdefault(extra, named[extra])
        for name, layer in chosen.items():
            keep = name in options.keep
            intervention = options.intervene.get(name)
            self._layers[name] = LayerSpec(
                name=name,
                channels_first=channels_first(layer),
                keep=keep,
                intervention=intervention,
                capture=options.outputs or keep or intervention is not None,
                check_forward=keeps_finite is None or not keeps_finite(layer),
                weighted=weighted is not None and weighted(layer),
            )
        self._matched |= wanted
        return chosen

    def _add_param_keys(self, keys: Iterable[str]) -> None:
        """Register the ``params=`` keys as layers of their own, in the order given."""
        for key in keys:
            self._layers.setdefault(key, LayerSpec(name=key, depth=self._take_depth()))
            if key in self._options.named:
                self._matched.add(key)

    def _tap_layer(self, name: str, intervention: Intervention | None) -> LayerSpec:
        """The layer entry of a tap, created at its first call; ``intervention`` replaces the
        previous one, and a mask other than the previous one is checked again at its first
        use."""
        layer = self._layers.get(name)
        if layer is None:
            layer = self._layers[name] = LayerSpec(name=name, keep=name in self._options.keep)
        if name in self._options.named:
            self._matched.add(name)
        if _mask(intervention) is not _mask(layer.intervention):
            layer.mask_checked = False
        layer.intervention = intervention
        return layer

    def _depth_of(self, chain: Iterable[str]) -> int:
        """The depth of the first layer of ``chain`` (an owner, then its ancestors) that ran
        forward; -1 when none did."""
        for name in chain:
            layer = self._layers.get(name)
            if layer is not None and layer.depth >= 0:
                return layer.depth
        return -1

    def _model_layer_names(self) -> Iterable[str]:
        """Every layer name of the model, watched or not (for suggestions)."""
        return ()

    # -- shared parts of the Adapter protocol ----------------------------------------------

    def matched_names(self) -> set[str]:
        """Names from ``keep=``/``intervene=`` that matched a layer, a param key or a tap."""
        return set(self._matched)

    def known_names(self) -> list[str]:
        """Every watched layer, model layer and tap name."""
        return list(dict.fromkeys([*self._layers, *self._model_layer_names()]))

    def _fail_open(self, where: str) -> FailOpen:
        """``with self._fail_open(layer): ...`` around the body of every hook.

        One guard per ``where``, reused: it holds no state of its own, and hooks run once per
        layer and step, where each allocation adds to the garbage collector's work.
        """
        guard = self._guards.get(where)
        if guard is None:
            guard = self._guards[where] = FailOpen(self._ctx.internal_error, where)
        return guard
