"""The public interface of graddebug_jax's recording, for every adapter that records through
JAX's identities: :class:`~graddebug_jax.adapter.JaxAdapter` and Keras on the JAX backend
(``graddebug_keras.jax_backend``).

An adapter owns one :class:`Recorder` and calls its methods; it never subclasses another
adapter nor reads its private state. The Recorder holds the open step's rows
(:class:`.closing.StepRows`), the transport of its parcels (:class:`.transport.Transport`) and the
chains of identities that measure layer outputs and taps (:class:`.outputs.Chains`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graddebug.adapter import StepResult
from graddebug.capture.layers import FailOpen, LayerSpec
from graddebug.errors import ConfigError
from graddebug_jax.closing import ParamNamer, StepRows
from graddebug_jax.outputs import Chains, check_inputs, post_with, probe_args, watch_leaves
from graddebug_jax.transport import Parcel, Route, Transport

__all__ = ["Recorder"]

OnBug = Callable[[BaseException, str], None]
WarnOnce = Callable[[str, str], None]

_ORPHAN = (
    "graddebug: a backward pass was compiled apart from the optimizer update that was to carry "
    "its layer-output rows to the host (one transfer per step); its rows are missing until it "
    "is traced again, and from then on it sends them itself (a second transfer per step). Put "
    "the gradient and optimizer.update in one jitted step to keep one.")


class Recorder:
    """The rows, transport and chains of one adapter.

    Args:
        namer: Names a parameter row's path ``(layer, tensor, depth)``; called at the close.
        guard: The adapter's fail-open guard of the close.
        on_bug: Records a bug caught in a hook or a callback (``internal_error``).
        warn_once: ``warn_once(key, message)`` of the Watcher.
    """

    def __init__(self, namer: ParamNamer, guard: FailOpen, on_bug: OnBug,
                 warn_once: WarnOnce) -> None:
        self._rows = StepRows(namer, guard)
        self._transport = Transport(self._rows.received, self._rows.hold, on_bug)
        self._chains = Chains(self._rows.add_layers, on_bug, self._transport)
        self._warn_once = warn_once

    # -- what the adapter reports --------------------------------------------------------

    @property
    def transfers(self) -> int:
        """Device-to-host transfers of statistics so far (callbacks and fetches)."""
        return self._rows.transfers

    @property
    def routes(self) -> Counter[Route]:
        """How many batches of parcels took each :class:`~.transport.Route`."""
        return self._transport.routes

    @property
    def tied(self) -> bool:
        """Whether a carrier ties its callback to an output the close waits for."""
        return self._transport.tied

    @property
    def transport(self) -> Transport:
        """The transport, which a carrier (the optax monitor) stores or sends through."""
        return self._transport

    def pending(self) -> bool:
        """Whether gradient rows arrived, or wait, since the last close (waits for the
        callbacks in flight)."""
        return self._rows.pending()

    # -- capture (while the user's step is traced or runs) ------------------------------

    @staticmethod
    def check_tap(tensor: Any, name: str, who: str) -> None:
        """Refuse a tap of anything but a floating-point JAX array.

        Raises:
            ConfigError: ``tensor`` is not one; ``who`` names the adapter.
        """
        if not isinstance(tensor, jax.Array) or not jnp.issubdtype(tensor.dtype, jnp.floating):
            raise ConfigError(
                f"tap({type(tensor).__name__}, {name!r}): {who} taps floating-point jax arrays "
                "(and tracers inside jit/grad) only.")

    def watch(self, x: Any, layer: LayerSpec, tensor: str = "output",
              inputs_need_grad: bool = False) -> Any:
        """Pass one array through the identity that records (and alters) its cotangent."""
        return self._chains.watch(x, layer, tensor, inputs_need_grad)

    def watch_output(self, layer: LayerSpec, out: Any, inputs_need_grad: bool) -> Any:
        """A layer's output with every floating leaf watched (:func:`.outputs.watch_leaves`)."""
        return watch_leaves(self._chains, layer, out, inputs_need_grad)

    @staticmethod
    def probe_args(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[list[bool]]]:
        """A layer's arguments probed for whether they need a gradient
        (:func:`.outputs.probe_args`)."""
        return probe_args(args)

    def check_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Parcel | None:
        """The NaN/Inf check of a model's floating arguments, as a parcel for
        :meth:`post_with` (None where there is none): a non-finite one is an
        ``input_nonfinite`` event of the step, the data's fault."""
        return check_inputs(args, kwargs, self._rows.add_inputs)

    def post_with(self, out: Any, parcel: Parcel) -> Any:
        """Post a parcel of a forward pass once its output exists (:func:`.outputs.post_with`)."""
        return post_with(out, parcel, self._transport)

    def post(self, parcel: Parcel) -> None:
        """Post a parcel made where the compiled step's trace is current (a forward rule)."""
        self._transport.post(parcel)

    def carry(self, tied: bool) -> None:
        """An optimizer update in the same trace carries the chains from now on; ``tied``:
        the close can wait for its output (:attr:`.transport.Route.TIED`)."""
        self._transport.carried = True
        self._transport.tied = tied

    def gather(self, own: Parcel, tie: Any = None) -> Any:
        """A carrier's parcel, sent with every parcel waiting in its trace (or held, eager);
        returns ``tie`` as :func:`.transport.send` does."""
        return self._transport.gather(own, tie)

    # -- the host side ------------------------------------------------------------------

    def add_params(self, paths: list[str], shapes: list[tuple[int, ...]], rows: np.ndarray
                   ) -> None:
        """Parameter rows that reached the host (a carrier's callback)."""
        self._rows.add_params(paths, shapes, rows)

    def hold_params(self, paths: list[str], shapes: list[tuple[int, ...]], rows: Any) -> None:
        """Parameter rows on the device (``dbg.step(grads)``), fetched by the close."""
        self._rows.hold(Parcel([rows], lambda values: self._rows.add_params(
            paths, shapes, values[0])))

    def hold(self, parcel: Parcel) -> None:
        """A parcel of device arrays for the close's one fetch (what a state stored)."""
        self._rows.hold(parcel)

    def settle(self) -> bool:
        """Before a close: drop the parcels no carrier gathered. Where one was a chain, the
        update that was to carry it runs in another compiled function: warn once, and let the
        chains send their rows themselves from the next trace on. Returns whether one was."""
        if not self._transport.orphans():
            return False
        self._transport.stop_carrying()
        self._warn_once("jax-orphan", _ORPHAN)
        return True

    def close(self, step: int) -> StepResult:
        """The records and events of what arrived and what is held; then clear."""
        return self._rows.close(step)

    def skip(self) -> StepResult:
        """A step ``every=`` does not record: wait for its callbacks, drop what they sent."""
        self._rows.pending()
        self._rows.clear()
        return StepResult()

    def reset(self) -> None:
        """Forget what the rows, the transport and the chains hold (detach)."""
        self._chains.reset()
        self._transport.reset()
        self._rows.clear()
