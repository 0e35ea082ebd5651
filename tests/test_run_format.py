"""Runs written by graddebug 0.1.0 keep loading: run directories committed as fixtures.

``tests/data/runs_v1`` holds three runs written by that release (a torch MLP): one streamed with
``log_dir`` and an intervention, a copy of it taken mid-run (its JSON file still says
``running``, as after a kill), and one with a NaN weight written by ``save()``. Next to each, the
frames that release returned for it, in a second format (JSON, split orientation), with their
dtypes.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

import graddebug
from graddebug.records import EVENT_COLUMNS, FINDING_COLUMNS, RECORD_COLUMNS, Cause

pytest.importorskip("pyarrow")

DATA = Path(__file__).resolve().parent / "data" / "runs_v1"
RUNS = ("streamed", "killed", "saved_nan")


def expected(name: str) -> dict:
    return json.loads((DATA / f"{name}.expected.json").read_text(encoding="utf-8"))


def from_json(stored: dict, dtypes: dict[str, str]) -> pd.DataFrame:
    frame = pd.DataFrame(stored["data"], columns=stored["columns"])
    for column, dtype in dtypes.items():
        values = frame[column]
        if dtype == "float64":
            values = values.astype("float64")  # JSON null is NaN
        frame[column] = values.astype(dtype)
    return frame


@pytest.fixture
def run_dir(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A copy, so that loading cannot change the committed fixture."""
    target = tmp_path / request.param
    shutil.copytree(DATA / request.param, target)
    return target


@pytest.mark.parametrize("run_dir", RUNS, indirect=True)
def test_runs_of_format_1_load_with_their_frames(run_dir: Path) -> None:
    want = expected(run_dir.name)
    report = graddebug.load(run_dir)
    for name, method in (("frame", report.frame), ("events", report.events),
                         ("findings", report.findings)):
        got = method()
        # Format 1 came from one process and knew no source lines, causes or updates: the
        # columns appended since read as rank 0, NaN weight and update norms and, for events
        # and findings, an empty source; the findings' cause is the diagnosis's own.
        appended = {"frame": ["rank", "weight_norm", "update_norm", "clipped_norm"],
                    "events": ["rank", "source"],
                    "findings": ["rank", "source", "cause"]}[name]
        assert list(got.columns)[-len(appended):] == appended, name
        assert (got["rank"] == 0).all(), name
        assert name == "frame" or (got["source"] == "").all(), name
        if name == "frame":
            assert got[["weight_norm", "update_norm", "clipped_norm"]].isna().all().all()
        if name == "findings":
            # a stored internal error names no cause
            assert set(got["cause"]) <= {"", *(c.value for c in Cause)}, got["cause"]
        got = got.drop(columns=appended)
        assert {c: str(t) for c, t in got.dtypes.items()} == want["dtypes"][name], name
        pd.testing.assert_frame_equal(got, from_json(want[name], want["dtypes"][name]),
                                      check_exact=False, rtol=1e-12, obj=name)
    assert report.metadata["run"]["status"] == want["status"]


@pytest.mark.parametrize("run_dir", RUNS, indirect=True)
def test_loaded_columns_follow_the_schema(run_dir: Path) -> None:
    report = graddebug.load(run_dir)
    columns = [c for c in report.frame().columns if c != "pre_norm"]
    assert columns == list(RECORD_COLUMNS)
    assert tuple(report.events().columns) == EVENT_COLUMNS
    assert tuple(report.findings().columns) == FINDING_COLUMNS


@pytest.mark.parametrize("run_dir", ["saved_nan"], indirect=True)
def test_old_findings_rediagnosed_have_no_source(run_dir: Path) -> None:
    report = graddebug.load(run_dir)
    found = report.rediagnose()
    assert not found.empty and (found["source"] == "").all()
    assert found[["step", "layer", "issue"]].values.tolist() \
        == report.findings()[["step", "layer", "issue"]].values.tolist()


def test_what_the_fixtures_hold() -> None:
    """The fixtures cover what the format must carry: pre_norm, a killed run, a NaN."""
    streamed, killed, saved = (graddebug.load(DATA / name) for name in RUNS)
    assert "pre_norm" in streamed.frame()  # the intervention on layer "2"
    assert (streamed.frame().dropna(subset=["pre_norm"])["layer"] == "2").all()
    assert streamed.frame()["step"].nunique() == 5
    assert killed.metadata["run"] == {**killed.metadata["run"], "status": "incomplete",
                                      "rediagnosed": True, "steps": 4, "last_step": 3}
    nan_rows = saved.frame()[saved.frame()["nan"]]
    assert not nan_rows.empty and all(math.isnan(v) for v in nan_rows["norm"])
    assert list(saved.findings()["issue"]) == ["nonfinite"]
