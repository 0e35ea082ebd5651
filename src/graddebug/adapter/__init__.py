"""The interface between the framework-free core and a framework adapter.

:mod:`~graddebug.adapter.protocol` holds the protocol every adapter implements, the capability
protocols of what only some frameworks can do, and the two sides of the Watcher that adapters
and training callbacks see; :mod:`~graddebug.adapter.options` holds :class:`WatchOptions`, the
options of ``watch`` documented once; :mod:`~graddebug.adapter.base` holds the bookkeeping
every adapter shares; :mod:`~graddebug.adapter.capabilities` checks what an adapter class
declares (its capabilities and the options it honours) against what it implements. The
"Writing an adapter" section of ``docs/plugins.md`` walks through a complete one.

An adapter imports this package, :mod:`graddebug.capture.layers`, :mod:`graddebug.records`, the
errors and the integration helpers, and nothing else of the core.
"""

from __future__ import annotations

from graddebug.adapter.base import BaseAdapter
from graddebug.adapter.options import WatchOptions
from graddebug.adapter.protocol import (
    Adapter,
    AdapterFactory,
    CallbackContext,
    CompiledTiers,
    Distributed,
    Distribution,
    GradientSource,
    HostSide,
    ReadAhead,
    SessionGraphs,
    StepClock,
    StepResult,
    Training,
    TrainingCallback,
    TrainStep,
    WatchContext,
)

__all__ = [
    "Adapter",
    "AdapterFactory",
    "BaseAdapter",
    "CallbackContext",
    "CompiledTiers",
    "Distributed",
    "Distribution",
    "GradientSource",
    "HostSide",
    "ReadAhead",
    "SessionGraphs",
    "StepClock",
    "StepResult",
    "TrainStep",
    "Training",
    "TrainingCallback",
    "WatchContext",
    "WatchOptions",
]
