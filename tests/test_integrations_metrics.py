"""The metrics the callbacks log at their host's cadence, and the host's clip, on hand-made
rows (no framework)."""

from __future__ import annotations

import math

import pytest

from graddebug.errors import ConfigError
from graddebug.integrations.clipping import HostClip, clipped
from graddebug.integrations.metrics import IntervalMetrics
from graddebug.records import Record


def row(layer: str, tensor: str, norm: float, kind: str = "parameter", weight: float = math.nan,
        update: float = math.nan) -> Record:
    return Record(0, layer, tensor, kind, 0, "(2,)", 2, norm, math.nan, math.nan, math.nan,
                  math.nan, False, False, weight_norm=weight, update_norm=update)


def test_latest_and_largest_since_the_last_log_per_layer() -> None:
    metrics = IntervalMetrics()
    metrics.add([row("fc", "weight", 3.0, weight=10.0, update=0.01), row("fc", "bias", 4.0),
                 row("fc", "output", 100.0, kind="activation")], findings=1)
    metrics.add([row("fc", "weight", 0.6), row("fc", "bias", 0.8)])
    out = metrics.take()
    assert out["graddebug/grad_norm/fc"] == pytest.approx(1.0)  # hypot(0.6, 0.8)
    assert out["graddebug/grad_norm/fc/max"] == pytest.approx(5.0)  # hypot(3, 4): the spike
    assert out["graddebug/grad_norm"] == pytest.approx(1.0)
    assert out["graddebug/update_ratio/fc"] == pytest.approx(0.001)  # 0.01 / 10, step one
    assert out["graddebug/findings"] == 1
    assert not any("output" in key for key in out)  # one norm a layer by default
    assert metrics.take() == {}  # a new interval, with nothing in it yet


def test_every_tensor_adds_each_norm_and_nan_wins_the_maximum() -> None:
    metrics = IntervalMetrics(every_tensor=True)
    metrics.add([row("fc", "weight", math.nan)])
    metrics.add([row("fc", "weight", 2.0), row("fc", "output", 7.0, kind="activation")])
    out = metrics.take()
    assert out["graddebug/norm/fc.output"] == 7.0
    assert out["graddebug/norm/fc.weight"] == 2.0
    assert math.isnan(out["graddebug/norm/fc.weight/max"])


def test_a_clip_by_total_norm_scales_every_row_as_torch_does() -> None:
    rows = [row("a", "weight", 3.0), row("b", "weight", 4.0), row("a", "output", 9.0, "activation")]
    out = clipped(rows, HostClip(1.0, "total", 1e-6))
    assert out[0].clipped_norm == pytest.approx(3.0 / (5.0 + 1e-6))
    assert out[1].clipped_norm == pytest.approx(4.0 / (5.0 + 1e-6))
    assert math.isnan(out[2].clipped_norm) and out[2] == rows[2]
    assert [r.norm for r in out] == [3.0, 4.0, 9.0]  # the norms before the clip stay
    # Under the limit, the clip changes nothing.
    assert clipped(rows, HostClip(10.0))[0].clipped_norm == 3.0


def test_a_clip_of_each_gradient_caps_each_norm() -> None:
    out = clipped([row("a", "weight", 3.0), row("b", "weight", 0.5)], HostClip(1.0, "each"))
    assert [r.clipped_norm for r in out] == [1.0, 0.5]


def test_bad_clips_raise() -> None:
    with pytest.raises(ConfigError, match="positive finite"):
        HostClip(0.0)
    with pytest.raises(ConfigError, match="'total' or 'each'"):
        HostClip(1.0, "value")  # type: ignore[arg-type]
