"""``layers=``: choosing layers by name, glob or type, the same way in every adapter."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from graddebug.errors import ConfigError, UnknownNameError, close_matches

__all__ = ["select_layers"]

T = TypeVar("T")


def select_layers(named: Mapping[str, T], layers: Sequence[Any], *, noun: str,
                  owner: str) -> dict[str, T]:
    """The entries of ``named`` that ``layers=`` asks for, in the order asked.

    Args:
        named: Every layer of the model by its name.
        layers: Names, globs (``"encoder.*"``) or types.
        noun: What a layer is called in this framework (``"module"``, ``"layer"``).
        owner: The model's class name, for messages.

    Raises:
        UnknownNameError: An entry matches nothing; the message lists close names.
        ConfigError: An entry is neither a string nor a type.
    """
    selected: dict[str, T] = {}
    for spec in layers:
        if isinstance(spec, type):
            hits = {n: layer for n, layer in named.items() if isinstance(layer, spec)}
            what = f"layers= type {spec.__name__}"
        elif isinstance(spec, str) and any(c in spec for c in "*?["):
            hits = {n: layer for n, layer in named.items() if fnmatch.fnmatchcase(n, spec)}
            what = f"layers= pattern {spec!r}"
        elif isinstance(spec, str):
            hits = {spec: named[spec]} if spec in named else {}
            what = f"layers= name {spec!r}"
        else:
            raise ConfigError(
                f"layers= entry {spec!r} must be a {noun} name, a glob or a {noun} type."
            )
        if not hits:
            hint = close_matches(spec, named) if isinstance(spec, str) else ""
            raise UnknownNameError(
                f"{what} matches no {noun} of {owner}.{hint} "
                f"{noun.capitalize()}s: {', '.join(list(named)[:20])}."
            )
        selected.update(hits)
    return selected
