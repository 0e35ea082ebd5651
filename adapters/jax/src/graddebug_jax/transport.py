"""How a step's statistics leave the device: once per recorded step, by one of four routes.

Every source of rows (a backward pass's chain of layer outputs, the model's input check, an
optax monitor's update, Keras's loss) hands a :class:`Parcel` to the adapter's :class:`Transport`.
A traced parcel waits in its trace until a *carrier* gathers every parcel of that trace: the
optimizer's update (the optax monitor, Keras's ``stateless_apply``) where one is bound, since it
runs after the backward pass in the same compiled step; else the backward pass's last sink.
:func:`choose_route` then picks the route, the one place where that choice is made:

=========== ============================== ================================ ===================
route       chosen where                   how the rows travel              when they land
=========== ============================== ================================ ===================
``HELD``    the parcel's arrays are        held on the host side as device  at the close, which
            concrete (eager code)          arrays                           fetches every held
                                                                            parcel at once
``STATE``   a monitor carries them, the    written into the monitor's state at the close, which
            ``nnx.Optimizer`` that keeps   (:class:`.updates.MonitorState`, fetches the state
            its state is known, and they   behind a layout key), which      as a held parcel
            fit its room                   ``nnx.jit`` hands back
``TIED``    a carrier whose output the     one ``jax.pure_callback``, its   when the step runs;
            close waits for (an update's   zero result folded into the      the close waits for
            step count; the model given)   carrier's integer output         the weights
``EFFECT``  any other traced parcel: no    one ``jax.debug.callback``       when the step runs;
            carrier, or one the close                                       the close waits
            cannot wait for (Keras fit)                                     with
                                                                            ``effects_barrier``
=========== ============================== ================================ ===================

A traced parcel that no carrier gathered (the update compiled apart from the backward pass) is
an *orphan*: the close finds it, warns once, and the adapter's sinks send their chains' rows
themselves from then on (:meth:`Transport.stop_carrying`).

Why four: an effectful ``jax.debug.callback`` sends every call of a compiled step down JAX's
Python dispatch path instead of its C++ one, which a ``pure_callback`` tied to an integer
output of the step avoids (tied to a floating one, even as ``x - 0.0``, it changed how XLA
fused the update and the last bit of some weights); any host callback makes a compiled step
run synchronously on the CPU, which the state route avoids; and eager code has nothing to
compile a callback into. The performance page gives the measurements.

Parcels of one trace are told apart from those of another by the trace that is current when
each is posted (``jax.extend.core.get_opaque_trace_state``): a chain's sink and a carrier run
with the compiled step's trace current; the input check and Keras's loss post from the forward
rule of a ``custom_vjp`` identity, which runs there too (:func:`.outputs.post_with`).
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from graddebug.capture.layers import FailOpen

__all__ = ["Land", "Parcel", "Route", "Transport", "choose_route", "send"]

Land = Callable[[Sequence[np.ndarray]], None]
"""``land(values)``: turns a parcel's arrays, now numpy on the host, into pending rows."""


class Route(enum.Enum):
    """How a parcel's rows leave the device (the table of the module's docstring)."""

    HELD = "held"
    """Eager: held as device arrays; the close fetches every held parcel in one transfer."""
    STATE = "state"
    """Written into the monitor's state; the close fetches it from the ``nnx.Optimizer``."""
    TIED = "tied"
    """One ``jax.pure_callback`` folded into the carrier's integer output."""
    EFFECT = "effect"
    """One ``jax.debug.callback``; the close waits for it with ``jax.effects_barrier()``."""


def choose_route(*, traced: bool, fits_state: bool = False, tie: bool = False) -> Route:
    """The route of a batch of parcels, the one choice of this module.

    Args:
        traced: Any of their arrays is a tracer (inside ``jit``).
        fits_state: A monitor carries them, the ``nnx.Optimizer`` that keeps its state is
            known, and they fit the state's room.
        tie: The carrier has an integer output the close waits for.
    """
    if not traced:
        return Route.HELD
    if fits_state:
        return Route.STATE
    if tie:
        return Route.TIED
    return Route.EFFECT


@dataclass
class Parcel:
    """One batch of statistics bound for the host.

    Attributes:
        arrays: Device arrays (eager) or tracers (inside a trace).
        land: What the host does with their values.
        rows: Whether it holds gradient rows (a chain, an update); the input check's codes
            do not, and are no reason to close a step.
        chain: Whether it is a backward pass's chain of layer-output rows (the parcels that
            make an orphan).
    """

    arrays: list[Any]
    land: Land
    rows: bool = True
    chain: bool = False

    @property
    def traced(self) -> bool:
        """Whether any of its arrays is a tracer."""
        return any(isinstance(a, jax.core.Tracer) for a in self.arrays)


def _current_trace() -> Any:
    """The trace current now, as an opaque key (JAX's public handle on it)."""
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


def _unpack(parcels: list[Parcel], values: Sequence[Any],
            on_bug: Callable[[BaseException, str], None] | None) -> None:
    """Land each parcel's share of ``values``; a bug in landing one (fail-open, where
    ``on_bug`` is given) loses that parcel's rows only."""
    at = 0
    for parcel in parcels:
        n = len(parcel.arrays)
        share = [np.asarray(v) for v in values[at:at + n]]
        at += n
        if on_bug is None:
            parcel.land(share)
            continue
        with FailOpen(on_bug, "host transfer"):  # the user's step goes on
            parcel.land(share)


