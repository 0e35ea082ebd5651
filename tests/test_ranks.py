"""Multi-rank runs in the core: the rank column, combined rows, per-rank run files, and the
loss-scale overflow diagnosis. Rows are built from numpy arrays, the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import graddebug
from graddebug.config import Thresholds
from graddebug.diagnosis import diagnose
from graddebug.errors import ConfigError
from graddebug.frames import combine_ranks, event_frame, finding_frame, record_frame, with_rank
from graddebug.records import ALL_RANKS, Event, EventKind, Record
from graddebug.runs.writer import RunWriter

LAYERS = ("embed", "hidden", "head")


def row(step: int, layer: str, depth: int, grad: np.ndarray, *, rank: int = 0,
        kind: str = "activation", tensor: str = "output") -> Record:
    """A record measured from ``grad`` with numpy (units on the last axis)."""
    finite = np.isfinite(grad).all()
    dead = float((np.abs(grad).max(axis=0) == 0).mean()) if finite and grad.ndim == 2 else 0.0
    return Record.from_sums(
        step, layer, tensor, kind, depth, str(grad.shape), grad.size,
        norm=float(np.sqrt((grad.astype(np.float64) ** 2).sum())),
        total=float(grad.sum(dtype=np.float64)), absmax=float(np.abs(grad).max()),
        zero_frac=dead, nan=bool(np.isnan(grad).any()), inf=bool(np.isinf(grad).any()),
        rank=rank)


def two_ranks(steps: int = 3, seed: int = 0, nan_at: tuple[int, int, str] | None = None,
              ) -> tuple[list[Record], dict[tuple[int, str], np.ndarray]]:
    """Rows of two ranks, each holding half of a global batch, and the global gradients.

    Parameter gradients are the same on both ranks (as after DDP's all-reduce).

    Args:
        nan_at: ``(step, rank, layer)`` whose output gradient holds a NaN on that rank only.
    """
    rng = np.random.default_rng(seed)
    rows: list[Record] = []
    whole: dict[tuple[int, str], np.ndarray] = {}
    for step in range(steps):
        for depth, layer in enumerate(LAYERS):
            halves = [rng.normal(size=(4, 6)) * (depth + 1) for _ in range(2)]
            if nan_at is not None and nan_at[0] == step and nan_at[2] == layer:
                halves[nan_at[1]][0, 0] = np.nan
            whole[(step, layer)] = np.concatenate(halves)
            rows += [row(step, layer, depth, g, rank=r) for r, g in enumerate(halves)]
            weight = rng.normal(size=(6, 6))
            rows += [row(step, layer, depth, weight, rank=r, kind="parameter", tensor="weight")
                     for r in range(2)]
    return rows, whole


def test_combined_rows_are_the_statistics_of_the_concatenated_gradient() -> None:
    rows, whole = two_ranks()
    combined = combine_ranks(record_frame(rows))
    act = combined[combined["kind"] == "activation"]
    assert len(act) == len(whole)
    for r in act.itertuples():
        g = whole[(r.step, r.layer)]
        assert r.norm == pytest.approx(np.linalg.norm(g), rel=1e-12)
        assert r.mean == pytest.approx(g.mean(), rel=1e-9, abs=1e-12)
        assert r.std == pytest.approx(g.std(), rel=1e-9)
        assert r.absmax == pytest.approx(np.abs(g).max(), rel=1e-12)
        assert r.numel == g.size
        assert r.rank == ALL_RANKS
    params = combined[combined["kind"] == "parameter"]
    assert len(params) == 3 * len(LAYERS)  # one row per step and tensor, not one per rank
    assert (params["rank"] == ALL_RANKS).all()
    assert list(combined.columns) == list(record_frame(rows).columns)
    assert combined.dtypes.equals(record_frame(rows).dtypes)


def test_one_rank_is_returned_unchanged() -> None:
    rows, _ = two_ranks()
    frame = record_frame([r for r in rows if r.rank == 1])
    assert combine_ranks(frame) is frame


def test_a_nan_on_one_rank_is_named_with_that_rank() -> None:
    rows, _ = two_ranks(steps=4, nan_at=(2, 1, "hidden"))
    findings = diagnose(record_frame(rows), event_frame([]), Thresholds())
    nonfinite = findings[findings["issue"] == "nonfinite"]
    assert len(nonfinite) == 1
    assert nonfinite.iloc[0][["step", "layer", "rank"]].tolist() == [2, "hidden", 1]
    assert nonfinite.iloc[0]["message"].endswith("It appeared on rank 1.")


def test_a_forward_nan_event_on_one_rank_names_that_rank() -> None:
    rows, _ = two_ranks(steps=2)
    events = [Event(1, "embed", "output", 0, EventKind.FORWARD_NONFINITE.value, "NaN", rank=1)]
    findings = diagnose(record_frame(rows), event_frame(events), Thresholds())
    assert findings[["issue", "layer", "rank"]].values.tolist() == [["nonfinite", "embed", 1]]


def test_findings_of_one_rank_other_than_0_carry_that_rank() -> None:
    rows, _ = two_ranks(steps=4, nan_at=(1, 1, "head"))
    only = record_frame([r for r in rows if r.rank == 1])
    findings = diagnose(only, event_frame([]), Thresholds())
    assert not findings.empty and set(findings["rank"]) == {1}


def test_tables_show_rank_only_in_multi_rank_runs() -> None:
    one = finding_frame([])
    assert with_rank(one, ["step", "layer", "rank", "message"]) == ["step", "layer", "message"]
    rows, _ = two_ranks(steps=4, nan_at=(2, 1, "hidden"))
    many = diagnose(record_frame(rows), event_frame([]), Thresholds())
    assert with_rank(many, ["step", "layer", "message"]) == ["step", "rank", "layer", "message"]


# -- per-rank run files --------------------------------------------------------------------


def write_rank(path: Path, rank: int, rows: list[Record], *, finish: bool = True,
               parts: int = 2) -> RunWriter:
    writer = RunWriter(path, flush_every=1)
    writer.rank, writer.processes = rank, 2
    writer.create()
    # no "processes": as runs written before replicas of one process were told apart
    meta = {"world_size": 2, "backend": "gloo", "rank": rank}
    writer.start(meta, Thresholds().as_dict())
    mine = [r for r in rows if r.rank == rank]
    steps = sorted({r.step for r in mine})
    for chunk in np.array_split(np.array(steps), parts):
        writer.flush([r for r in mine if r.step in set(chunk.tolist())], [], [])
    if finish:
        frame = record_frame(mine)
        writer.finish(frame, event_frame([]), finding_frame([]), meta, Thresholds().as_dict())
    return writer


def test_every_rank_writes_into_one_run_and_loading_reads_them_all(tmp_path: Path) -> None:
    rows, _ = two_ranks(steps=4, nan_at=(3, 1, "head"))
    run = tmp_path / "run"
    write_rank(run, 1, rows)  # rank 1 may start first: the directory then holds its files
    write_rank(run, 0, rows)
    report = graddebug.load(run)
    frame = report.frame()
    assert len(frame) == len(rows)
    assert sorted(set(frame["rank"])) == [0, 1]
    assert frame["step"].is_monotonic_increasing
    assert report.metadata["run"]["status"] == "complete"
    assert report.metadata["run"]["rediagnosed"]  # diagnosed from every rank's rows
    assert report.metadata["world_size"] == 2 and report.metadata["backend"] == "gloo"
    nonfinite = report.findings()[report.findings()["issue"] == "nonfinite"]
    assert nonfinite[["step", "layer", "rank"]].values.tolist() == [[3, "head", 1]]
    summary = report.summary()
    assert len(summary) == 2 * len(LAYERS)  # one row per tensor, not per rank
    assert not (run / "findings.parquet").exists()
    saved = graddebug.load(report.save(tmp_path / "saved"))  # every rank in one run
    assert saved.metadata["run"]["status"] == "complete"
    assert not saved.metadata["run"]["rediagnosed"]
    pd.testing.assert_frame_equal(saved.frame(), frame)
    pd.testing.assert_frame_equal(saved.findings(), report.findings())


def test_the_cli_reports_a_multi_rank_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          ) -> None:
    from graddebug.cli import main

    rows, _ = two_ranks(steps=4, nan_at=(3, 1, "head"))
    write_rank(tmp_path / "run", 0, rows)
    write_rank(tmp_path / "run", 1, rows)
    assert main(["report", str(tmp_path / "run"), "--table", "findings"]) == 1  # an error
    out = capsys.readouterr().out
    assert "2 ranks (gloo)" in out and "rank 1" in out


def test_replicas_written_by_one_process_make_a_complete_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from graddebug.cli import main

    rows, _ = two_ranks(steps=4, nan_at=(3, 1, "head"))  # tf.distribute: replicas as ranks
    run = tmp_path / "run"
    writer = RunWriter(run, flush_every=1)
    writer.create()  # processes stays 1
    meta = {"world_size": 2, "processes": 1, "backend": "MirroredStrategy", "rank": 0}
    writer.start(meta, Thresholds().as_dict())
    writer.flush(rows, [], [])
    frame = record_frame(rows)
    findings = diagnose(frame, event_frame([]), Thresholds())
    writer.finish(frame, event_frame([]), findings, meta, Thresholds().as_dict())
    report = graddebug.load(run)
    assert report.metadata["run"]["status"] == "complete"  # waits for no rank-1 file
    assert sorted(set(report.frame()["rank"])) == [0, 1]
    nonfinite = report.findings()[report.findings()["issue"] == "nonfinite"]
    assert nonfinite[["step", "layer", "rank"]].values.tolist() == [[3, "head", 1]]
    assert main(["report", str(run), "--table", "findings"]) == 1
    assert "2 replicas (MirroredStrategy)" in capsys.readouterr().out


def test_a_killed_rank_leaves_a_loadable_incomplete_run(tmp_path: Path) -> None:
    rows, _ = two_ranks(steps=4)
    run = tmp_path / "run"
    write_rank(run, 0, rows)
    write_rank(run, 1, rows, finish=False)  # killed: its status stays "running"
    report = graddebug.load(run)
    assert report.metadata["run"]["status"] == "incomplete"
    assert report.metadata["run"]["ranks"] == {"0": "complete", "1": "running"}
    assert len(report.frame()) == len(rows)


def test_a_finished_run_and_an_own_earlier_run_are_refused(tmp_path: Path) -> None:
    rows, _ = two_ranks(steps=2)
    run = tmp_path / "run"
    write_rank(run, 0, rows)
    write_rank(run, 1, rows)
    again = RunWriter(run, flush_every=1)  # which rank it is shows on entering
    again.processes = 2
    with pytest.raises(ConfigError, match="is a graddebug run"):
        again.create()
    crashed = tmp_path / "crashed"
    write_rank(crashed, 1, rows, finish=False)
    again = RunWriter(crashed, flush_every=1)  # rank 0 of a new run may join it ...
    again.rank, again.processes = 1, 2
    with pytest.raises(ConfigError, match="files of rank 1 already"):
        again.create()  # ... but rank 1's files are an earlier run's
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="non-empty directory"):
        RunWriter(tmp_path / "other", flush_every=1)


# -- loss-scale overflow ---------------------------------------------------------------------


def skipped(step: int, scale: float) -> Event:
    return Event(step, "", "", -1, EventKind.SKIPPED_STEP.value, f"scale={scale!r}")


def overflowed_rows(steps: int, bad: set[int]) -> list[Record]:
    """One rank's rows; the steps in ``bad`` hold Inf in every gradient (scaled overflow)."""
    rng = np.random.default_rng(1)
    out = []
    for step in range(steps):
        for depth, layer in enumerate(LAYERS):
            g = rng.normal(size=(4, 6))
            if step in bad:
                g[0, 0] = np.inf
            out += [row(step, layer, depth, g), row(step, layer, depth, g, kind="parameter",
                                                    tensor="weight")]
    return out


def test_a_few_skipped_steps_are_a_warning_not_a_nonfinite_error() -> None:
    events = [skipped(0, 65536.0), skipped(1, 32768.0), skipped(5, 16384.0)]
    findings = diagnose(record_frame(overflowed_rows(8, {0, 1, 5})), event_frame(events),
                        Thresholds())
    assert findings[["issue", "severity", "step"]].values.tolist() == [
        ["overflow", "warning", 0]]
    assert "skipped 3 step(s)" in findings.iloc[0]["message"]
    assert findings.iloc[0]["value"] == 2  # the longest run of consecutive skips


def test_persistent_skips_are_an_error_naming_the_first_non_finite_layer() -> None:
    bad = set(range(2, 8))
    events = [skipped(s, 2.0 ** (16 - s)) for s in sorted(bad)]
    findings = diagnose(record_frame(overflowed_rows(8, bad)), event_frame(events),
                        Thresholds(overflow_steps=6))
    assert findings[["issue", "severity", "step", "layer"]].values.tolist() == [
        ["overflow", "error", 2, "head"]]  # backward order: the layer closest to the loss
    assert "6 consecutive recorded steps" in findings.iloc[0]["message"]


def test_a_skip_below_scale_1_is_an_error() -> None:
    findings = diagnose(record_frame(overflowed_rows(3, {1})), event_frame([skipped(1, 0.5)]),
                        Thresholds())
    assert findings[["issue", "severity", "value", "threshold"]].values.tolist() == [
        ["overflow", "error", 0.5, 1.0]]


def test_a_forward_nan_in_a_skipped_step_is_still_a_fault() -> None:
    events = [skipped(1, 1024.0),
              Event(1, "hidden", "output", 1, EventKind.FORWARD_NONFINITE.value, "NaN")]
    findings = diagnose(record_frame(overflowed_rows(3, {1})), event_frame(events),
                        Thresholds())
    assert set(findings["issue"]) == {"overflow", "nonfinite"}
    assert findings.loc[findings["issue"] == "nonfinite", "layer"].tolist() == ["hidden"]


def test_overflow_steps_must_be_a_positive_int() -> None:
    with pytest.raises(ConfigError, match=r"overflow_steps=2\.5 counts steps"):
        Thresholds(overflow_steps=2.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="finite and positive"):
        Thresholds(overflow_steps=0)

