"""The method of ``benchmarks/overhead_tf.py``: pairs of single steps in every loop but
``fit``, one ``fit`` call a side and round, and what a result holds (its statistics and the
alternation of the pairs are tested in ``test_benchmark_ratios.py``)."""

from __future__ import annotations

import statistics

import pytest

from benchmark_scripts import loaded

pytest.importorskip("tensorflow")

@pytest.fixture(scope="module")
def bench():
    with loaded("overhead_tf") as module:
        yield module


@pytest.mark.parametrize("loop", ["function", "eager", "fit"])
def test_a_result_holds_every_round_and_its_ratio(bench, loop):
    config = next(c for c in bench.CONFIGS if c.key == "a")
    res = bench.bench("mlp", loop, config, rounds=2, steps=2, fit_steps=3)
    assert len(res.plain_steps_ms) == len(res.watched_steps_ms) == 2
    # Two pairs a round, or the two batches after the first of a three-batch fit call.
    assert all(len(r) == 2 for r in res.plain_steps_ms + res.watched_steps_ms)
    assert all(t > 0 for r in res.plain_steps_ms + res.watched_steps_ms for t in r)
    if loop != "fit":
        pairs = [w / p for ws, ps in zip(res.watched_steps_ms, res.plain_steps_ms, strict=True)
                 for w, p in zip(ws, ps, strict=True)]
        assert res.ratio == pytest.approx(statistics.median(pairs))
        # The first step's own (before timing), the warm-up round's two, the timed rounds' four.
        assert res.recorded_steps == 1 + 2 + 4
    else:
        rounds = [statistics.median(w) / statistics.median(p)
                  for w, p in zip(res.watched_steps_ms, res.plain_steps_ms, strict=True)]
        assert res.ratio == pytest.approx(statistics.median(rounds))
        # Two warm-up batches, then three batches a fit call: the warm-up round's and two more.
        assert res.recorded_steps == 2 + 3 + 2 * 3
    assert res.ratio_low <= res.ratio <= res.ratio_high
    assert res.verdict in ("pass", "FAIL", "within noise")
