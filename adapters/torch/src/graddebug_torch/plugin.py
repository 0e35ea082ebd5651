"""The ``graddebug`` entry point of the torch adapter. Imports torch only once the user has
(the demo imports it when ``graddebug demo`` asks for it)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from graddebug.hookspecs import hookimpl

if TYPE_CHECKING:
    from graddebug.adapter import AdapterFactory
    from graddebug.report.report import Report


@hookimpl
def graddebug_adapter(target: object) -> AdapterFactory | None:
    """Claim ``torch.nn.Module`` and ``torch.Tensor`` objects, when torch is imported; a Keras
    layer or model on the torch backend (a ``torch.nn.Module`` too) is left to the Keras
    adapter (graddebug-keras), whose callback and names are Keras's."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if "torch.distributed.pipelining.schedules" in sys.modules:
        from graddebug_torch.pipeline import claim as claim_pipeline

        pipeline = claim_pipeline(target)  # a schedule; a stage's module is refused
        if pipeline is not None:
            return pipeline
    if not isinstance(target, (torch.nn.Module, torch.Tensor)):
        return None
    if _keras_layer(target):
        return None
    if "deepspeed" in sys.modules:  # an engine, or the module of a ZeRO engine (refused)
        from graddebug_torch.deepspeed import claim

        engine = claim(target)
        if engine is not None:
            return engine
    from graddebug_torch.adapter import TorchAdapter

    return TorchAdapter


def _keras_layer(target: object) -> bool:
    """Whether ``target`` is a Keras layer (checked only when the user imported Keras)."""
    keras = sys.modules.get("keras")
    layers = getattr(keras, "layers", None) if keras is not None else None
    return layers is not None and isinstance(target, layers.Layer)


@hookimpl
def graddebug_demo(steps: int, seed: int) -> Report | None:
    """Train a 12-layer sigmoid MLP whose first layers get no gradient (when torch is
    installed)."""
    try:
        from graddebug_torch.demo import run_demo
    except ImportError:  # torch is missing or broken: another plugin may offer a demo
        return None

    return run_demo(steps=steps, seed=seed).report(metadata={"demo": (
        f"a 12-layer sigmoid MLP with default init, {steps} SGD steps on synthetic data")})
