"""Bad input gets a typed error that names it; numbers from numpy work like Python numbers; a
run's directory name is never shared by two runs."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import graddebug
import runs
from graddebug import Thresholds
from graddebug.errors import ConfigError, GradDebugError, RunFileError
from graddebug.runs.layout import META_FILE

pytest_plugins = ["pytester"]

NUMPY_INTS = (np.int64, np.int32)
NUMPY_FLOATS = (np.float32, np.float64)
# The thresholds that count (steps, entries) take ints only: those whose default is an int.
INT_THRESHOLDS = {name for name, value in Thresholds().as_dict().items()
                  if isinstance(value, int)}


# -- numpy scalars are numbers ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "kind"), [
    (name, kind) for name in Thresholds.names() for kind in (*NUMPY_INTS, *NUMPY_FLOATS)
    if not (name in INT_THRESHOLDS and kind in NUMPY_FLOATS)  # ints only
], ids=str)
def test_every_threshold_accepts_numpy_scalars_and_stores_python_numbers(name: str,
                                                                          kind: type) -> None:
    default = Thresholds().as_dict()[name]
    given = kind(1) if kind in NUMPY_INTS else kind(default)
    thresholds = Thresholds(**{name: given})
    value = getattr(thresholds, name)
    assert type(value) is (int if kind in NUMPY_INTS else float)
    assert value == float(given)
    # Thresholds go into the run's JSON file as numbers.
    assert json.loads(json.dumps(thresholds.as_dict()))[name] == value
    assert Thresholds.coerce({name: given}) == thresholds


def test_numpy_floats_are_still_refused_where_an_int_is_needed() -> None:
    with pytest.raises(ConfigError, match=r"growth_window=5\.0 counts steps"):
        Thresholds(growth_window=np.float32(5.0))
    with pytest.raises(ConfigError, match="must be a number"):
        Thresholds(exploding_norm=np.bool_(True))


@pytest.mark.parametrize("kind", NUMPY_INTS, ids=lambda k: k.__name__)
def test_every_and_flush_every_accept_numpy_ints(tmp_path: Path, kind: type) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("pyarrow")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    x = torch.ones(4, 3)
    with graddebug.watch(model, every=kind(2), flush_every=kind(1),
                         log_dir=tmp_path / "run") as dbg:
        for _ in range(5):
            model.zero_grad()
            model(x).sum().backward()
            dbg.step()
    assert sorted(dbg.frame()["step"].unique()) == [0, 2, 4]
    meta = json.loads((tmp_path / "run" / META_FILE).read_text())
    options = meta["metadata"]["options"]
    assert (options["every"], options["flush_every"], meta["flush_every"]) == (2, 1, 1)
    assert meta["parts"] == 3  # one part per recorded step: flush_every=1 took effect


def test_interventions_accept_numpy_scalars() -> None:
    torch = pytest.importorskip("torch")
    x = torch.tensor([[1.0, -2.0, 3.0]], requires_grad=True)
    # Reference by hand: loss = sum(tapped(3x)^2); the gradient reaching the tap is 2 * 3x.
    g = 2 * 3 * x.detach().numpy()
    cases: list[tuple[dict[str, Any], np.ndarray]] = [
        ({"clip_norm": np.float32(0.5)}, g * min(1.0, 0.5 / np.linalg.norm(g))),
        ({"clip_value": np.float32(4.0)}, np.clip(g, -4.0, 4.0)),
        ({"scale": np.int64(3)}, 3 * g),
        ({"scale": np.int32(-1)}, -g),
    ]
    for options, expected in cases:
        x.grad = None
        with graddebug.watch() as dbg:
            h = dbg.tap(3 * x, "h", **options)
            (h ** 2).sum().backward()
            dbg.step()
        np.testing.assert_allclose(x.grad.numpy(), 3 * expected, rtol=1e-6,
                                   err_msg=str(options))
    with graddebug.watch(intervene={"h": {"clip_norm": np.float64(0.5)}}) as dbg:
        x.grad = None
        (dbg.tap(3 * x, "h") ** 2).sum().backward()
        dbg.step()
    np.testing.assert_allclose(x.grad.numpy(), 3 * g * 0.5 / np.linalg.norm(g), rtol=1e-6)


def test_zero_dimensional_tensors_stay_refused_with_a_clear_message() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ConfigError, match=r"every=tensor\(2\) must be a positive int"):
        graddebug.watch(every=torch.tensor(2))
    with pytest.raises(ConfigError, match=r"clip_norm=tensor\(1\.\) must be a positive"):
        graddebug.watch(intervene={"h": {"clip_norm": torch.tensor(1.0)}})
    with pytest.raises(ConfigError, match="must be a number"):
        Thresholds(exploding_norm=torch.tensor(1e4))


def test_the_pytest_marker_accepts_numpy_scalars(pytester: pytest.Pytester,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "graddebug.integrations.pytest_plugin")
    pytester.makepyfile(test_marker=textwrap.dedent('''
        import numpy as np
        import pytest

        @pytest.mark.graddebug(exploding_norm=np.float32(7.0), growth_window=np.int64(3),
                               dead_fraction=np.int32(1))
        def test_numpy_marker(graddebug):
            t = graddebug.thresholds
            assert (t.exploding_norm, t.growth_window, t.dead_fraction) == (7.0, 3, 1)
            assert type(t.growth_window) is int
    '''))
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1)


# -- options of the wrong type raise ConfigError ----------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"layers": 5}, r"layers=5 must be a layer name, a glob, a layer type, or a list"),
    ({"keep": 123}, r"keep=123 must be a layer or tap name or a list of names"),
    ({"keep": ["fc1", 2]}, r"keep entry 2 must be a layer or tap name"),
    ({"log_dir": 12345}, r"log_dir=12345 must be a non-empty str or pathlib\.Path"),
    ({"outputs": "no"}, r"outputs='no' must be True or False"),
    ({"strict": "yes"}, r"strict='yes' must be True or False"),
    ({"strict": 1}, r"strict=1 must be True or False"),
    ({"every": 2.0}, r"every=2\.0 must be a positive int"),
])
def test_options_of_the_wrong_type_raise_config_error(options: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        graddebug.watch(**options)


def test_numpy_bools_are_bools() -> None:
    dbg = graddebug.watch(outputs=np.bool_(False), strict=np.bool_(True))
    assert dbg._options.outputs is False


def test_log_dir_under_a_file_is_refused_when_watching(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    (tmp_path / "notes.txt").write_text("a file")
    with pytest.raises(ConfigError, match=r"lies under '.*notes\.txt', which is a file"):
        graddebug.watch(log_dir=tmp_path / "notes.txt" / "run")


def test_a_log_dir_that_is_not_utf8_is_refused_when_watching(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    bad = str(tmp_path / "run-\udcff")  # what os.fsdecode makes of the byte 0xff
    with pytest.raises(ConfigError, match=r"log_dir=.*run-\\udcff.* is not valid UTF-8"):
        graddebug.watch(log_dir=bad)
    assert not Path(bad).exists()


@pytest.mark.parametrize(("path", "message"), [
    ("run-\udcff", r"save\(path\)=.*is not valid UTF-8"),
    ("run\0", r"save\(path\)=.*holds a NUL character"),
    ("notes.txt/run", r"lies under '.*notes\.txt', which is a file"),
    (None, r"save\(path\)=None must be a non-empty str"),
])
def test_save_to_a_path_that_cannot_hold_a_run_raises_run_file_error(
        tmp_path: Path, path: str | None, message: str) -> None:
    pytest.importorskip("pyarrow")
    (tmp_path / "notes.txt").write_text("a file")
    target = None if path is None else str(tmp_path / path)
    with pytest.raises(RunFileError, match=message):
        runs.healthy().save(target)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing left behind


def test_save_of_a_live_watcher_to_a_path_that_cannot_hold_a_run(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    with graddebug.watch() as dbg, pytest.raises(RunFileError, match="NUL"):
        dbg.save(str(tmp_path / "a\0b"))


def test_every_option_error_is_a_graddebug_error() -> None:
    for options in ({"layers": 5}, {"keep": 123}, {"log_dir": 12345}, {"outputs": "no"}):
        with pytest.raises(GradDebugError):
            graddebug.watch(**options)
    assert math.isfinite(Thresholds(exploding_norm=np.float32(1e4)).exploding_norm)


# -- --graddebug-dir names ----------------------------------------------------------------------


def test_run_directories_are_unique_also_for_suffixed_names() -> None:
    from graddebug.integrations.pytest_plugin import _dir_name

    taken: dict[str, tuple[str, int]] = {}
    first = _dir_name("t.py::test_param[x--2]", taken)
    second_run = _dir_name("t.py::test_param[x]", taken, 2)
    assert first == "t.py__test_param_x--2"
    assert second_run != first and second_run.endswith("--2")
    # The other order: the second run claims the name first.
    taken = {}
    second_run = _dir_name("t.py::test_param[x]", taken, 2)
    first = _dir_name("t.py::test_param[x--2]", taken)
    assert second_run == "t.py__test_param_x--2" and first != second_run
    # Names that differ only by case would share a directory on macOS and Windows.
    taken = {}
    assert _dir_name("t.py::test_A", taken).casefold() != _dir_name("t.py::test_a",
                                                                     taken).casefold()
    # Asking again for the same run of the same test gives the same name.
    assert _dir_name("t.py::test_param[x]", taken, 2) == _dir_name("t.py::test_param[x]",
                                                                   taken, 2)


def test_graddebug_dir_keeps_both_runs_of_colliding_test_ids(pytester: pytest.Pytester,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("pyarrow")
    import graddebug.report.load  # imported here: pytester drops the modules a run adds

    graddebug.check(torch.nn.Linear(3, 2), torch.ones(2, 3), lambda out: out.sum())
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "graddebug.integrations.pytest_plugin")
    pytester.makepyfile(test_ids=textwrap.dedent('''
        import pytest
        import torch

        @pytest.mark.parametrize("name", ["x--2", "x"])
        def test_param(graddebug, name):
            # test_param[x] records two runs: its second is named "...test_param_x--2" too.
            for width in range(1, 2 if name == "x--2" else 3):
                graddebug.check(torch.nn.Linear(3, width), torch.ones(2, 3),
                                lambda out: out.sum())
    '''))
    result = pytester.runpytest("--graddebug-dir", "reports")
    result.assert_outcomes(passed=2)
    saved = [graddebug.load(p) for p in (pytester.path / "reports").iterdir()]
    assert sorted((r.metadata["pytest"]["nodeid"].split("[")[1], r.metadata["pytest"]["run"],
                   r.frame()["shape"].iloc[0]) for r in saved) == [
        ("x--2]", 1, "(2, 1)"), ("x]", 1, "(2, 1)"), ("x]", 2, "(2, 2)")]
