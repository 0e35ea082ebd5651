"""How a step's statistics leave the device: once per recorded step.

Every source of rows (a backward pass's chain of layer outputs, the model's input check, an
optax monitor's update, Keras's loss) hands a :class:`Parcel` to the adapter's :class:`Outlet`.
What the outlet does with it depends on where it was made:

- **Eager** (the arrays are concrete): the parcel is held, and the step's close fetches every
  held parcel in one transfer.
- **Traced** (inside ``jax.jit``/``nnx.jit``): the parcel waits in the trace until a *carrier*
  gathers every parcel of that trace, into one host callback or into the optax monitor's
  state (:meth:`Outlet.take_trace`, :mod:`.updates`). The carrier is the optimizer's
  update (the optax monitor, Keras's ``stateless_apply``) where one is bound, since it runs
  after the backward pass in the same compiled step; else the backward pass's last sink.
  A traced parcel that no carrier gathered (the update compiled apart from the backward pass)
  is an *orphan*: the close finds it, warns once, and the adapter sends its chains' rows
  itself from then on (:meth:`Outlet.stop_carrying`).

A carrier's callback is a ``jax.pure_callback`` whose (zero) result is subtracted from an
integer array of the carrier's output (an optimizer's step count), which keeps it from being
removed as dead code and changes no value. Not a floating one: tying it to an update, even as
``x - 0.0`` or as an XOR of the bits with 0, changed how XLA fused the update and the last
bit of some weights after a few steps (the observer-effect test caught it); the count is
computed apart from the weights. The close waits for the weights the same compiled step
wrote, which the runtime marks ready when the whole step (the callback included) has run
(:attr:`Outlet.tied`). An effectful
``jax.debug.callback`` would do the same work, but any effect in a compiled program sends
every call of it down JAX's Python dispatch path instead of its C++ one: measured on the
shared 2-core CPU (``nnx.jit`` train step of the benchmark transformer, 300 interleaved
steps), plain 7.0 ms, with one ``debug.callback`` 9.3 ms, with one tied ``pure_callback``
7.8 ms. Elsewhere (a sink that sends its chain itself, or a carrier whose output the close
cannot wait for) the outlet uses ``debug.callback``, whose effect ``jax.effects_barrier()``
waits for.

What one callback still costs, on the CPU: any host callback makes the compiled step run
synchronously (the call returns only when the step is done; a 150 ms step measured 0.15 ms to
dispatch without one, 176 ms with one), so the Python work of ``nnx.jit`` (flattening the
model's graph, about 1-2 ms here) no longer overlaps the computation. Measured on the
benchmark's step (400 interleaved steps): the same parameter reductions returned as outputs
cost 2-5% over plain, and with one tied ``pure_callback`` 18-33%. Hence the monitor's state:
an ``nnx.Optimizer`` writes it back out of ``nnx.jit`` like any output, and the close fetches
it. A state whose shapes changed would retrace the step, so its room is fixed when the
optimizer is built, from the parameters' count (:func:`.updates.extra_size`): the
parameter rows, the input codes, and a backward pass's layer-output rows where they fit (a
chain's size is known only once the model is traced). Measured with
``benchmarks/overhead_jax.py`` (interleaved runs, 2-core CPU), ``params`` configuration:
MLP 1.52-1.53x with the callback, 1.23-1.24x with the state; transformer 1.24-1.30x and
1.19-1.21x.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Land", "Outlet", "Parcel", "send"]

Land = Callable[[Sequence[np.ndarray]], None]
"""``land(values)``: turns a parcel's arrays, now numpy on the host, into pending rows."""


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


def _trace(parcel: Parcel) -> Any:
    """The trace that made the parcel's arrays. Not the trace current where it is posted: the
    input check runs under ``grad``'s trace, but on arrays of the enclosing ``jit``'s, which
    is where the carrier runs."""
    for array in parcel.arrays:
        if isinstance(array, jax.core.Tracer):
            return array._trace
    return None


def _concrete(parcel: Parcel) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in parcel.arrays)


def _unpack(parcels: list[Parcel], values: Sequence[Any]) -> None:
    at = 0
    for parcel in parcels:
        n = len(parcel.arrays)
        parcel.land([np.asarray(v) for v in values[at:at + n]])
        at += n


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
    """Hand ``parcels`` to the host in one callback; return ``tie`` with the callback's (zero)
    result folded into its smallest integer leaf (the same values).

    Args:
        parcels: What goes to the host, traced.
        received: Called on the host once per delivery (the transfer count).
        tie: A pytree of the carrier's output that the compiled step keeps; None (or one
            without an integer leaf) falls back to ``jax.debug.callback``.
        on_bug: Records a bug of the host side, which must not fail the compiled step
            (fail-open); None lets it raise.
    """
    arrays = [a for p in parcels for a in p.arrays]
    leaves, treedef = jax.tree_util.tree_flatten(tie)
    at = _integer_leaf(leaves)

    def deliver(*values: Any) -> None:
        received()
        if on_bug is None:
            _unpack(parcels, values)
            return
        try:
            _unpack(parcels, values)
        except Exception as exc:  # fail-open: the user's step goes on
            on_bug(exc, "host transfer")

    if at is None:
        jax.debug.callback(deliver, *arrays)
        return tie

    def deliver_zero(*values: Any) -> np.ndarray:
        deliver(*values)
        return np.zeros((), np.int32)

    zero = jax.pure_callback(deliver_zero, jax.ShapeDtypeStruct((), jnp.int32), *arrays)
    leaves[at] = leaves[at] - zero.astype(leaves[at].dtype)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class Outlet:
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
        """Whether a carrier may tie its callback to its output (:func:`send`): only where the
        close can wait for that output, since ``jax.effects_barrier()`` does not wait for a
        ``pure_callback``."""

    def post(self, parcel: Parcel) -> None:
        """A source's parcel: held when eager, else left in its trace for a carrier."""
        if _concrete(parcel):
            self._hold(parcel)
            return
        with self._lock:
            self._waiting.append((_trace(parcel), parcel))

    def gather(self, own: Parcel | None = None, tie: Any = None) -> Any:
        """Send ``own`` and every parcel waiting in its trace, in one callback (or hold them,
        eager); return ``tie`` as :func:`send` does."""
        mine = [] if own is None else self._take(_trace(own))
        if own is not None:
            mine.append(own)
        if not mine:
            return tie
        if all(_concrete(p) for p in mine):
            for parcel in mine:
                self._hold(parcel)
            return tie
        if not self.tied:
            send(mine, self._received, None, self._on_bug)
            return tie
        return send(mine, self._received, tie, self._on_bug)

    def sink(self, chain: Parcel) -> None:
        """A backward pass's chain is complete: post it where a carrier will gather it, else
        send it now with the trace's other parcels (``jax.debug.callback``: the close has
        nothing of this trace's outputs to wait on, only the effects barrier)."""
        if self.carried or _concrete(chain):
            self.post(chain)
            return
        send([*self._take(_trace(chain)), chain], self._received, None, self._on_bug)

    def take_trace(self, own: Parcel) -> list[Parcel]:
        """The parcels waiting in ``own``'s trace, no longer waiting (for a carrier that
        stores them instead of sending them)."""
        return self._take(_trace(own))

    def _take(self, trace: Any) -> list[Parcel]:
        """The parcels waiting in ``trace``, no longer waiting."""
        if trace is None:
            return []
        with self._lock:
            mine = [p for t, p in self._waiting if t is trace]
            self._waiting = [(t, p) for t, p in self._waiting if t is not trace]
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
