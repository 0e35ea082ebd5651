"""Report: saving, plots for notebooks, and the digests the CLI and the HTML page show."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import graddebug
import runs
from graddebug.errors import MissingFrameworkError
from graddebug.records import Finding
from graddebug.report.digest import compare_runs, issue_table, worst_layers

matplotlib = pytest.importorskip("matplotlib")


def test_save_returns_the_run_directory_that_load_reads(tmp_path: Path) -> None:
    report = runs.broken()
    where = report.save(tmp_path / "nested" / "run")
    assert where == tmp_path / "nested" / "run"
    assert repr(graddebug.load(where)) == repr(report)


def test_flow_plot_shows_the_median_norm_of_each_tensor_by_depth() -> None:
    backend = matplotlib.get_backend()
    report = runs.broken()
    fig = report.plot_flow()
    assert matplotlib.get_backend() == backend
    assert fig.canvas.manager is None  # not a pyplot figure: no window, no global state
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    frame = report.frame()
    activations = frame[frame["kind"] == "activation"]
    finite = activations[np.isfinite(activations["norm"])]
    medians = finite.groupby("layer", sort=False)["norm"].median()
    line = next(li for li in ax.lines if li.get_label().startswith("activation"))
    np.testing.assert_allclose(line.get_ydata(), medians.loc[list(runs.LAYERS)].to_numpy())
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[:2] == ["embed", "embed.weight"]
    red = {t.get_text() for t in ax.get_xticklabels() if t.get_color() == "#d62728"}
    assert red == {"block.1", "block.1.weight"}  # the layer with the NaN finding
    assert any(li.get_label() == "NaN/Inf at some step" for li in ax.lines)


def test_heatmap_holds_log10_norms_and_marks_findings() -> None:
    report = runs.broken()
    fig = report.plot_heatmap()
    ax = fig.axes[0]
    image = ax.images[0].get_array()
    n_tensors = len(report.summary())
    assert image.shape == (n_tensors, 12)
    frame = report.frame()
    cell = frame[(frame["layer"] == "head") & (frame["kind"] == "parameter")
                 & (frame["step"] == 7)]["norm"].item()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert image[labels.index("head.weight"), 7] == pytest.approx(math.log10(cell))
    bad_row = labels.index("block.1")
    assert np.ma.is_masked(image[bad_row, 5])
    assert len(ax.images) == 2  # the red overlay of non-finite cells
    marks = ax.collections[0].get_offsets()
    assert [tuple(m) for m in marks] == [(5.0, float(bad_row))]  # the finding: step 5


def test_heatmap_bins_long_runs_by_averaging_log_norms() -> None:
    from graddebug.report.plots import heatmap_figure

    frame = runs.report(runs.records(steps=10)).frame()
    fig = heatmap_figure(frame, runs.healthy().findings().iloc[0:0], max_steps=4)
    image = fig.axes[0].images[0].get_array()
    assert image.shape[1] == 4  # 10 steps in bins of 3
    embed = frame[(frame["layer"] == "embed") & (frame["kind"] == "activation")]
    expected = np.log10(embed["norm"].to_numpy()[3:6]).mean()
    assert image[0, 1] == pytest.approx(expected)
    assert "average 3 steps" in fig.axes[0].get_xlabel()


def test_plots_without_matplotlib_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingFrameworkError, match=r"pip install graddebug\[report\]"):
        runs.healthy().plot_flow()


def finding(step: int, layer: str, issue: str, severity: str) -> Finding:
    return Finding(step, layer, "output", issue, severity, 1.0, 1.0, f"{issue} at {layer}")


def test_issue_table_groups_by_issue_worst_first() -> None:
    findings = graddebug.frames.finding_frame([
        finding(3, "a", "vanishing", "warning"),
        finding(1, "b", "vanishing", "warning"),
        finding(4, "c", "nonfinite", "error"),
        finding(4, "c", "cut_graph", "warning"),
        finding(9, "d", "cut_graph", "error"),
    ])
    table = issue_table(findings)
    assert list(table["issue"]) == ["nonfinite", "cut_graph", "vanishing"]
    assert list(table["severity"]) == ["error", "error", "warning"]
    assert list(table["count"]) == [1, 2, 2]
    assert list(table["layers"]) == [1, 2, 2]
    assert list(table["first_step"]) == [4, 4, 1]
    assert list(table["first_layer"]) == ["c", "c", "b"]
    assert table["message"].iloc[2] == "vanishing at b"


def test_worst_layers_puts_flagged_then_unusual_norms_first() -> None:
    rows = runs.records(nan_at=(5, "block.1"))
    quiet = [r._replace(norm=r.norm / 100) if r.layer == "block.0" else r for r in rows]
    report = runs.report(quiet)
    assert set(report.findings()["layer"]) == {"block.1"}
    worst = worst_layers(report.summary(), report.findings(), n=4)
    assert list(worst["layer"]) == ["block.1", "block.1", "block.0", "block.0"]
    # block.0 sits two decades below the others' norms (about 1)
    assert worst["decades"].iloc[2] == pytest.approx(2, abs=0.1)
    assert len(worst_layers(report.summary(), report.findings(), n=100)) == len(report.summary())


def test_compare_gives_per_tensor_ratios_b_over_a() -> None:
    rows = runs.records()
    scaled = [r._replace(norm=r.norm * 100) if r.layer == "block.0" else r for r in rows]
    extra = [r._replace(layer="new", depth=9) for r in rows if r.layer == "head"]
    a = runs.report(rows).summary()
    b = runs.report(scaled + extra).summary()
    table = compare_runs(a, b)
    ratio = dict(zip(table["layer"] + "." + table["tensor"], table["ratio"], strict=True))
    assert ratio["block.0.output"] == pytest.approx(100)
    assert ratio["block.0.weight"] == pytest.approx(100)
    assert ratio["head.output"] == pytest.approx(1)
    assert math.isnan(ratio["new.output"])
    assert list(table["layer"][:2]) == ["embed", "embed"]
    assert table["layer"].iloc[-1] == "new"
    assert isinstance(table, pd.DataFrame)




def test_heatmap_marks_an_event_of_no_single_layer_on_the_step_axis() -> None:
    from graddebug.capture.steps import loss_record
    from graddebug.frames import finding_frame, record_frame
    from graddebug.records import Finding
    from graddebug.report.plots import heatmap_figure

    rows = runs.records(steps=10)
    frame = record_frame([*rows, *(loss_record(step, 1.0) for step in range(10))])
    event = Finding(6, "", "", "update_too_large", "warning", 1e4, 10.0,
                    "every layer's update/weight ratio jumped together", cause="optimizer")
    fig = heatmap_figure(frame, finding_frame([event]))
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "loss" not in labels  # the loss is no gradient
    lines = [li for li in ax.lines if li.get_label() == "event of no single layer"]
    assert len(lines) == 1 and list(lines[0].get_xdata()) == [6, 6]
