"""The one rule for every sharding (graddebug.adapter.ranks), without a framework.

Each test cuts a numpy gradient into per-rank pieces the way a sharding would (a batch split,
a feature split, replicated copies, pipeline stages), measures each piece as an adapter would,
runs one RankCombiner per rank in threads joined by an in-process collective, and checks that
every rank's rows are those of the whole gradient, computed with numpy.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from graddebug.adapter.ranks import WHOLE, Partial, RankCombiner, Share
from graddebug.records import ALL_RANKS, Record, sums_record


class Threads:
    """An in-process collective over ``world`` threads: every call waits for all of them."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world)
        self._slots: list[Any] = [None] * world
        self.calls = 0

    def for_rank(self, rank: int) -> Any:
        outer = self

        class Rank:
            def all_gather(self, values: np.ndarray) -> np.ndarray:
                gathered = outer._exchange(rank, np.asarray(values, dtype=float))
                lengths = {len(v) for v in gathered}
                assert len(lengths) == 1, f"ranks gathered vectors of lengths {lengths}"
                return np.stack(gathered)

            def all_gather_object(self, value: Any) -> list[Any]:
                return outer._exchange(rank, value)

        return Rank()

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        if self._barrier.wait() == 0:
            self.calls += 1
        out = list(self._slots)
        self._barrier.wait()
        return out


def run_ranks(world: int, steps: Callable[[int, int], list[tuple[Record, Share]] | None],
              n_steps: int = 1) -> tuple[list[list[list[Record]]], Threads]:
    """Run ``n_steps`` combines on ``world`` threads; ``steps(rank, step)`` gives a rank's
    rows (None: its close failed). Returns each rank's rows per step."""
    group = Threads(world)
    out: list[list[list[Record]]] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        combiner = RankCombiner(group.for_rank(rank))
        for step in range(n_steps):
            rows = steps(rank, step)
            try:
                out[rank].append(combiner.combine(
                    step, [r for r, _ in rows or []],
                    None if rows is None else [s for _, s in rows]))
            except Exception as exc:  # recorded for the test to see
                errors.append(exc)
                out[rank].append([])

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank waits forever"
    if errors:
        raise errors[0]
    return out, group


def measured(g: np.ndarray, layer: str = "fc", tensor: str = "output",
             kind: str = "activation", depth: int = 0, unit_axis: int | None = -1) -> Record:
    """A row of ``g`` measured as an adapter does (zero_frac over the unit axis)."""
    zero = math.nan
    if unit_axis is not None and g.ndim > 1:
        per_unit = np.abs(np.moveaxis(g, unit_axis, 0)).reshape(g.shape[unit_axis], -1).max(1)
        zero = float((per_unit == 0).mean())
    return sums_record(0, layer, tensor, kind, depth, str(g.shape), g.size,
                       float(np.sqrt((g.astype(float) ** 2).sum())), float(g.sum()),
                       float(np.abs(g).max()) if g.size else math.nan, zero,
                       bool(np.isnan(g).any()), bool(np.isinf(g).any()))


def check_row(row: Record, truth: np.ndarray) -> None:
    assert row.numel == truth.size
    assert row.shape == str(truth.shape)
    assert row.norm == pytest.approx(float(np.linalg.norm(truth)), rel=1e-12)
    assert row.mean == pytest.approx(float(truth.mean()), rel=1e-9, abs=1e-15)
    assert row.std == pytest.approx(float(truth.std()), rel=1e-6)
    assert row.absmax == pytest.approx(float(np.abs(truth).max()), rel=1e-12)


RNG = np.random.default_rng(0)


def test_a_batch_split_under_averaging_data_parallelism_is_the_global_batch() -> None:
    # Each rank's loss is a mean over its slice; the optimizer averages: the global loss's
    # gradient at each slice is the local one over the number of ranks.
    world = 3
    local = [RNG.normal(size=(4, 5)) for _ in range(world)]
    truth = np.concatenate(local) / world
    share = Share(scale=1 / world, split_dim=0)
    rows, _ = run_ranks(world, lambda rank, step: [(measured(local[rank]), share)])
    for rank_rows in rows:
        (row,) = rank_rows[0]
        check_row(row, truth)
        assert row.rank == ALL_RANKS


