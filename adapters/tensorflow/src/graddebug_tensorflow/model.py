"""The layers of a Keras model by unique name, their nesting, and who owns each variable: the
index of every Keras backend, :class:`graddebug_keras.model.LayerIndex`, importable from here
as before."""

from __future__ import annotations

from graddebug_keras.model import LayerIndex, children, short_name

__all__ = ["LayerIndex", "children", "short_name"]
