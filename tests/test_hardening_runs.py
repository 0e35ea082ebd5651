"""Run directories are untrusted input: links out of the run, files in the wrong place, columns
of the wrong type and hostile JSON are refused with CorruptRunError naming the file, and
``skip_damaged=True`` reads what remains."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import graddebug
import runs
from graddebug import Thresholds
from graddebug.errors import CorruptRunError
from graddebug.runs.layout import META_FILE
from graddebug.runs.writer import RunWriter

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def streamed(path: Path, steps: int = 6, per_part: int = 2) -> list:
    """A run as a Watcher streams it, not finished: one records part per ``per_part`` steps."""
    rows = runs.records(steps=steps)
    writer = RunWriter(path, flush_every=1)
    writer.start({"model": "Handmade"}, Thresholds().as_dict())
    for first in range(0, steps, per_part):
        writer.flush([r for r in rows if first <= r.step < first + per_part], [], [])
    return rows


def part(run: Path, n: int, stream: str = "records") -> Path:
    return run / stream / f"part-{n:06d}.parquet"


def rewrite(file: Path, column: str, values: Any) -> None:
    """Replace one column of a Parquet file, keeping its position."""
    table = pq.read_table(file)
    index = table.column_names.index(column)
    pq.write_table(table.set_column(index, column, values), file)


def steps_of(report: graddebug.Report) -> list[int]:
    return sorted(int(s) for s in report.frame()["step"].unique())


# -- links out of the run -----------------------------------------------------------------------


def test_a_part_linked_outside_the_run_is_refused(tmp_path: Path) -> None:
    streamed(tmp_path / "run")
    streamed(tmp_path / "elsewhere", steps=8)
    # A valid records part outside the run: reading it would add steps the run never had.
    outside = part(tmp_path / "elsewhere", 3)
    link = part(tmp_path / "run", 3)
    link.symlink_to(outside)
    with pytest.raises(CorruptRunError, match=r"part-000003\.parquet.*symbolic link") as caught:
        graddebug.load(tmp_path / "run")
    assert str(outside) in str(caught.value)  # says where the link points
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    assert steps_of(loaded) == [0, 1, 2, 3, 4, 5]
    assert loaded.metadata["run"]["damaged"] == [str(link)]


def test_a_part_linked_to_a_system_file_is_refused_without_opening_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    streamed(tmp_path / "run")
    part(tmp_path / "run", 3).symlink_to("/etc/passwd")
    opened: list[str] = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table",
                        lambda source, *a, **k: opened.append(str(source)) or real(source, *a,
                                                                                   **k))
    with pytest.raises(CorruptRunError, match=r"part-000003\.parquet.*symbolic link"):
        graddebug.load(tmp_path / "run")
    assert not any(p.endswith("part-000003.parquet") for p in opened)


def test_a_stream_folder_linked_outside_the_run_is_refused(tmp_path: Path) -> None:
    streamed(tmp_path / "run")
    streamed(tmp_path / "elsewhere")
    shutil.rmtree(tmp_path / "run" / "events")
    (tmp_path / "run" / "events").symlink_to(tmp_path / "elsewhere" / "records")
    with pytest.raises(CorruptRunError, match=r"events'.*symbolic link"):
        graddebug.load(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    assert loaded.events().empty and steps_of(loaded) == [0, 1, 2, 3, 4, 5]


def test_a_linked_json_file_is_refused(tmp_path: Path) -> None:
    runs.healthy().save(tmp_path / "run")
    runs.broken().save(tmp_path / "other")
    meta = tmp_path / "run" / META_FILE
    meta.unlink()
    meta.symlink_to(tmp_path / "other" / META_FILE)
    with pytest.raises(CorruptRunError, match=r"graddebug\.json.*symbolic link"):
        graddebug.load(tmp_path / "run")


def test_a_run_reached_through_a_link_still_loads(tmp_path: Path) -> None:
    runs.healthy().save(tmp_path / "run")
    (tmp_path / "alias").symlink_to(tmp_path / "run")
    pd.testing.assert_frame_equal(graddebug.load(tmp_path / "alias").frame(),
                                  runs.healthy().frame())


# -- files in the wrong place --------------------------------------------------------------------


def test_a_records_file_in_place_of_the_directory_is_corrupt(tmp_path: Path) -> None:
    runs.healthy().save(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "records")
    (tmp_path / "run" / "records").write_bytes(b"not a directory")
    with pytest.raises(CorruptRunError, match=r"run/records'.*a file where the run has a "
                                              r"directory") as caught:
        graddebug.load(tmp_path / "run")
    assert caught.value.path == str(tmp_path / "run" / "records")
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    assert loaded.frame().empty
    assert loaded.metadata["run"]["damaged"] == [str(tmp_path / "run" / "records")]


def test_a_complete_run_without_its_records_directory_is_corrupt(tmp_path: Path) -> None:
    runs.healthy().save(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "records")
    with pytest.raises(CorruptRunError, match=r"records'.*missing from a run marked complete"):
        graddebug.load(tmp_path / "run")


def test_a_directory_named_like_a_part_is_not_read(tmp_path: Path) -> None:
    streamed(tmp_path / "run")
    folder = part(tmp_path / "run", 3)
    folder.mkdir()
    shutil.copy(part(tmp_path / "run", 0), folder / "inner.parquet")
    with pytest.raises(CorruptRunError, match=r"part-000003\.parquet.*not a regular file"):
        graddebug.load(tmp_path / "run")


# -- columns of the wrong type ----------------------------------------------------------------


@pytest.mark.parametrize(("column", "arrow_type"), [
    ("step", pa.int8()), ("numel", pa.uint8()), ("depth", pa.int32()), ("norm", pa.float32()),
])
def test_a_streamed_part_with_a_narrower_column_type_is_corrupt(
        tmp_path: Path, column: str, arrow_type: Any) -> None:
    streamed(tmp_path / "run")
    file = part(tmp_path / "run", 1)
    rewrite(file, column, pq.read_table(file).column(column).cast(arrow_type))
    with pytest.raises(CorruptRunError, match=rf"part-000001\.parquet.*column '{column}' is of "
                                              rf"Arrow type {arrow_type}"):
        graddebug.load(tmp_path / "run")
    assert steps_of(graddebug.load(tmp_path / "run", skip_damaged=True)) == [0, 1, 4, 5]


def test_a_string_step_column_is_corrupt_and_skipped(tmp_path: Path) -> None:
    streamed(tmp_path / "run")
    file = part(tmp_path / "run", 2)
    rewrite(file, "step", pa.array(["four"] * pq.read_table(file).num_rows))
    with pytest.raises(CorruptRunError, match=r"part-000002\.parquet.*column 'step'"):
        graddebug.load(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    assert steps_of(loaded) == [0, 1, 2, 3]
    assert loaded.metadata["run"]["damaged"] == [str(file)]


def test_a_part_missing_a_schema_column_is_corrupt(tmp_path: Path) -> None:
    streamed(tmp_path / "run")
    file = part(tmp_path / "run", 0)
    pq.write_table(pq.read_table(file).drop_columns(["layer"]), file)
    with pytest.raises(CorruptRunError, match=r"part-000000\.parquet.*no 'layer' column"):
        graddebug.load(tmp_path / "run")
    assert steps_of(graddebug.load(tmp_path / "run", skip_damaged=True)) == [2, 3, 4, 5]


@pytest.mark.parametrize(("column", "dtype"), [
    ("step", "int8"), ("numel", "uint8"), ("norm", "object"), ("nan", "int64"),
    ("layer", "float64"),
])
def test_a_spec_with_another_dtype_than_the_schema_is_corrupt(
        tmp_path: Path, column: str, dtype: str) -> None:
    runs.healthy().save(tmp_path / "run")
    meta_file = tmp_path / "run" / META_FILE
    meta = json.loads(meta_file.read_text())
    meta["columns"]["records"] = [[c, dtype if c == column else d]
                                  for c, d in meta["columns"]["records"]]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CorruptRunError, match=rf"graddebug\.json.*records column {column!r} is "
                                              rf"{dtype!r} where the schema has") as caught:
        graddebug.load(tmp_path / "run")
    assert caught.value.path == str(meta_file)
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    pd.testing.assert_frame_equal(loaded.frame(), runs.healthy().frame())
    assert loaded.metadata["run"]["rediagnosed"] is True


def test_a_finished_part_stored_with_another_type_than_its_spec_is_corrupt(
        tmp_path: Path) -> None:
    runs.healthy().save(tmp_path / "run")
    file = part(tmp_path / "run", 0)
    rewrite(file, "step", pq.read_table(file).column("step").cast(pa.int8()))
    with pytest.raises(CorruptRunError, match=r"part-000000\.parquet.*column 'step' is of "
                                              r"Arrow type int8"):
        graddebug.load(tmp_path / "run")


def test_a_spec_without_step_is_corrupt_and_skipped(tmp_path: Path) -> None:
    runs.broken().save(tmp_path / "run")
    meta_file = tmp_path / "run" / META_FILE
    meta = json.loads(meta_file.read_text())
    meta["columns"]["records"] = [c for c in meta["columns"]["records"] if c[0] != "step"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CorruptRunError, match=r"graddebug\.json.*records column 'step' is "
                                              r"'missing'"):
        graddebug.load(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    pd.testing.assert_frame_equal(loaded.frame(), runs.broken().frame())
    pd.testing.assert_frame_equal(loaded.findings(), runs.broken().findings())


# -- hostile JSON ------------------------------------------------------------------------------


def test_deeply_nested_json_is_corrupt_and_skipped(tmp_path: Path) -> None:
    runs.healthy().save(tmp_path / "run")
    meta_file = tmp_path / "run" / META_FILE
    text = meta_file.read_text()
    depth = 100_000
    meta_file.write_text(text.replace('"metadata": {', '"metadata": {"deep": ' + "[" * depth
                                      + "]" * depth + ", ", 1))
    with pytest.raises(CorruptRunError, match=r"graddebug\.json.*truncated or corrupt"):
        graddebug.load(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run", skip_damaged=True)
    pd.testing.assert_frame_equal(loaded.frame(), runs.healthy().frame())
    assert loaded.metadata["run"]["damaged"] == [str(meta_file)]


def test_the_live_reader_refuses_a_planted_link(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    streamed(tmp_path / "elsewhere")
    with graddebug.watch(model, log_dir=tmp_path / "run", flush_every=1) as dbg:
        model(torch.ones(2, 3)).sum().backward()
        dbg.step()
        os.symlink(part(tmp_path / "elsewhere", 0), part(tmp_path / "run", 5))
        with pytest.raises(CorruptRunError, match=r"part-000005\.parquet.*symbolic link"):
            dbg.frame()
        os.unlink(part(tmp_path / "run", 5))

