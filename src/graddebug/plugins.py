"""The plugin manager: hook specs, built-in plugins, then entry points of group ``graddebug``."""

from __future__ import annotations

import functools
import importlib

import pluggy

from graddebug import hookspecs

__all__ = ["DEFAULT_PLUGINS", "PROJECT", "get_plugin_manager", "new_plugin_manager"]

PROJECT = "graddebug"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "graddebug.detectors.vanishing",
    "graddebug.detectors.exploding",
    "graddebug.detectors.nonfinite",
    "graddebug.detectors.cutgraph",
    "graddebug.detectors.dead",
)
"""Built-in plugins, registered before any installed one (modules imported by name)."""


def new_plugin_manager(*, entry_points: bool = True) -> pluggy.PluginManager:
    """Build a fresh plugin manager.

    Args:
        entry_points: Also load plugins that installed packages declare in the ``graddebug``
            entry-point group (the framework adapters among them).

    Returns:
        A manager with the hook specs, the built-in plugins and, optionally, installed plugins.
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name.rsplit(".", 1)[-1])
    if entry_points:
        pm.load_setuptools_entrypoints(PROJECT)
    pm.check_pending()
    return pm


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, built on first use.

    Plugins registered on it at run time (``get_plugin_manager().register(obj)``) take part in
    every later ``watch``. Pass ``plugin_manager=`` to ``watch`` to use another one instead.
    """
    return new_plugin_manager()
