"""The Watcher's questions to an adapter's optional capabilities
(:mod:`graddebug.adapter.protocol`): each returns the capability, or raises the error that
says why this adapter has none and what to do instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graddebug.adapter import Adapter, GradientSource, SessionGraphs, StepClock, Training
from graddebug.errors import ConfigError, WatcherStateError

__all__ = ["follow", "session_graphs", "training"]


def _named(adapter: Adapter) -> str:
    return adapter.name or type(adapter).__name__


def follow(adapter: Adapter, optimizer: Any, on_step: Callable[[], None]) -> None:
    """Bind ``watch(optimizer=...)``: its steps call ``on_step`` where the adapter keeps a
    step clock, and its gradients are recorded where the adapter takes them from there.

    Raises:
        ConfigError: The adapter has neither capability, or ``optimizer`` is not one of its
            framework's optimizers.
    """
    follows = False
    if isinstance(adapter, GradientSource):
        adapter.take_gradients(optimizer)
        follows = True
    if isinstance(adapter, StepClock):
        adapter.follow_optimizer(optimizer, on_step)
        follows = True
    if not follows:
        raise ConfigError(
            f"optimizer={type(optimizer).__name__} cannot be followed: the {_named(adapter)} "
            "adapter neither steps with an optimizer nor takes gradients from one. Drop "
            "optimizer= and call dbg.step() after each optimizer step."
        )


def session_graphs(adapter: Adapter | None, what: str) -> SessionGraphs:
    """The adapter of an active Watcher, for ``dbg.fetches()`` and ``dbg.session_hook()``.

    Args:
        adapter: The active Watcher's adapter; None outside the block or before one was chosen.
        what: The call, for messages.

    Raises:
        WatcherStateError: No adapter yet.
        ConfigError: The adapter runs no graphs through sessions.
    """
    if adapter is None:
        raise WatcherStateError(
            f"{what}() needs an active Watcher that watches a graph: call it inside "
            "`with graddebug.watch(params=...)`, after the graph's taps are built."
        )
    if not isinstance(adapter, SessionGraphs):
        framework = adapter.name or "a framework"
        runs = (f"reads statistics through a tf.compat.v1 Session, and this Watcher watches "
                f"{framework} code, which runs none" if what == "fetches" else
                f"is a tf.compat.v1.train.SessionRunHook, and this Watcher watches "
                f"{framework} code, which runs no session")
        raise ConfigError(f"{what}() {runs}; close each step with dbg.step() instead.")
    return adapter


def training(adapter: Adapter | None, what: str) -> Training:
    """The adapter of an active Watcher with a model, for ``dbg.callback()`` and
    ``graddebug.check``'s train steps.

    Args:
        adapter: The active Watcher's adapter; None outside the block or before one was chosen.
        what: The call, for messages.

    Raises:
        WatcherStateError: No adapter yet.
        ConfigError: The adapter has no training loop.
    """
    if adapter is None:
        raise WatcherStateError(
            f"{what}() needs an active Watcher with a model: `with graddebug.watch(model) as "
            "dbg: model.fit(..., callbacks=[dbg.callback()])`."
        )
    if isinstance(adapter, Training):
        return adapter
    if isinstance(adapter, SessionGraphs):
        raise ConfigError(
            f"{what}() trains a model (graddebug.check, model.fit), and this Watcher watches a "
            "graph that a session runs: record its steps with dbg.fetches() in your "
            "session.run, or MonitoredTrainingSession(hooks=[dbg.session_hook()])."
        )
    raise ConfigError(
        f"{what}() needs a framework that trains models, and the {_named(adapter)} adapter "
        "has no training loop; close each step with dbg.step()."
    )
