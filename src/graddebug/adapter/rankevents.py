"""Every rank's events seen by every rank, at no cost in the steady state.

A rank's events (a cut graph, an output that got no gradient, a NaN in the forward pass) are
about the layers it runs. Where the ranks run the same layers (data and tensor parallelism)
each sees the same events; where they run different ones (pipeline stages) a stage's events
would stay on its rank, and the findings of the other ranks would miss them. So each rank
sends a digest of its events (without their step) in the header of the step's one gather
(:class:`graddebug.adapter.ranks.RankCombiner`); only on a step where some rank's digest
changed are the events themselves exchanged, and otherwise each peer's last events stand for
this step too. A cut that is there at every step costs one exchange, when it first appears.

The peers' events are for this process's live findings; each rank writes only its own to the
run's files.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from graddebug.records import Event

__all__ = ["PeerEvents", "digest"]

_Told = tuple[str, str, int, str, str, str]  # layer, tensor, depth, event, detail, source


def _told(event: Event) -> _Told:
    """What a rank tells the others of one event (not its step nor its rank)."""
    return (event.layer, event.tensor, event.depth, event.event, event.detail, event.source)


def digest(events: Sequence[Event]) -> float:
    """A number that changes when the events (their step and rank aside) do; exact in a
    float64, the same in every process."""
    text = repr(sorted(_told(e) for e in events)).encode()
    return float(zlib.crc32(text))


_NONE = digest(())


class PeerEvents:
    """The other ranks' latest events, refreshed when their digests change.

    Args:
        rank: This process's rank.
        exchange: ``all_gather_object`` of the process group.
    """

    def __init__(self, rank: int, exchange: Callable[[Any], list[Any]]) -> None:
        self._rank = rank
        self._exchange = exchange
        self._digests: np.ndarray | None = None
        self._told: list[list[_Told]] = []
        self.exchanges = 0
        """How often the events themselves were exchanged."""

    def update(self, digests: np.ndarray, events: Sequence[Event]) -> None:
        """Take every rank's digest from the step's gather; exchange the events if any
        changed (every rank sees the same digests, so all of them exchange together)."""
        before = self._digests if self._digests is not None else np.full_like(digests, _NONE)
        if np.array_equal(digests, before):  # no rank's events changed (or none has any)
            return
        self._told = [list(map(tuple, told))
                      for told in self._exchange([_told(e) for e in events])]
        self._digests = np.array(digests)
        self.exchanges += 1

    def at(self, step: int, own: Sequence[Event], depth_shift: Callable[[int, str], int]
           ) -> list[Event]:
        """The peers' events at ``step``, each with its rank, less those this rank has too.

        Args:
            step: The step they stand for.
            own: This rank's events of the step.
            depth_shift: How far a rank's depth of a layer moves in the model's order.
        """
        mine = {(e.layer, e.tensor, e.event) for e in own}
        out: list[Event] = []
        for rank, told in enumerate(self._told):
            if rank == self._rank:
                continue
            for layer, tensor, depth, event, detail, source in told:
                if (layer, tensor, event) in mine:
                    continue
                mine.add((layer, tensor, event))
                moved = depth + depth_shift(rank, layer) if depth >= 0 else depth
                out.append(Event(step, layer, tensor, moved, event, detail, rank, source))
        return out