def test_a_feature_split_adds_pieces_and_dead_units() -> None:
    full = RNG.normal(size=(6, 8))
    full[:, [1, 6, 7]] = 0.0  # three dead units: one in the first piece, two in the second
    pieces = np.split(full, 2, axis=1)
    share = Share(units_split=True, shape=str(full.shape))
    rows, _ = run_ranks(2, lambda rank, step: [(measured(pieces[rank]), share)])
    for rank_rows in rows:
        (row,) = rank_rows[0]
        check_row(row, full)
        assert row.zero_frac == pytest.approx(3 / 8)


def test_replicated_copies_count_once_and_whole_rows_take_one_holder() -> None:
    g = RNG.normal(size=(3, 4))
    w = RNG.normal(size=(4,))

    def rows_of(rank: int, step: int) -> list[tuple[Record, Share]]:
        return [(measured(g), Share(counted=rank == 0)),
                (measured(w, "fc", "bias", "parameter", unit_axis=None), WHOLE)]

    rows, _ = run_ranks(4, rows_of)
    for rank_rows in rows:
        out, param = rank_rows[0]
        check_row(out, g)
        check_row(param, w)


def test_pipeline_stages_get_the_union_in_the_models_order() -> None:
    stage = [[RNG.normal(size=(2, 3)), RNG.normal(size=(2, 3))],
             [RNG.normal(size=(2, 3)), RNG.normal(size=(2, 1))]]
    names = [["l0", "l1"], ["l2", "l3"]]

    def rows_of(rank: int, step: int) -> list[tuple[Record, Share]]:
        return [(measured(g, names[rank][i], depth=i), WHOLE) for i, g in enumerate(stage[rank])]

    rows, _ = run_ranks(2, rows_of)
    assert rows[0] == rows[1]
    got = {r.layer: r for r in rows[0][0]}
    assert [got[n].depth for n in ("l0", "l1", "l2", "l3")] == [0, 1, 2, 3]
    for rank in range(2):
        for i, g in enumerate(stage[rank]):
            check_row(got[names[rank][i]], g)


def test_one_collective_per_step_once_the_layout_is_known() -> None:
    local = [RNG.normal(size=(4, 5)) for _ in range(2)]
    share = Share(scale=0.5, split_dim=0)
    rows, group = run_ranks(2, lambda rank, step: [(measured(local[rank]), share)], n_steps=5)
    # The first step exchanges the keys, then gathers: 2; every later step gathers once.
    assert group.calls == 2 + 4
    assert all(len(step_rows) == 1 for step_rows in rows[0])


def test_a_new_key_on_one_rank_is_exchanged_and_kept() -> None:
    g = RNG.normal(size=(2, 2))

    def rows_of(rank: int, step: int) -> list[tuple[Record, Share]]:
        rows = [(measured(g, "a"), Share(counted=rank == 0))]
        if step == 1 and rank == 1:  # a layer only rank 1 runs, from step 1 on
            rows.append((measured(2 * g, "b"), WHOLE))
        return rows

    rows, group = run_ranks(2, rows_of, n_steps=2)
    assert [r.layer for r in rows[0][1]] == ["a", "b"]
    assert rows[0][1] == rows[1][1]
    check_row(rows[0][1][1], 2 * g)
    assert group.calls == 2 + 3  # step 1: a gather, the exchange, the gather again


def test_a_nan_row_names_the_rank_where_it_was_born() -> None:
    local = [RNG.normal(size=(2, 3)) for _ in range(3)]
    local[2][0, 0] = math.nan
    share = Share(scale=1 / 3, split_dim=0)
    rows, _ = run_ranks(3, lambda rank, step: [(measured(local[rank]), share)])
    row = rows[0][0][0]
    assert row.nan and math.isnan(row.norm)
    assert row.rank == 2


def test_a_rank_that_fails_drops_the_step_on_every_rank_without_a_hang() -> None:
    g = RNG.normal(size=(2, 3))

    def rows_of(rank: int, step: int) -> list[tuple[Record, Share]] | None:
        if rank == 1 and step == 1:
            return None  # this rank's close failed
        return [(measured(g), Share(counted=rank == 0))]

    rows, _ = run_ranks(2, rows_of, n_steps=3)
    for rank_rows in rows:
        assert [len(step) for step in rank_rows] == [1, 0, 1]


