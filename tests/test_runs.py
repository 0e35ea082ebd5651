"""The run format on disk: exact round trips, streaming, crashes and damaged files."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import graddebug
import runs
from graddebug import Report, Thresholds
from graddebug.diagnosis import diagnose
from graddebug.errors import (
    ConfigError,
    CorruptRunError,
    MissingFrameworkError,
    NotARunError,
    RunFileError,
)
from graddebug.frames import event_frame, record_frame
from graddebug.records import Event
from graddebug.runs.layout import META_FILE
from graddebug.runs.writer import RunWriter

TESTS = Path(__file__).resolve().parent


def assert_same_run(a: Report | graddebug.Watcher, b: Report) -> None:
    for name in ("frame", "events", "findings", "summary"):
        pd.testing.assert_frame_equal(getattr(a, name)(), getattr(b, name)(), check_dtype=True,
                                      obj=name)


# -- exact round trips, no framework ----------------------------------------------------------


WEIRD = ("<b>embed</b>", "block|0", "blöck.1 \"quoted\"", "head\nline")


@pytest.mark.parametrize("case", ["healthy", "broken", "pre_norm", "shape_tuples", "weird"])
def test_saved_run_loads_back_identical(tmp_path: Path, case: str) -> None:
    rows = {
        "healthy": lambda: runs.records(),
        "broken": lambda: runs.records(nan_at=(5, "block.1")),
        "pre_norm": lambda: runs.records(clip="block.0"),
        "shape_tuples": lambda: runs.records(shape_tuples=True),
        "weird": lambda: runs.records(layers=WEIRD),
    }[case]()
    events = [Event(3, rows[0].layer, "weight", 0, "no_grad", "got no gradient")]
    report = runs.report(rows, events, metadata={"model": "M", "note": case, "n": [1, 2]})
    report.save(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run")
    assert_same_run(report, loaded)
    assert loaded.thresholds == report.thresholds
    assert {k: v for k, v in loaded.metadata.items() if k != "run"} == report.metadata
    assert loaded.metadata["run"]["status"] == "complete"
    assert loaded.metadata["run"]["rediagnosed"] is False
    assert ("pre_norm" in loaded.frame()) == (case == "pre_norm")
    assert isinstance(loaded.frame()["shape"].iloc[0], tuple if case == "shape_tuples" else str)


def test_empty_run_round_trips_with_its_dtypes(tmp_path: Path) -> None:
    report = runs.report([])
    report.save(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run")
    assert_same_run(report, loaded)
    assert list(loaded.frame().columns)[:3] == ["step", "layer", "tensor"]


def test_thresholds_and_findings_are_those_of_the_saved_run(tmp_path: Path) -> None:
    rows = runs.records()
    frame, events = record_frame(rows), event_frame([])
    # The healthy rows reach 0.18 per entry (norm 1.4 over 64 entries): "exploding" at 0.15.
    strict = Thresholds(exploding_norm=0.15)
    findings = diagnose(frame, events, strict)
    assert set(findings["issue"]) == {"exploding"}
    Report(frame, events, findings, thresholds=strict).save(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run")
    assert loaded.thresholds == strict
    pd.testing.assert_frame_equal(loaded.findings(), findings)
    assert loaded.rediagnose(exploding_norm=1e4).empty


def test_saving_replaces_a_run_but_never_other_files(tmp_path: Path) -> None:
    runs.broken().save(tmp_path / "run")
    runs.healthy().save(tmp_path / "run")
    assert graddebug.load(tmp_path / "run").findings().empty
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(RunFileError, match="non-empty directory"):
        runs.healthy().save(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run"]  # no temporaries


def test_files_carry_no_pandas_metadata(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    runs.broken().save(tmp_path / "run")
    files = sorted((tmp_path / "run").rglob("*.parquet"))
    assert len(files) == 3
    for file in files:
        metadata = pq.read_schema(file).metadata or {}
        assert b"pandas" not in metadata  # the loader rebuilds types from the JSON spec


def test_missing_pyarrow_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MissingFrameworkError, match=r"pip install graddebug\[report\]"):
        runs.healthy().save(tmp_path / "run")


# -- not a run, damaged runs ------------------------------------------------------------------


def test_paths_that_hold_no_run_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.parquet").write_bytes(b"PAR1")
    for path, words in [(tmp_path / "missing", "does not exist"),
                        (tmp_path / "file.parquet", "is a file"),
                        (tmp_path / "empty", "holds no 'graddebug.json'")]:
        with pytest.raises(NotARunError, match=words) as info:
            graddebug.load(path)
        assert str(path) in str(info.value)
    (tmp_path / "empty" / META_FILE).write_text('{"format": "something-else"}')
    with pytest.raises(RunFileError, match="not a graddebug run file"):
        graddebug.load(tmp_path / "empty")


def test_a_run_from_a_newer_graddebug_asks_for_an_upgrade(tmp_path: Path) -> None:
    runs.healthy().save(tmp_path / "run")
    meta_file = tmp_path / "run" / META_FILE
    meta = json.loads(meta_file.read_text())
    meta["format_version"] = 99
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(RunFileError, match=r"version 99.*Upgrade graddebug"):
        graddebug.load(tmp_path / "run")


def write_parts(path: Path, chunks: list[list], *, finish: bool = False) -> RunWriter:
    """Stream record chunks as a Watcher would, one part per chunk."""
    writer = RunWriter(path, flush_every=1)
    writer.start({"model": "Handmade"}, Thresholds().as_dict())
    for chunk in chunks:
        writer.flush(chunk, [], [])
    return writer


def chunks_of(rows: list, steps_per_chunk: int) -> list[list]:
    out: dict[int, list] = {}
    for r in rows:
        out.setdefault(r.step // steps_per_chunk, []).append(r)
    return [out[k] for k in sorted(out)]


def test_an_unfinished_run_is_read_and_diagnosed_again(tmp_path: Path) -> None:
    rows = runs.records(nan_at=(5, "block.1"))
    write_parts(tmp_path / "run", chunks_of(rows, 4))  # no finish(): the process "died"
    loaded = graddebug.load(tmp_path / "run")
    assert loaded.metadata["run"]["status"] == "incomplete"
    assert loaded.metadata["run"]["last_step"] == 11
    expected = runs.report(rows)
    assert_same_run(expected, loaded)
    assert "nonfinite" in set(loaded.findings()["issue"])


def test_a_truncated_part_is_named_with_what_remains_readable(tmp_path: Path) -> None:
    rows = runs.records(steps=12)
    write_parts(tmp_path / "run", chunks_of(rows, 4))  # steps 0-3, 4-7, 8-11
    damaged = tmp_path / "run" / "records" / "part-000001.parquet"
    damaged.write_bytes(damaged.read_bytes()[:100])
    with pytest.raises(CorruptRunError) as info:
        graddebug.load(tmp_path / "run")
    message = str(info.value)
    assert str(damaged) in message
    assert "record steps 0-3, 8-11" in message
    assert "skip_damaged=True" in message
    assert info.value.path == str(damaged)
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    assert sorted(loaded.frame()["step"].unique()) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert loaded.metadata["run"]["damaged"] == [str(damaged)]


def test_a_corrupt_findings_file_of_a_finished_run_is_named(tmp_path: Path) -> None:
    runs.broken().save(tmp_path / "run")
    findings = tmp_path / "run" / "findings.parquet"
    findings.write_bytes(b"not parquet at all")
    with pytest.raises(CorruptRunError, match=r"findings\.parquet"):
        graddebug.load(tmp_path / "run")
    # The records are intact: skipping the damaged file diagnoses them again.
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    pd.testing.assert_frame_equal(loaded.findings(), runs.broken().findings())
    assert loaded.metadata["run"]["status"] == "complete"
    assert loaded.metadata["run"]["rediagnosed"] is True


def test_corrupt_metadata_is_named_and_the_data_still_recoverable(tmp_path: Path) -> None:
    runs.broken().save(tmp_path / "run")
    (tmp_path / "run" / META_FILE).write_text('{"format": "graddebug-run", "status": ')
    with pytest.raises(CorruptRunError, match=r"graddebug\.json.*truncated or corrupt"):
        graddebug.load(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    assert loaded.thresholds == Thresholds()
    pd.testing.assert_frame_equal(loaded.frame(), runs.broken().frame())


def test_parts_or_specs_that_do_not_fit_are_corrupt(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    write_parts(tmp_path / "run", chunks_of(runs.records(steps=4), 2))
    stray = tmp_path / "run" / "records" / "part-000002.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), stray)  # valid Parquet, but not records
    with pytest.raises(CorruptRunError, match=r"part-000002\.parquet.*no 'step' column"):
        graddebug.load(tmp_path / "run")
    stray.unlink()
    runs.healthy().save(tmp_path / "saved")
    meta_file = tmp_path / "saved" / META_FILE
    meta = json.loads(meta_file.read_text())
    spec = meta["columns"]["records"]
    meta["columns"]["records"] = [["step", "int64", "extra"]]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CorruptRunError, match=r"column specs .* are malformed"):
        graddebug.load(tmp_path / "saved")
    meta["columns"]["records"] = [*spec, ["no_such_column", "int64"]]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CorruptRunError, match="no_such_column"):
        graddebug.load(tmp_path / "saved")


# -- watch(log_dir=...) options ----------------------------------------------------------------


def test_log_dir_must_be_new_or_empty(tmp_path: Path) -> None:
    runs.healthy().save(tmp_path / "old")
    with pytest.raises(ConfigError, match="is a graddebug run; graddebug will not overwrite"):
        graddebug.watch(log_dir=tmp_path / "old")
    (tmp_path / "empty").mkdir()
    graddebug.watch(log_dir=tmp_path / "empty")  # an empty directory is fine
    with pytest.raises(ConfigError, match="flush_every=0"):
        graddebug.watch(log_dir=tmp_path / "new", flush_every=0)


# -- torch runs -------------------------------------------------------------------------------


def torch_run(scenario: str, log_dir: Path | None = None, steps: int = 7):
    torch = pytest.importorskip("torch")
    from torch import nn

    from torch_models import batches, relu_mlp, sigmoid_mlp, train

    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block1 = nn.Sequential(nn.Linear(32, 16), nn.ReLU())
            self.block2 = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            return self.head(self.block2(self.block1(x).detach()))

    torch.manual_seed(0)
    model, options = {
        "sigmoid": (lambda: sigmoid_mlp(depth=6), {}),
        "clipped": (lambda: relu_mlp(depth=4), {"intervene": {"2": {"clip_norm": 1e-3}}}),
        "detached": (Detached, {}),
    }[scenario]
    model = model()
    if log_dir is not None:
        options = {**options, "log_dir": log_dir, "flush_every": 2}
    with graddebug.watch(model, **options) as dbg:
        train(model, batches(steps, (8, 32)), dbg)
    return dbg


@pytest.mark.parametrize("scenario", ["sigmoid", "clipped", "detached"])
def test_torch_run_round_trips_exactly(tmp_path: Path, scenario: str) -> None:
    live = torch_run(scenario)
    assert not live.frame().empty
    assert ("pre_norm" in live.frame()) == (scenario == "clipped")
    assert live.events().empty == (scenario != "detached")
    assert live.findings().empty == (scenario == "clipped")
    live.save(tmp_path / "saved")
    assert_same_run(live, graddebug.load(tmp_path / "saved"))
    # Streaming the same run: the Watcher reads its frame back from disk, identical.
    streamed = torch_run(scenario, log_dir=tmp_path / "streamed")
    assert_same_run(live, streamed.report())
    loaded = graddebug.load(tmp_path / "streamed")
    assert_same_run(live, loaded)
    meta = loaded.metadata
    assert meta["framework"] == "torch"
    assert meta["framework_version"] == sys.modules["torch"].__version__
    assert meta["options"]["flush_every"] == 2
    assert meta["model"].endswith(("Sequential", "Detached"))
    assert meta["run"]["status"] == "complete"
    assert {"started", "finished", "host"} <= set(meta)


def test_with_log_dir_only_unflushed_rows_stay_in_memory(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch_models import batches, relu_mlp

    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=8, inputs=4)
    x, y = batches(1, (4, 4))[0]
    rows_per_step = 5 + 6  # outputs of 3 Linear and 2 ReLU; 3 weights and 3 biases
    with graddebug.watch(model, log_dir=tmp_path / "run", flush_every=5) as dbg:
        for step in range(23):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            dbg.step()
            model.zero_grad()
            assert dbg._buffer.rows == ((step + 1) % 5) * rows_per_step
        assert sorted(dbg.frame()["step"].unique()) == list(range(23))
    assert len(list((tmp_path / "run" / "records").glob("part-*.parquet"))) == 5
    assert len(dbg.frame()) == 23 * rows_per_step


def test_a_failing_disk_does_not_stop_training(tmp_path: Path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from torch_models import batches, relu_mlp

    def full_disk(self, *args):
        raise OSError(28, "No space left on device")

    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=8, inputs=4)
    x, y = batches(1, (4, 4))[0]
    with pytest.warns(graddebug.GradDebugWarning, match="No space left"), \
            graddebug.watch(model, log_dir=tmp_path / "run", flush_every=2) as dbg:
        with monkeypatch.context() as patch:
            patch.setattr(RunWriter, "flush", full_disk)
            for _ in range(4):
                torch.nn.functional.cross_entropy(model(x), y).backward()
                dbg.step()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        dbg.step()
    internal = dbg.findings()[dbg.findings()["issue"] == "internal_error"]
    assert len(internal) >= 1
    # the rows held back while the disk was full were written once it was not
    assert sorted(graddebug.load(tmp_path / "run").frame()["step"].unique()) == list(range(5))


def test_an_exception_in_training_still_finishes_the_run(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch_models import batches, sigmoid_mlp

    model = sigmoid_mlp(depth=6)
    with pytest.raises(RuntimeError, match="diverged"), \
            graddebug.watch(model, log_dir=tmp_path / "run", flush_every=100) as dbg:
        for x, y in batches(3, (8, 32)):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            dbg.step()
        raise RuntimeError("diverged")
    loaded = graddebug.load(tmp_path / "run")
    assert loaded.metadata["run"]["status"] == "complete"
    assert sorted(loaded.frame()["step"].unique()) == [0, 1, 2]
    assert "vanishing" in set(loaded.findings()["issue"])


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    import graddebug
    from torch_models import batches, relu_mlp

    log_dir, flush_every, wait_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = relu_mlp(depth=4, width=16, inputs=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batches(1, (4, 8))[0]
    parts = 0
    with graddebug.watch(model, log_dir=log_dir, flush_every=flush_every) as dbg:
        for step in range(10_000):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            dbg.step()
            now = len(list((dbg._buffer.log.path / "records").glob("part-*.parquet")))
            if now != parts:
                parts = now
                print(f"flushed {{parts}} {{step}}", flush=True)
                if parts == wait_after:
                    sys.stdin.readline()  # training "hangs" here until it is killed
""")


