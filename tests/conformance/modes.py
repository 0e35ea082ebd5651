"""The table of modes: every adapter, in every way it is driven, with what it cannot do.

A mode names its driver (``module:Class``), the modules it needs, the Keras backend of the
child process it runs in (Keras reads ``KERAS_BACKEND`` once per process), the scenarios it
cannot run and why, and the scenarios it fails today because of an adapter bug (strict xfail:
the day the bug is fixed, the test says so).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NO_OPTIMIZER_VIEW = "the adapter records no weight_norm or update_norm"
STRICT_WRAPPED = ("strict=True raises, but the GradDebugInternalError reaches the user wrapped "
                  "in {}, not as itself")


@dataclass(frozen=True)
class Mode:
    """One adapter in one mode.

    Attributes:
        id: The mode's name in the test ids (``"tf-function"``).
        driver: ``"module:Class"`` of its :class:`drivers.Driver`.
        needs: Modules it imports (the mode is skipped where one is not installed).
        backend: ``KERAS_BACKEND`` of the child process it runs in; None: in the test process.
        excluded: Scenarios it cannot run, each with the reason.
        xfail: Scenarios it fails because of a known adapter bug, each with the bug.
        slow: Run in CI's slow step only (``-m slow``), to keep the fast run near 90 s on two
            cores: the modes that trace or compile again for every scenario's new model, or
            start a process of their own. The fast run keeps one mode of each adapter.
    """

    id: str
    driver: str
    needs: tuple[str, ...] = ()
    backend: str | None = None
    excluded: Mapping[str, str] = field(default_factory=dict)
    xfail: Mapping[str, str] = field(default_factory=dict)
    slow: bool = False

    def build(self) -> Any:
        """A new driver of this mode."""
        module, name = self.driver.split(":")
        return getattr(importlib.import_module(module), name)()


MODES: tuple[Mode, ...] = (
    Mode("torch", "drivers:TorchDriver", ("torch",)),
    Mode("tf-eager", "tf_drivers:TapeDriver", ("tensorflow", "keras"), slow=True),
    Mode("tf-function", "tf_drivers:FunctionDriver", ("tensorflow", "keras"),
         xfail={"fail-open-strict": STRICT_WRAPPED.format("autograph's StagingError")}),
    Mode("keras-fit-tf", "tf_drivers:FitDriver", ("tensorflow", "keras"), slow=True),
    Mode("keras-fit-torch", "tf_drivers:FitDriver", ("keras", "torch"), backend="torch",
         slow=True),
    Mode("keras-fit-jax", "tf_drivers:FitDriver", ("keras", "jax"), backend="jax", slow=True,
         xfail={"fail-open-strict": STRICT_WRAPPED.format(
             "jax.errors.JaxRuntimeError (it is raised in a host callback)")}),
    Mode("tf1-session", "tf_drivers:SessionDriver", ("tensorflow",),
         excluded={"optimizer": NO_OPTIMIZER_VIEW}),
    Mode("jax-eager", "jax_drivers:EagerDriver", ("jax", "flax", "optax"), slow=True),
    Mode("jax-jit", "jax_drivers:JitDriver", ("jax", "flax", "optax")),
    Mode("toy", "drivers:ToyDriver",
         excluded={"optimizer": NO_OPTIMIZER_VIEW + ": the toy reference adapter has only "
                                                    "the StepClock capability"}),
)

BY_ID = {mode.id: mode for mode in MODES}