def test_batch_split_dead_units_are_bounded_by_the_fewest_dead() -> None:
    a, b = RNG.normal(size=(2, 4)), RNG.normal(size=(2, 4))
    a[:, [0, 1]] = 0.0
    b[:, [1]] = 0.0  # unit 1 is dead in both slices, unit 0 only in the first
    share = Share(scale=0.5, split_dim=0)
    rows, _ = run_ranks(2, lambda rank, step: [(measured([a, b][rank]), share)])
    assert rows[0][0][0].zero_frac == pytest.approx(1 / 4)



def test_partial_addends_travel_in_the_one_collective_and_sum_to_the_piece() -> None:
    # A gradient held as a sum over the ranks (a Partial placement): ranks 0 and 1 hold
    # addends of one piece, ranks 2 and 3 of the other half of the tensor.
    halves = [RNG.normal(size=6), RNG.normal(size=6)]
    addends = {}
    for piece, half in enumerate(halves):
        first = RNG.normal(size=6)
        addends[2 * piece], addends[2 * piece + 1] = first, half - first
    truth = np.concatenate(halves)

    def rows_of(rank: int, step: int) -> list[tuple[Record, Share]]:
        junk = measured(np.zeros((6,)), "ln", "weight", "parameter", unit_axis=None)
        return [(junk, Share(shape=str(truth.shape),
                             partial=Partial(2 * (rank // 2), addends[rank])))]

    rows, group = run_ranks(4, rows_of, n_steps=2)
    for rank_rows in rows:
        for step_rows in rank_rows:
            (row,) = step_rows
            check_row(row, truth)
    assert group.calls == 2 + 1  # the addends ride on the step's one gather


def test_partial_sums_are_rounded_as_the_reduction_rounds_them() -> None:
    addends = [np.array([1.0, 2.0]), np.array([1e-9, 0.5])]

    def rows_of(rank: int, step: int) -> list[tuple[Record, Share]]:
        junk = measured(np.zeros((2,)), "ln", "bias", "parameter", unit_axis=None)
        return [(junk, Share(partial=Partial(0, addends[rank], np.round)))]

    rows, _ = run_ranks(2, rows_of)
    assert rows[0][0][0].absmax == 2.0  # round(2.5) to even: the sum as the dtype holds it
    assert rows[0][0][0].norm == pytest.approx(math.sqrt(1.0 + 4.0))


def test_a_stages_events_reach_every_rank_with_one_exchange() -> None:
    from graddebug.records import Event

    g = RNG.normal(size=(2, 2))

    def rows_of(rank: int, step: int) -> list[tuple[Record, Share]]:
        return [(measured(g, f"stage{rank}", depth=0), WHOLE)]

    group = Threads(2)
    seen: list[list[list[Event]]] = [[], []]

    def work(rank: int) -> None:
        combiner = RankCombiner(group.for_rank(rank), rank)
        for step in range(4):
            cut = [Event(step, "stage1", "output", 0, "detached_output")] if rank == 1 else []
            rows = rows_of(rank, step)
            combiner.combine(step, [r for r, _ in rows], [s for _, s in rows], cut)
            seen[rank].append(combiner.peer_events)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # Rank 0 sees rank 1's cut at every step, at that step, with rank 1's depth in the
    # model's order (after rank 0's layer); rank 1 sees nothing new.
    assert [[(e.step, e.layer, e.rank, e.depth) for e in step] for step in seen[0]] == [
        [(s, "stage1", 1, 1)] for s in range(4)]
    assert all(step == [] for step in seen[1])
    # The keys and the events are exchanged once, on the first step: 3 + 3 single gathers.
    assert group.calls == 3 + 3


def test_loaded_global_rows_pass_through_combine_ranks_unchanged() -> None:
    from graddebug.frames import combine_ranks, record_frame

    g, w = RNG.normal(size=(4, 3)), RNG.normal(size=(3,))
    g[0, 0] = math.nan
    rows = [measured(g, "fc")._replace(rank=1), measured(w, "fc", "bias", "parameter")
            ._replace(rank=ALL_RANKS), measured(2 * w, "out")._replace(rank=ALL_RANKS)]
    frame = record_frame(rows)
    combined = combine_ranks(frame).set_index(["layer", "tensor"])
    assert len(combined) == 3
    for row in rows:
        got = combined.loc[(row.layer, row.tensor)]
        assert got["rank"] == row.rank and got["numel"] == row.numel
        for column in ("norm", "mean", "absmax"):
            assert got[column] == pytest.approx(getattr(row, column), rel=1e-12, nan_ok=True)
