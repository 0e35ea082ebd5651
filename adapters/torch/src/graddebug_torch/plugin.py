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
    """Claim ``torch.nn.Module`` and ``torch.Tensor`` objects, when torch is imported."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(target, (torch.nn.Module, torch.Tensor)):
        return None
    from graddebug_torch.adapter import TorchAdapter

    return TorchAdapter


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
