"""Weights & Biases output, run offline and read back from the run's own transaction log.

wandb 0.31 writes an offline run as one ``run-<id>.wandb`` file (no ``wandb-summary.json``,
no history file) and no longer ships a Python reader for it. The file is a LevelDB log (a
7-byte ``:W&B`` header, then 32 KiB blocks of records: a 4-byte checksum, a 2-byte length, a
1-byte type FULL/FIRST/MIDDLE/LAST), each record a ``wandb_internal_pb2.Record`` protobuf,
which is what ``wandb sync`` uploads. :func:`read_run` parses it with wandb's own protobuf
classes; the findings table is the JSON file its history row points at.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import graddebug
from graddebug.errors import ConfigError, MissingFrameworkError
from graddebug.integrations.wandb import (
    FINDINGS_KEY,
    STEP_KEY,
    TABLE_KEY,
    alert_title,
    log_to_wandb,
)

_BLOCK, _HEADER = 32768, 7


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[Any]]:
    """The history rows (key -> value) and the alert records of an offline run."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, alerts, chunk, pos, finished = [], [], b"", _HEADER, False
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if left < _HEADER or (length, kind) == (0, 0):  # the zero padding of a block's end
            pos += left
            continue
        chunk += data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind not in (1, 4):  # FIRST and MIDDLE pieces wait for the LAST one
            continue
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(chunk)
        chunk = b""
        if record.HasField("history"):
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif record.HasField("alert"):
            alerts.append(record.alert)
        finished = finished or record.HasField("exit")
    assert finished, f"{path} holds no exit record: the run was not written to its end"
    return rows, alerts


@pytest.fixture
def wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """wandb, offline, silent, writing under tmp_path only; its service stopped after."""
    module = pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                        "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
                        "WANDB_DISABLE_CODE": "true", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    for name in ("CONFIG", "CACHE", "DATA", "ARTIFACT"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / name.lower()))
    yield module
    module.teardown()  # the wandb-core service would otherwise outlive the test


def _init(wandb: Any) -> Any:
    return wandb.init(project="graddebug-test", settings=wandb.Settings(x_disable_stats=True))


def _train(wandb: Any, model: Any, steps: int) -> tuple[Any, list[float], Path]:
    """Train with a W&B run that logs the loss itself each step; return the Watcher, the
    total gradient norm torch computes at each step, and the run's directory."""
    import torch

    run = _init(wandb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    norms = []
    with log_to_wandb(graddebug.watch(model)) as dbg:
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            grads = [p.grad.flatten() for p in model.parameters()]
            norms.append(float(torch.linalg.vector_norm(torch.cat(grads))))
            optimizer.step()
            dbg.step(loss=loss)
            run.log({"loss": loss.item()})
    run_dir = Path(run.dir).parent
    run.finish()
    wandb.teardown()  # finish() returns before the service has written the last row
    return dbg, norms, run_dir


def _per_layer(frame: pd.DataFrame) -> dict[tuple[int, str], tuple[float, float]]:
    """Each step's and layer's gradient norm and update/weight ratio, from dbg.frame()."""
    params = frame[frame["kind"] == "parameter"]
    sums = params.assign(grad=params["norm"] ** 2, update=params["update_norm"] ** 2,
                         weight=params["weight_norm"] ** 2)
    sums = sums.groupby(["step", "layer"])[["grad", "update", "weight"]].sum().reset_index()
    return {(int(step), str(layer)): (math.sqrt(grad), math.sqrt(update / weight))
            for step, layer, grad, update, weight in sums.itertuples(index=False)}


def test_a_vanishing_run_logs_the_frame_alerts_and_the_findings_table(wandb: Any) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(8):
        layers += [torch.nn.Linear(16, 16), torch.nn.Sigmoid()]
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), *layers, torch.nn.Linear(16, 4))
    dbg, norms, run_dir = _train(wandb, model, steps=6)
    findings = dbg.findings()
    assert "vanishing" in set(findings["issue"])

    rows, alerts = read_run(run_dir)
    logged = [row for row in rows if FINDINGS_KEY in row]  # not the table's own row
    assert [row[STEP_KEY] for row in logged] == list(range(6))  # one host row a step
    assert [row["loss"] for row in logged] == pytest.approx(
        [row["graddebug/loss"] for row in logged])
    np.testing.assert_allclose([row["graddebug/grad_norm"] for row in logged], norms,
                               rtol=1e-5)  # torch's own total norm
    expected = _per_layer(dbg.frame())
    for row in logged:
        for (step, layer), (norm, ratio) in expected.items():
            if step == row[STEP_KEY]:
                assert row[f"graddebug/grad_norm/{layer}"] == pytest.approx(norm, rel=1e-6)
                assert row[f"graddebug/update_ratio/{layer}"] == pytest.approx(ratio, rel=1e-6)
    assert sum(row[FINDINGS_KEY] for row in logged) == len(findings)

    serious = findings[findings["severity"].isin(["warning", "error"])]
    assert sorted(a.title for a in alerts) == sorted(
        {alert_title(i, layer) for i, layer in zip(serious["issue"], serious["layer"],
                                                   strict=True)})
    (row,) = [row for row in rows if f"{TABLE_KEY}/path" in row]
    table = json.loads((run_dir / "files" / row[f"{TABLE_KEY}/path"]).read_text())
    assert table["columns"] == list(findings.columns)
    got = pd.DataFrame(table["data"], columns=table["columns"])
    pd.testing.assert_frame_equal(got, findings.reset_index(drop=True), check_dtype=False)


