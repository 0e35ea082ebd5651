"""The ``graddebug`` entry point of the torch adapter. Imports torch only once the user has."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from graddebug.hookspecs import hookimpl

if TYPE_CHECKING:
    from graddebug.adapter import AdapterFactory


@hookimpl
def graddebug_adapter(target: object) -> AdapterFactory | None:
    """Claim ``torch.nn.Module`` and ``torch.Tensor`` objects, when torch is imported."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(target, (torch.nn.Module, torch.Tensor)):
        return None
    from graddebug_torch.adapter import TorchAdapter

    return TorchAdapter