def _integer_leaf(leaves: list[Any]) -> int | None:
    """The smallest integer array among ``leaves`` (a step count), or None."""
    best: int | None = None
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.integer) and (
                best is None or leaf.size < leaves[best].size):
            best = i
    return best


def send(parcels: list[Parcel], received: Callable[[], None], tie: Any = None,
         on_bug: Callable[[BaseException, str], None] | None = None) -> Any:
    """Hand ``parcels`` to the host in one callback: :attr:`Route.TIED` where ``tie`` has an
    integer leaf (returned with the callback's zero result folded into its smallest one, the
    same values), else :attr:`Route.EFFECT` (``tie`` returned as it is).

    Args:
        parcels: What goes to the host, traced.
        received: Called on the host once per delivery (the transfer count).
        tie: A pytree of the carrier's output that the compiled step keeps, or None.
        on_bug: Records a bug of the host side, which must not fail the compiled step
            (fail-open); None lets it raise.
    """
    arrays = [a for p in parcels for a in p.arrays]
    leaves, treedef = jax.tree_util.tree_flatten(tie)
    at = _integer_leaf(leaves)

    def deliver(*values: Any) -> None:
        received()
        _unpack(parcels, values, on_bug)

    if at is None:
        jax.debug.callback(deliver, *arrays)
        return tie

    def deliver_zero(*values: Any) -> np.ndarray:
        deliver(*values)
        return np.zeros((), np.int32)

    zero = jax.pure_callback(deliver_zero, jax.ShapeDtypeStruct((), jnp.int32), *arrays)
    leaves[at] = leaves[at] - zero.astype(leaves[at].dtype)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class Transport:
    """The parcels of one adapter: held (eager), waiting in a trace, or sent.

    Args:
        received: Counts one host transfer (called on the runtime's thread).
        hold: Keeps an eager parcel for the close's one fetch.
        on_bug: Records a bug of the host side of a callback.
    """

    def __init__(self, received: Callable[[], None], hold: Callable[[Parcel], None],
                 on_bug: Callable[[BaseException, str], None]) -> None:
        self._received = received
        self._hold = hold
        self._on_bug = on_bug
        self._waiting: list[tuple[Any, Parcel]] = []
        self._lock = threading.Lock()
        self.carried = False
        """Whether a carrier (an optimizer update in the same trace) gathers the chains."""
        self.tied = False
        """Whether a carrier may tie its callback to its output (:attr:`Route.TIED`): only
        where the close can wait for that output, since ``jax.effects_barrier()`` does not wait
        for a ``pure_callback``."""
        self.routes: Counter[Route] = Counter()
        """How many batches took each route (counted when chosen: once a trace, once an
        eager step)."""

    def route(self, parcels: Sequence[Parcel], *, fits_state: bool = False, tie: Any = None
              ) -> Route:
        """:func:`choose_route` for ``parcels``, counted in :attr:`routes`."""
        chosen = choose_route(
            traced=any(p.traced for p in parcels), fits_state=fits_state,
            tie=self.tied and _integer_leaf(jax.tree_util.tree_leaves(tie)) is not None)
        self.routes[chosen] += 1
        return chosen

    def post(self, parcel: Parcel) -> None:
        """A source's parcel: held when eager, else left in its trace for a carrier."""
        if not parcel.traced:
            self._hold(parcel)
            return
        with self._lock:
            self._waiting.append((_current_trace(), parcel))

    def gather(self, own: Parcel | None = None, tie: Any = None) -> Any:
        """Send ``own`` and every parcel waiting in the current trace, in one callback (or
        hold them, eager); return ``tie`` as :func:`send` does."""
        mine = [] if own is None else [*self.take_trace(), own]
        if not mine:
            return tie
        chosen = self.route(mine, tie=tie)
        if chosen is Route.HELD:
            for parcel in mine:
                self._hold(parcel)
            return tie
        if chosen is Route.TIED:
            return send(mine, self._received, tie, self._on_bug)
        send(mine, self._received, None, self._on_bug)
        return tie

    def sink(self, chain: Parcel) -> None:
        """A backward pass's chain is complete: post it where a carrier will gather it, else
        send it now with the trace's other parcels (:attr:`Route.EFFECT`: the close has
        nothing of this trace's outputs to wait on, only the effects barrier)."""
        if self.carried or not chain.traced:
            self.post(chain)
            return
        mine = [*self.take_trace(), chain]
        self.route(mine)
        send(mine, self._received, None, self._on_bug)

    def take_trace(self) -> list[Parcel]:
        """The parcels waiting in the current trace, no longer waiting (for a carrier)."""
        trace = _current_trace()
        with self._lock:
            mine = [p for t, p in self._waiting if t == trace]
            self._waiting = [(t, p) for t, p in self._waiting if t != trace]
        return mine

    def orphans(self) -> bool:
        """Drop what waited in finished traces; whether a chain was among it (outside any
        trace, every parcel still waiting belongs to a finished one)."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        return any(p.chain for _, p in waiting)

    def stop_carrying(self) -> None:
        """The chains' sinks send their rows themselves from now on."""
        self.carried = False

    def reset(self) -> None:
        """Forget the waiting parcels and the carrier (detach)."""
        with self._lock:
            self._waiting = []
        self.carried = self.tied = False