def test_a_healthy_run_logs_its_metrics_and_no_finding(wandb: Any) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    dbg, norms, run_dir = _train(wandb, model, steps=4)
    assert dbg.findings().empty
    rows, alerts = read_run(run_dir)
    logged = [row for row in rows if FINDINGS_KEY in row]  # not the table's own row
    np.testing.assert_allclose([row["graddebug/grad_norm"] for row in logged], norms,
                               rtol=1e-5)
    assert alerts == []
    assert all(row[FINDINGS_KEY] == 0 for row in logged)
    assert not any(key.startswith(TABLE_KEY) for row in rows for key in row)


class FakeRun:
    """The part of a W&B run that graddebug uses, with a step the host commits."""

    def __init__(self) -> None:
        self.step = 0
        self.pending: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.alerts: list[dict[str, Any]] = []
        self.metrics: list[tuple[str, str | None]] = []

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.metrics.append((name, step_metric))

    def log(self, data: dict[str, Any], commit: bool | None = None) -> None:
        self.pending.update(data)
        if commit is not False:
            self.rows.append(self.pending)
            self.pending, self.step = {}, self.step + 1

    def alert(self, **kwargs: Any) -> None:
        self.alerts.append(kwargs)


def test_steps_ride_on_the_hosts_rows_with_their_maxima(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Between two rows of the host, the latest values and the maxima since the last row;
    each alert once per issue and layer; the table at the end. No wandb process."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("wandb")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    run = FakeRun()
    scales = [1.0, 100.0, 1.0, float("nan"), 1.0]
    with log_to_wandb(graddebug.watch(model), run=run) as dbg:
        for step, scale in enumerate(scales):
            (model(torch.randn(8, 4)).square().mean() * scale).backward()
            dbg.step()
            model.zero_grad()
            if step in (1, 4):  # the host logs after steps 1 and 4 only
                run.log({"host": step})
    assert (STEP_KEY, None) in run.metrics and ("graddebug/*", STEP_KEY) in run.metrics
    frame = dbg.frame()
    totals = frame[frame["kind"] == "parameter"].groupby("step")["norm"].apply(
        lambda n: math.sqrt((n ** 2).sum()))
    first, second = run.rows
    assert first[STEP_KEY] == 1 and second[STEP_KEY] == 4
    assert first["graddebug/grad_norm"] == pytest.approx(totals[1])
    assert first["graddebug/grad_norm/max"] == pytest.approx(max(totals[0], totals[1]))
    assert second["graddebug/grad_norm"] == pytest.approx(totals[4])
    assert math.isnan(second["graddebug/grad_norm/max"])  # step 3's NaN is not lost
    findings = dbg.findings()
    assert "nonfinite" in set(findings["issue"])
    assert first[FINDINGS_KEY] + second[FINDINGS_KEY] == len(findings[findings["step"] <= 4])
    titles = [a["title"] for a in run.alerts]
    assert len(titles) == len(set(titles))
    assert alert_title("nonfinite", findings.loc[findings["issue"] == "nonfinite",
                                                 "layer"].iloc[0]) in titles
    assert {a["level"] for a in run.alerts} <= {"WARN", "ERROR"}
    table = run.pending[TABLE_KEY]  # logged at the end, into the host's next row
    assert table.columns == list(findings.columns) and len(table.data) == len(findings)


def test_a_title_fits_what_wandb_accepts() -> None:
    assert alert_title("vanishing", "0") == "graddebug: vanishing at 0"
    assert len(alert_title("vanishing", "encoder." * 20)) == 63
    assert alert_title("cut_graph", "") == "graddebug: cut_graph at every layer"


def test_log_to_wandb_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setattr(wandb, "run", None)
    with pytest.raises(ConfigError, match=r"wandb.init\(project=\.\.\.\)"):
        log_to_wandb(graddebug.watch())
    with pytest.raises(ConfigError, match="not the model"):
        log_to_wandb(object(), run=FakeRun())  # type: ignore[type-var]
    with pytest.raises(ConfigError, match="alerts='no'"):
        log_to_wandb(graddebug.watch(), run=FakeRun(), alerts="no")  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingFrameworkError, match=r"pip install graddebug\[wandb\]"):
        log_to_wandb(graddebug.watch(), run=FakeRun())


def test_a_watcher_not_streamed_logs_nothing() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("wandb")
    run = FakeRun()
    model = torch.nn.Linear(3, 1)
    with log_to_wandb(graddebug.watch(model), run=run):
        pass
    with graddebug.watch(model) as dbg:  # another Watcher, not streamed
        model(torch.randn(2, 3)).sum().backward()
        dbg.step()
    assert run.rows == [] and run.pending == {} and run.alerts == []