@pytest.mark.slow
def test_a_run_killed_mid_training_keeps_every_flushed_step(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS)))
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, str(script), str(run), "3", "4"],
                             stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        lines = []
        while len(lines) < 4:
            line = child.stdout.readline()
            assert line, f"the child ended early: {lines}"
            lines.append(line.split())
        last_step = int(lines[-1][2])
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert last_step == 4 * 3 - 1  # four parts of three steps each
    loaded = graddebug.load(run)
    assert loaded.metadata["run"]["status"] == "incomplete"
    assert sorted(loaded.frame()["step"].unique()) == list(range(last_step + 1))
    assert loaded.metadata["framework"] == "torch"
    assert loaded.findings().empty  # a healthy ReLU net, diagnosed again from its parts
    assert math.isfinite(loaded.frame()["norm"].sum())


# -- TensorFlow runs --------------------------------------------------------------------------


def tf_run(scenario: str, log_dir: Path | None = None, steps: int = 5):
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")

    from tf_models import batches, relu_mlp, sigmoid_mlp, train

    keras.utils.set_random_seed(0)
    options: dict = {"log_dir": log_dir, "flush_every": 2} if log_dir is not None else {}
    if scenario == "fit":
        model = relu_mlp(depth=3, width=16, classes=4)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8 * steps, 32)).astype(np.float32)
        y = rng.standard_normal((8 * steps, 4)).astype(np.float32)
        with graddebug.watch(model, **options) as dbg:
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[dbg.callback()])
        return dbg
    model = {"sigmoid": lambda: sigmoid_mlp(depth=12),
             "clipped": lambda: relu_mlp(depth=4, width=16)}[scenario]()
    if scenario == "clipped":
        options["intervene"] = {"fc2": {"clip_norm": 1e-3}}
    with graddebug.watch(model, **options) as dbg:
        train(model, batches(steps, (8, 32)), dbg, compiled=scenario == "clipped")
    assert tf.executing_eagerly()
    return dbg


@pytest.mark.parametrize("scenario", ["sigmoid", "clipped", "fit"])
def test_tensorflow_run_round_trips_exactly(tmp_path: Path, scenario: str) -> None:
    live = tf_run(scenario)
    assert live.frame()["step"].nunique() == 5
    assert ("pre_norm" in live.frame()) == (scenario == "clipped")
    assert live.findings().empty == (scenario != "sigmoid")
    live.save(tmp_path / "saved")
    assert_same_run(live, graddebug.load(tmp_path / "saved"))
    streamed = tf_run(scenario, log_dir=tmp_path / "streamed")
    assert_same_run(live, streamed.report())
    loaded = graddebug.load(tmp_path / "streamed")
    assert_same_run(live, loaded)
    assert loaded.metadata["framework"] == "tensorflow"
    assert loaded.metadata["framework_version"] == sys.modules["tensorflow"].__version__
