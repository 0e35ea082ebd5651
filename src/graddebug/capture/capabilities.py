"""The Watcher's questions to an adapter's declarations (:mod:`graddebug.adapter.capabilities`):
the options it honours, and its optional capabilities (:mod:`graddebug.adapter.protocol`).
Each question returns the capability, or raises the error that says why this adapter has none
and what to do instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from graddebug.adapter import (
    Adapter,
    GradientSource,
    SessionGraphs,
    StepClock,
    TrainingCallback,
    TrainStep,
    WatchOptions,
)
from graddebug.adapter.capabilities import declared_options, has
from graddebug.adapter.options import ADAPTER_OPTIONS, options_set
from graddebug.errors import ConfigError, UnsupportedOptionError, WatcherStateError

__all__ = ["INSTEAD", "callback", "follow", "refuse_at_watch", "refuse_options",
           "session_graphs", "train_step"]

INSTEAD: dict[str, str] = {
    "params": "its model's own variables are recorded already, and dbg.tap(x, name) records "
              "any other tensor",
    "layers": "it watches no model's layers; dbg.tap(x, name) records the tensors you choose",
    "keep": "it keeps no dense gradients; drop keep=, and those layers' rows are recorded all "
            "the same",
    "intervene": "alter a gradient with dbg.tap(x, name, clip_norm=...) instead",
    "outputs": "it has no layer outputs to switch off; drop outputs=",
    "param_stats": "its parameter rows carry the norm only; drop param_stats=",
    "optimizer": "drop optimizer= and call dbg.step() after each optimizer step",
    "scaler": "drop scaler=: Keras finds a LossScaleOptimizer through the model's optimizer, "
              "and gradients handed to dbg.step(grads) can be unscaled first",
    "ops": "dbg.tap(x, name) the tensors around the suspect operation to find where a NaN or "
           "a cut begins",
    "escalate": "dbg.tap(x, name) the tensors around the suspect operation to find where a NaN "
                "or a cut begins",
    "full_stats_every": "it measures every statistic on every recorded step; drop "
                        "full_stats_every=",
}
"""What to use instead of each adapter option, for the message of an adapter that does not
honour it (``tests/test_options.py`` holds its keys to the adapter options)."""


def _named(adapter: Adapter) -> str:
    return adapter.name or type(adapter).__name__


def refuse_options(factory: object, options: WatchOptions, *, model: bool) -> None:
    """Refuse the options the user set that the adapter (its factory, or the adapter once
    built) does not declare, in one message.

    Without a model, ``layers=`` has no layers to select, whatever the adapter declares.

    Args:
        factory: What ``graddebug_adapter`` returned (usually the adapter class), or the
            adapter; one that declares no ``watch_options`` is not asked.
        options: The validated options.
        model: Whether a model was given.

    Raises:
        UnsupportedOptionError: An option set to other than its default is not honoured; the
            message names the adapter, each option and what to use instead.
    """
    honoured = declared_options(factory)
    if honoured is None:
        return
    instead = dict(INSTEAD)
    if not model and "layers" in honoured:
        honoured = honoured - {"layers"}
        instead["layers"] = ("no model was given, so there are no layers to select: "
                             "watch(model, layers=...), or dbg.tap(x, name) the tensors you choose")
    refused = [n for n in options_set(options) if n in ADAPTER_OPTIONS and n not in honoured]
    if not refused:
        return
    cls = factory if isinstance(factory, type) else type(factory)
    name = getattr(factory, "name", "") or cls.__name__
    why = "; ".join(f"{n}=: {instead[n]}" for n in refused)
    kept = ", ".join(f"{n}=" for n in ADAPTER_OPTIONS if n in honoured) or "none"
    raise UnsupportedOptionError(
        f"watch({', '.join(f'{n}=...' for n in refused)}): the {name} adapter "
        f"({cls.__module__}.{cls.__qualname__}) does not honour "
        f"{' or '.join(f'{n}=' for n in refused)}. Instead, {why}. The options it honours, "
        f"besides the Watcher's own: {kept}.")


def refuse_at_watch(pm: pluggy.PluginManager, model: Any, options: WatchOptions) -> None:
    """Refuse, at ``watch()``, the options that the adapter of the model (or of the first
    ``params=`` value) does not honour; a tap finds its adapter, and is asked, later.

    Args:
        pm: The Watcher's plugin manager.
        model: The model given to ``watch``, or None.
        options: The validated options.

    Raises:
        UnsupportedOptionError: As :func:`refuse_options`.
    """
    target = model
    if target is None and options.params is not None:
        target = next(iter(options.params.values()))
    factory = pm.hook.graddebug_adapter(target=target) if target is not None else None
    if factory is not None:
        refuse_options(factory, options, model=model is not None)


def follow(adapter: Adapter, optimizer: Any, on_step: Callable[[], None]) -> None:
    """Bind ``watch(optimizer=...)``: its steps call ``on_step`` where the adapter keeps a
    step clock, and its gradients are recorded where the adapter takes them from there.

    Raises:
        ConfigError: The adapter has neither capability, or ``optimizer`` is not one of its
            framework's optimizers.
    """
    follows = False
    if has(adapter, GradientSource) and isinstance(adapter, GradientSource):
        adapter.take_gradients(optimizer)
        follows = True
    if has(adapter, StepClock) and isinstance(adapter, StepClock):
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
    if not has(adapter, SessionGraphs) or not isinstance(adapter, SessionGraphs):
        framework = adapter.name or "a framework"
        runs = (f"reads statistics through a tf.compat.v1 Session, and this Watcher watches "
                f"{framework} code, which runs none" if what == "fetches" else
                f"is a tf.compat.v1.train.SessionRunHook, and this Watcher watches "
                f"{framework} code, which runs no session")
        raise ConfigError(f"{what}() {runs}; close each step with dbg.step() instead.")
    return adapter


def _trainer(adapter: Adapter | None, what: str) -> Adapter:
    """The active Watcher's adapter, for a call that trains a model.

    Raises:
        WatcherStateError: No adapter yet.
        ConfigError: The adapter watches a graph that a session runs.
    """
    if adapter is None:
        raise WatcherStateError(
            f"{what}() needs an active Watcher with a model: `with graddebug.watch(model) as "
            "dbg: model.fit(..., callbacks=[dbg.callback()])`."
        )
    if has(adapter, SessionGraphs):
        raise ConfigError(
            f"{what}() trains a model (graddebug.check, model.fit), and this Watcher watches a "
            "graph that a session runs: record its steps with dbg.fetches() in your "
            "session.run, or MonitoredTrainingSession(hooks=[dbg.session_hook()])."
        )
    return adapter


def train_step(adapter: Adapter | None, what: str = "train_step") -> TrainStep:
    """The adapter of an active Watcher with a model, for ``graddebug.check``'s train steps.

    Args:
        adapter: The active Watcher's adapter; None outside the block or before one was chosen.
        what: The call, for messages.

    Raises:
        WatcherStateError: No adapter yet.
        ConfigError: The adapter runs no training steps.
    """
    adapter = _trainer(adapter, what)
    if not has(adapter, TrainStep) or not isinstance(adapter, TrainStep):
        raise ConfigError(
            f"{what}() needs a framework that trains models, and the {_named(adapter)} adapter "
            "runs no training step; close each step with dbg.step()."
        )
    return adapter


def callback(adapter: Adapter | None, what: str = "callback") -> TrainingCallback:
    """The adapter of an active Watcher with a model, for ``dbg.callback()``.

    Args:
        adapter: The active Watcher's adapter; None outside the block or before one was chosen.
        what: The call, for messages.

    Raises:
        WatcherStateError: No adapter yet.
        ConfigError: The adapter builds no training callback.
    """
    adapter = _trainer(adapter, what)
    if not has(adapter, TrainingCallback) or not isinstance(adapter, TrainingCallback):
        raise ConfigError(
            f"{what}() builds a training callback, and the {_named(adapter)} adapter has none "
            "(its framework has no fit loop to call one); call dbg.step() after each "
            "training step."
        )
    return adapter
