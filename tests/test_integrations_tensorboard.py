"""TensorBoard output, read back with TensorBoard's own event reader."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import graddebug
import runs
from graddebug.cli import main
from graddebug.errors import ConfigError, MissingFrameworkError
from graddebug.integrations.tensorboard import write_report

pytest.importorskip("tensorboardX")
accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _read(log_dir: Path) -> accumulator.EventAccumulator:
    events = accumulator.EventAccumulator(
        str(log_dir), size_guidance={accumulator.SCALARS: 0, accumulator.HISTOGRAMS: 0})
    events.Reload()
    return events


def test_a_report_becomes_scalars_and_histograms(tmp_path: Path) -> None:
    report = runs.healthy()
    write_report(report, tmp_path / "tb")
    events = _read(tmp_path / "tb")
    frame = report.frame()
    tags = events.Tags()
    assert sorted(tags["scalars"]) == sorted(
        f"graddebug/{layer}.{tensor}/norm" for layer, tensor in
        frame[["layer", "tensor"]].drop_duplicates().itertuples(index=False))
    head = events.Scalars("graddebug/head.weight/norm")
    expected = frame[(frame["layer"] == "head") & (frame["tensor"] == "weight")]
    assert [e.step for e in head] == list(expected["step"])
    np.testing.assert_allclose([e.value for e in head], expected["norm"], rtol=1e-6)
    assert sorted(tags["histograms"]) == ["graddebug/log10_norm/activation",
                                          "graddebug/log10_norm/parameter"]
    hist = events.Histograms("graddebug/log10_norm/activation")
    assert [h.step for h in hist] == list(range(12))
    at3 = frame[(frame["step"] == 3) & (frame["kind"] == "activation")]["norm"]
    value = hist[3].histogram_value
    assert value.num == len(runs.LAYERS)
    assert value.min == pytest.approx(math.log10(at3.min()))
    assert value.max == pytest.approx(math.log10(at3.max()))


def test_the_histogram_leaves_out_nonfinite_norms(tmp_path: Path) -> None:
    report = runs.broken()
    write_report(report, tmp_path / "tb")
    events = _read(tmp_path / "tb")
    hist = {h.step: h.histogram_value.num
            for h in events.Histograms("graddebug/log10_norm/activation")}
    assert hist[4] == len(runs.LAYERS) and hist[5] == len(runs.LAYERS) - 1
    nan = events.Scalars("graddebug/block.1.output/norm")
    assert math.isnan(nan[5].value) and math.isfinite(nan[4].value)


def test_report_command_writes_events(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    runs.healthy().save(tmp_path / "run")
    code = main(["report", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb"),
                 "--format", "csv"])
    assert code == 0
    events = _read(tmp_path / "tb")
    assert len(events.Scalars("graddebug/embed.output/norm")) == 12


def test_watch_streams_while_training(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    with graddebug.watch(model, tensorboard=tmp_path / "tb") as dbg:
        for _ in range(3):
            x = torch.randn(5, 4)
            loss = model(x).square().mean()
            (dw,) = torch.autograd.grad(loss, [model[0].weight], retain_graph=True)
            expected.append(float(dw.norm()))
            loss.backward()
            dbg.step()
            opt.step()
            opt.zero_grad()
    events = _read(tmp_path / "tb")
    first = events.Scalars("graddebug/0.weight/norm")
    assert [e.step for e in first] == [0, 1, 2]
    np.testing.assert_allclose([e.value for e in first], expected, rtol=1e-6)
    assert [h.step for h in events.Histograms("graddebug/log10_norm/parameter")] == [0, 1, 2]


def test_tensorboard_option_is_checked_early(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="tensorboard=3"):
        graddebug.watch(tensorboard=3)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(MissingFrameworkError, match=r"pip install graddebug\[tensorboard\]"):
        graddebug.watch(tensorboard="tb")
    with pytest.raises(MissingFrameworkError, match=r"graddebug\[tensorboard\]"):
        write_report(runs.healthy(), "tb")


def test_a_multi_rank_run_is_written_as_its_global_view(tmp_path: Path) -> None:
    from graddebug.frames import combine_ranks
    from test_ranks import two_ranks, write_rank

    rows, _ = two_ranks(steps=3)
    write_rank(tmp_path / "run", 0, rows)
    write_rank(tmp_path / "run", 1, rows)
    report = graddebug.load(tmp_path / "run")
    write_report(report, tmp_path / "tb")
    events = _read(tmp_path / "tb")
    combined = combine_ranks(report.frame())
    hidden = combined[(combined["layer"] == "hidden") & (combined["tensor"] == "output")]
    got = events.Scalars("graddebug/hidden.output/norm")
    assert [e.step for e in got] == [0, 1, 2]  # one value a step, not one per rank
    np.testing.assert_allclose([e.value for e in got], hidden["norm"], rtol=1e-6)
    assert not any("rank" in tag for tag in events.Tags()["scalars"])


def test_each_rank_streams_to_a_run_of_its_own(tmp_path: Path) -> None:
    from graddebug.adapter import Distribution, StepResult
    from graddebug.integrations import tensorboard

    class Rank1:
        tensorboard = tmp_path / "tb"
        distribution = Distribution(rank=1, world_size=2, backend="gloo")

    watcher, records = Rank1(), runs.records(steps=1)
    tensorboard.graddebug_step_recorded(watcher, 0, StepResult(records=records))
    tensorboard.graddebug_run_finished(watcher)
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["rank1"]  # rank 0's stays free
    events = _read(tmp_path / "tb" / "rank1")
    assert len(events.Tags()["scalars"]) == len(records)


def test_the_loss_update_ratios_and_findings_are_written_at_their_steps(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    # wide enough that 1% of the parameters' entries samples every weight
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, 4, (64,))
    losses = []
    with graddebug.watch(model, tensorboard=tmp_path / "tb") as dbg:
        for step in range(30):
            if step == 25:  # a weight edited outside the optimizer
                with torch.no_grad():
                    model[2].weight.mul_(1e4)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            dbg.step(loss=loss)
            losses.append(loss.item())
    events = _read(tmp_path / "tb")
    assert [e.value for e in events.Scalars("graddebug/loss")] == pytest.approx(losses)
    frame = dbg.frame()
    row = frame[(frame["layer"] == "2") & (frame["tensor"] == "weight") & (frame["step"] == 3)]
    ratio = events.Scalars("graddebug/2.weight/update_ratio")
    assert ratio[3].value == pytest.approx(
        (row["update_norm"] / row["weight_norm"]).item(), rel=1e-6)
    texts = events.Tensors("graddebug/findings/text_summary")
    assert [t.step for t in texts] == [25]
    assert b"2.weight" in texts[0].tensor_proto.string_val[0]
