"""The plugin manager (hook specs, built-in plugins, then entry points of group
``graddebug``) and the adapter lookup: which installed adapter claims an object."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import warnings
from typing import TYPE_CHECKING

import pluggy

from graddebug import hookspecs
from graddebug.errors import GradDebugWarning, NoAdapterError

if TYPE_CHECKING:
    from graddebug.adapter import AdapterFactory

__all__ = [
    "DEFAULT_PLUGINS",
    "KNOWN_FRAMEWORKS",
    "PROJECT",
    "find_adapter",
    "get_plugin_manager",
    "new_plugin_manager",
]

PROJECT = "graddebug"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "graddebug.detectors.vanishing",
    "graddebug.detectors.exploding",
    "graddebug.detectors.nonfinite",
    "graddebug.detectors.overflow",
    "graddebug.detectors.cutgraph",
    "graddebug.detectors.dead",
    "graddebug.detectors.history",
    "graddebug.integrations.tensorboard",
    "graddebug.integrations.wandb",
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
        _load_entry_points(pm)
    pm.check_pending()
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Register the plugins of the ``graddebug`` entry-point group. One that fails to import
    (a half-installed or broken package) is left out with a warning that names it, so that
    it does not take the other frameworks down with it."""
    for ep in importlib.metadata.entry_points(group=PROJECT):
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:
            where = f" of {ep.dist.name} {ep.dist.version}" if ep.dist is not None else ""
            warnings.warn(GradDebugWarning(
                f"graddebug: the plugin {ep.name!r}{where} ({ep.value}) failed to load and is "
                f"left out: {type(exc).__name__}: {exc}. Reinstall or uninstall that package."
            ), stacklevel=3)
            continue
        pm.register(plugin, name=ep.name)


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, built on first use.

    Plugins registered on it at run time (``get_plugin_manager().register(obj)``) take part in
    every later ``watch``. Pass ``plugin_manager=`` to ``watch`` to use another one instead.
    """
    return new_plugin_manager()


KNOWN_FRAMEWORKS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "pip install graddebug[torch]"),
    "tensorflow": ("tensorflow", "pip install graddebug[tensorflow]"),
    "keras": ("tensorflow", "pip install graddebug[tensorflow]"),
    "jax": ("jax", "pip install graddebug[jax]"),
    "jaxlib": ("jax", "pip install graddebug[jax]"),
    "flax": ("jax", "pip install graddebug[jax]"),
}
"""Frameworks graddebug serves, by top-level module: the adapter's name and its install hint."""


def find_adapter(pm: pluggy.PluginManager, target: object) -> AdapterFactory:
    """Ask every plugin which adapter watches ``target``.

    Args:
        pm: The plugin manager.
        target: A model, a tensor or a variable.

    Returns:
        The first adapter factory that claims ``target``.

    Raises:
        NoAdapterError: No installed adapter claims it; the message names the type, lists the
            installed adapters and gives the pip command that would add the missing one.
    """
    factory: AdapterFactory | None = pm.hook.graddebug_adapter(target=target)
    if factory is not None:
        return factory
    cls = type(target)
    installed = sorted({impl.plugin_name for impl in pm.hook.graddebug_adapter.get_hookimpls()})
    missing = sorted({hint for name, hint in KNOWN_FRAMEWORKS.values() if name not in installed})
    root = cls.__module__.split(".", 1)[0]
    lines = [
        f"graddebug cannot watch an object of type {cls.__module__}.{cls.__qualname__}: "
        "no installed adapter claims it.",
        f"Installed adapters: {', '.join(installed) or 'none'}.",
    ]
    if root in KNOWN_FRAMEWORKS and KNOWN_FRAMEWORKS[root][0] not in installed:
        lines.append(f"To watch {root} models: {KNOWN_FRAMEWORKS[root][1]}")
    elif missing:
        lines.append("Adapters that are not installed: " + "; ".join(missing) + ".")
    lines.append(
        "Pass a model (a torch.nn.Module, a Keras model, a Flax NNX module), "
        "params={name: tensor}, or use watch() with tap(tensor, name)."
    )
    raise NoAdapterError("\n".join(lines))
