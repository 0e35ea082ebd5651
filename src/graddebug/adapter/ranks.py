"""Every rank's rows combined into the rows of the global tensors: one rule for every sharding.

A row is the statistic of a tensor's *global* gradient for the *global* batch, whatever the
sharding: data parallelism (each rank holds a slice of the batch), tensor parallelism (a slice
of a layer's features or weights), sharded parameters (FSDP, ZeRO partitions), pipelines (each
rank holds other layers). Each rank measures its local pieces and says, per row, how its piece
relates to the global tensor (a :class:`Share`); :class:`RankCombiner` sends every rank's
numbers to every rank with **one** ``all_gather`` per recorded step and combines them:

- sums of squares, sums, element counts, NaN/Inf flags and squares before an intervention
  add over the counted pieces, each first multiplied by its :attr:`Share.scale`; ``absmax``
  is the largest; a ``whole`` row (the same global values on every rank that holds it) is the
  lowest holder's;
- a dead unit of pieces that split the unit axis counts in its piece (the fractions add,
  weighted by size); of pieces that split the batch, a unit is dead only if it is dead in
  every piece, which per-piece fractions bound from above: the smallest is taken;
- a row of a tensor that is not finite carries the lowest rank whose piece was not (where the
  NaN or Inf was born), the others :data:`~graddebug.records.ALL_RANKS`;
- depth: the lowest holder's, after the depths of the ranks before it where those ranks hold
  other layers (pipeline stages, in rank order, give the model's order).

The layout of the gathered vector is the union of every rank's row keys ``(layer, tensor,
kind)``, the same on every rank. A step on which some rank has a key the union lacks (the
first, or a layer that ran for the first time) exchanges the keys with ``all_gather_object``
and gathers again: a steady-state recorded step costs exactly one collective.

Every rank must call :meth:`RankCombiner.combine` once per recorded step, or the ranks wait on
each other forever; a rank whose own numbers fail to assemble still takes part, and its rows
of that step are dropped on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from graddebug.adapter.rankevents import PeerEvents, digest
from graddebug.records import ALL_RANKS, Event, Record, sums_record

__all__ = ["WHOLE", "Collective", "Partial", "RankCombiner", "Share"]

Key = tuple[str, str, str]


@dataclass(frozen=True, eq=False)
class Partial:
    """This rank's addend of a gradient held as a sum over ranks, not yet reduced (a
    ``Partial`` placement): its values, summed with those of the other ranks of its group,
    are the piece.

    Attributes:
        group: The group's label, the same on every rank whose addends add up to one piece
            (its lowest rank, say).
        values: This rank's addend, flat, in float64.
        rounding: Rounds a sum to the gradient's own precision, as the reduction the
            optimizer's gradient comes from would (None for float32 and wider).
    """

    group: int
    values: np.ndarray
    rounding: Callable[[np.ndarray], np.ndarray] | None = None


@dataclass(frozen=True, slots=True)
class Share:
    """How one rank's row relates to the row of the global (logical) tensor.

    Attributes:
        whole: Every rank that holds the row holds the same global values (a parameter
            gradient that data parallelism averaged, a replicated ``DTensor``, a pipeline
            stage's own parameter): the lowest holder's row is the row.
        counted: False for a piece that is a copy of another rank's (a replicated mesh
            coordinate other than 0): it adds nothing.
        scale: What this piece's gradient values are multiplied by to be the global loss's
            gradient (``1 / replicas`` for a layer output under averaging data parallelism,
            where the global loss is the mean of the ranks' losses).
        units_split: The pieces split the unit axis (features sharded by tensor parallelism);
            otherwise they split the batch, and share their units.
        shape: The global shape, as ``str(tuple)``, where the adapter knows it (a
            ``DTensor``'s); else the lowest holder's local shape.
        split_dim: A dimension the ranks split further (the batch, under data parallelism):
            the global shape is :attr:`shape` with that dimension set so that the shape holds
            the combined number of elements.
        partial: The piece is a sum over the ranks of a group, of which this rank holds an
            addend (small gradients only: its values travel in the collective); the row's
            own numbers are then ignored.
    """

    whole: bool = False
    counted: bool = True
    scale: float = 1.0
    units_split: bool = False
    shape: str | None = None
    split_dim: int | None = None
    partial: Partial | None = None


WHOLE = Share(whole=True)
"""The share of a row whose values are global on every rank that holds it."""


@runtime_checkable
class Collective(Protocol):
    """The two collectives of the process group every rank of the run belongs to."""

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's float64 vector (all of one length), as ``[world_size, n]``."""

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's picklable ``value``, in rank order."""


# The columns of one row in the gathered vector.
(_HELD, _COUNTED, _WHOLE, _DEPTH, _NUMEL, _SQ, _TOTAL, _ABSMAX, _NAN, _INF, _ZERO, _UNITS_SPLIT,
 _PRE, _WEIGHT, _UPDATE, _CLIPPED, _GROUP) = range(17)
_WIDTH = 17
_HEADER = 3  # the rank lacks keys or shapes of the union (1); its deepest depth; its events
_FAILED = -2.0  # the second header column of a rank whose numbers failed to assemble

# What the exchange tells the other ranks of one row: its key, its global shape (where the
# adapter knows it) or its local one, the dimension the pieces split, and how many values of
# a partial addend it sends.
_Described = tuple[Key, str, "int | None", int]


class RankCombiner:
    """Combines each recorded step's rows over every rank (see the module's docstring).

    Args:
        collective: The process group's collectives.
        rank: This process's rank.
    """

    def __init__(self, collective: Collective, rank: int = 0) -> None:
        self._collective = collective
        self._keys: list[Key] = []
        self._index: dict[Key, int] = {}
        self._shapes: dict[Key, tuple[str, int | None]] = {}  # the lowest holder's
        self._sent: dict[Key, tuple[str, int]] = {}  # what this rank sent in the last exchange
        self._extra: dict[Key, int] = {}  # values a partial row's addends send
        self._spans: dict[int, slice] = {}  # where each partial row's values lie, by row
        self._rounding: dict[int, Callable[[np.ndarray], np.ndarray]] = {}
        self._width = 0  # all of them
        self._peers = PeerEvents(rank, self._exchange_events)
        self.peer_events: list[Event] = []
        """The other ranks' events of the latest step (each with its rank)."""
        self.collectives = 0
        """Collectives made so far (the cost a test counts)."""

    def _exchange_events(self, told: Any) -> list[Any]:
        """Every rank's events, when some rank's changed: a collective of its own."""
        self.collectives += 1
        return self._collective.all_gather_object(told)

    def combine(self, step: int, records: Sequence[Record], shares: Sequence[Share] | None,
                events: Sequence[Event] = ()) -> list[Record]:
        """The global rows of ``step`` from this rank's ``records``: one collective.

        Args:
            step: The recorded step.
            records: This rank's rows: each the statistics of its local piece.
            shares: How each row relates to the global tensor, in order; None (this rank
                failed to say) takes part in the collective and drops the step's rows on
                every rank.
            events: This rank's events of the step; the other ranks' are then
                :attr:`peer_events` (:mod:`graddebug.adapter.rankevents`).

        Returns:
            The global rows, the same on every rank, in the union's order.

        Raises:
            Exception: Whatever failed while this rank assembled its numbers, once every rank
                is past the collective.
        """
        local = ({(r.layer, r.tensor, r.kind): (r, s)
                  for r, s in zip(records, shares, strict=True)} if shares is not None else {})
        described = [(key, share.shape or record.shape, share.split_dim,
                      share.partial.values.size if share.partial is not None else 0)
                     for key, (record, share) in local.items()]
        lacking = any(self._sent.get(key) != (shape, extra)
                      for key, shape, _, extra in described)
        failure: Exception | None = None
        if not self._keys:  # the first step on every rank: no layout to fill yet
            self._exchange(described)
            lacking = False
        told = (digest(events), max((e.depth for e in events), default=-1))
        gathered, failure = self._gather(local, shares is None, told, lacking)
        if gathered[:, 0].any():  # some rank has keys or shapes the union lacks
            self._exchange(described)
            gathered, failure = self._gather(local, shares is None, told)
        self._peers.update(gathered[:, 2], events)
        if failure is not None:
            raise failure
        if (gathered[:, 1] == _FAILED).any():
            self.peer_events = []
            return []
        return self._rows(step, gathered, events)

    def _exchange(self, described: list[_Described]) -> None:
        """Extend the union with every rank's keys, in rank order then each rank's order, and
        learn each row's shape from its lowest holder."""
        everyone = self._collective.all_gather_object(described)
        self.collectives += 1
        shapes: dict[Key, tuple[str, int | None]] = {}
        extra: dict[Key, int] = {}
        for rank_rows in everyone:
            for key, shape, split_dim, n in rank_rows:
                key = tuple(key)
                shapes.setdefault(key, (shape, split_dim))
                extra[key] = max(extra.get(key, 0), n)
                if key not in self._index:
                    self._index[key] = len(self._keys)
                    self._keys.append(key)
        self._shapes.update(shapes)
        self._extra.update(extra)
        self._sent = {key: (shape, n) for key, shape, _, n in described}
        self._spans, start = {}, 0
        for at, key in enumerate(self._keys):
            n = self._extra.get(key, 0)
            if n:
                self._spans[at] = slice(start, start + n)
                start += n
        self._width = start

    def _gather(self, local: dict[Key, tuple[Record, Share]], failed: bool,
                told: tuple[float, int], lacking: bool = False
                ) -> tuple[np.ndarray, Exception | None]:
        """Every rank's vector in the union's layout, as ``[world, header + rows x width]``,
        and what failed while this rank filled its own (it takes part all the same)."""
        values = np.zeros((len(self._keys), _WIDTH))
        extras = np.zeros(self._width)
        deepest = float(told[1])
        failure: Exception | None = None
        try:
            for key, (record, share) in local.items():
                at = self._index.get(key)
                if at is None:
                    continue
                _fill(values[at], record, share)
                deepest = max(deepest, float(record.depth))
                span = self._spans.get(at)
                if share.partial is not None and span is not None:
                    extras[span] = share.partial.values
                    if share.partial.rounding is not None:
                        self._rounding[at] = share.partial.rounding
        except Exception as exc:  # the collective must still run on every rank
            failure, failed = exc, True
            values[:] = 0.0
        header = [1.0 if lacking else 0.0, _FAILED if failed else deepest, told[0]]
        payload = np.concatenate([np.array(header), values.reshape(-1), extras])
        self.collectives += 1
        return np.asarray(self._collective.all_gather(payload), dtype=np.float64), failure

    def _rows(self, step: int, gathered: np.ndarray, events: Sequence[Event]) -> list[Record]:
        """The global rows from every rank's vector; the peers' events of the step."""
        world, n = gathered.shape[0], len(self._keys)
        rows = gathered[:, _HEADER:_HEADER + n * _WIDTH].reshape(world, n, _WIDTH)
        extras = gathered[:, _HEADER + n * _WIDTH:]
        for partial, span in self._spans.items():
            _settle(rows[:, partial], extras[:, span], self._rounding.get(partial))
        held = rows[..., _HELD] > 0
        counted = rows[..., _COUNTED] > 0
        # Each rank's layers come after those of the lower ranks that hold other layers.
        deepest = gathered[:, 1]
        before = np.concatenate([[0.0], np.cumsum(np.where(deepest >= 0, deepest + 1, 0))])
        out: list[Record] = []
        for at in np.flatnonzero(counted.any(axis=0)):
            holder = int(np.argmax(held[:, at]))
            shared = bool(held[0, at])  # rank 0 holds it: the ranks hold the same layers
            shift = 0 if shared else int(before[holder])
            out.append(self._row(step, self._keys[at], rows[:, at], counted[:, at], holder,
                                 shift))
        first = {self._keys[at][0] for at in np.flatnonzero(held[0])}
        self.peer_events = self._peers.at(step, events, lambda rank, layer: 0 if (
            rank == 0 or layer in first) else int(before[rank]))
        return out

    def _row(self, step: int, key: Key, values: np.ndarray, counted: np.ndarray, holder: int,
             shift: int) -> Record:
        """One global row from the ranks' values (``values``: ``[world, width]``)."""
        depth_at = values[holder, _DEPTH]
        depth = int(depth_at) + shift if depth_at >= 0 else -1
        shape, split_dim = self._shapes.get(key, ("", None))
        first = int(np.argmax(counted))
        if values[first, _WHOLE] > 0:
            return _record(step, key, depth, shape, values[first], first)
        v = values[counted]
        combined = np.array(values[first])
        for column in (_NUMEL, _SQ, _TOTAL, _NAN, _INF, _WEIGHT, _UPDATE, _CLIPPED):
            combined[column] = v[:, column].sum()
        combined[_ABSMAX] = v[:, _ABSMAX].max()
        pre = v[:, _PRE]
        combined[_PRE] = (np.where(np.isnan(pre), v[:, _SQ], pre).sum()
                          if not np.isnan(pre).all() else math.nan)
        zero, numel = v[:, _ZERO], combined[_NUMEL]
        if values[first, _UNITS_SPLIT] > 0:  # split units: the dead ones add, by size
            combined[_ZERO] = float((zero * v[:, _NUMEL]).sum() / numel) if numel else math.nan
        else:  # shared units: dead in every piece at most
            combined[_ZERO] = zero.min()
        broken = (v[:, _NAN] > 0) | (v[:, _INF] > 0)
        birth = int(np.flatnonzero(counted)[np.argmax(broken)]) if broken.any() else None
        if split_dim is not None:
            shape = _resized(shape, split_dim, int(combined[_NUMEL]))
        return _record(step, key, depth, shape, combined, birth)


def _settle(values: np.ndarray, addends: np.ndarray,
            rounding: Callable[[np.ndarray], np.ndarray] | None) -> None:
    """Turn the addends of a partial row into its pieces: each group's addends summed, the
    sum measured into the row of the group's lowest rank, the others not counted.

    Args:
        values: The row's columns on every rank, ``[world, width]`` (changed in place).
        addends: Every rank's addend, ``[world, n]``.
        rounding: Rounds a sum to the gradient's precision, or None.
    """
    counted = values[:, _COUNTED] > 0
    partial = values[:, _GROUP] > 0
    for group in np.unique(values[counted & partial, _GROUP]):
        members = np.flatnonzero(counted & partial & (values[:, _GROUP] == group))
        piece = addends[members].sum(axis=0)
        if rounding is not None:
            piece = rounding(piece)
        lead = values[members[0]]
        lead[_NUMEL] = piece.size
        lead[_SQ] = float(piece @ piece)
        lead[_TOTAL] = float(piece.sum())
        lead[_ABSMAX] = float(np.abs(piece).max()) if piece.size else -math.inf
        lead[_NAN] = float(np.isnan(piece).any())
        lead[_INF] = float(np.isinf(piece).any())
        values[members[1:], _COUNTED] = 0.0


def _dims(shape: str) -> list[int]:
    """The dimensions of a shape written as ``str(tuple)``."""
    return [int(d) for d in shape.strip("()").split(",") if d.strip()]


def _resized(shape: str, dim: int, numel: int) -> str:
    """``shape`` with dimension ``dim`` set so that it holds ``numel`` elements."""
    dims = _dims(shape)
    if not -len(dims) <= dim < len(dims):
        return shape
    rest = int(np.prod([d for i, d in enumerate(dims) if i != dim % len(dims)]))
    if rest <= 0 or numel % rest:
        return shape
    dims[dim] = numel // rest
    return str(tuple(dims))


def _fill(row: np.ndarray, record: Record, share: Share) -> None:
    """Write one local row's numbers, scaled to the global loss, into its columns."""
    row[_HELD] = 1.0
    row[_DEPTH] = record.depth
    if not share.counted:
        return
    scale = abs(share.scale)
    norm = record.norm * scale
    pre = record.pre_norm * scale
    clipped = record.clipped_norm * scale
    row[_COUNTED] = 1.0
    row[_WHOLE] = 1.0 if share.whole else 0.0
    row[_NUMEL] = record.numel
    row[_SQ] = norm * norm
    row[_TOTAL] = record.mean * record.numel * share.scale if record.numel else 0.0
    row[_ABSMAX] = record.absmax * scale
    row[_NAN] = float(record.nan)
    row[_INF] = float(record.inf)
    row[_ZERO] = record.zero_frac
    row[_UNITS_SPLIT] = 1.0 if share.units_split else 0.0
    row[_PRE] = pre * pre
    if record.numel:  # an empty piece has no weights to sample: it adds nothing
        row[_WEIGHT] = record.weight_norm ** 2
        row[_UPDATE] = record.update_norm ** 2
    row[_CLIPPED] = clipped * clipped
    if share.partial is not None:
        row[_GROUP] = share.partial.group + 1.0


def _record(step: int, key: Key, depth: int, shape: str, v: np.ndarray,
            birth: int | None) -> Record:
    """A record from combined columns (sums of squares and sums)."""
    layer, tensor, kind = key
    nan, inf = bool(v[_NAN] > 0), bool(v[_INF] > 0)
    rank = birth if (nan or inf) and birth is not None else ALL_RANKS
    return sums_record(step, layer, tensor, kind, depth, shape, int(v[_NUMEL]),
                       _root(v[_SQ]), float(v[_TOTAL]), float(v[_ABSMAX]), float(v[_ZERO]),
                       nan, inf, _root(v[_PRE]), rank, _root(v[_WEIGHT]), _root(v[_UPDATE]),
                       _root(v[_CLIPPED]))


def _root(square: float) -> float:
    """The square root of a sum of squares (NaN stays NaN)."""
    return math.sqrt(square) if square >= 0 else math.nan
