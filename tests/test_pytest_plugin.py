"""The pytest plugin, run in inner pytest sessions (pytester).

Inner sessions run in this process (``runpytest``) except where a clean process is the point
(``runpytest_subprocess``, and the start-up measurement). Everything an inner run imports is
imported here first, because pytester drops the modules an in-process run added.
"""

from __future__ import annotations

import hashlib
import statistics
import subprocess
import sys
import textwrap
from collections import OrderedDict

import numpy as np
import pytest

pytest_plugins = ["pytester"]

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import graddebug  # noqa: E402
import graddebug.report.verdict  # noqa: E402

# Import, outside the inner runs, what they use: the Watcher, the detectors, the torch adapter.
graddebug.check(nn.Linear(2, 1), torch.ones(1, 2), lambda out: out.sum())

MODELS = '''
import pytest
import torch
from collections import OrderedDict
from torch import nn
from torch.nn import functional as F


def sigmoid_net():
    """12 Linear layers with sigmoids between them: the first ones get no gradient."""
    layers = OrderedDict()
    for i in range(11):
        layers[f"fc{i}"] = nn.Linear(32 if i == 0 else 64, 64)
        layers[f"act{i}"] = nn.Sigmoid()
    layers["head"] = nn.Linear(64, 10)
    return nn.Sequential(layers)


def relu_net():
    """A He-initialised ReLU MLP: healthy."""
    layers = []
    for i in range(5):
        linear = nn.Linear(32 if i == 0 else 64, 64)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)


def train(model, dbg, steps=2):
    x, y = batch()
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():  # plain SGD (torch.optim imports more on its first step)
            for p in model.parameters():
                p -= 0.05 * p.grad
        dbg.step()
'''


def inner(pytester: pytest.Pytester, body: str, name: str = "test_inner") -> None:
    pytester.makepyfile(**{name: MODELS + textwrap.dedent(body)})


@pytest.fixture(autouse=True)
def only_graddebug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions load graddebug's plugin alone, not every plugin installed here: the
    others would be imported again for each in-process run. Loading by entry point is tested
    in a subprocess below."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "graddebug.integrations.pytest_plugin")


def test_a_healthy_model_passes_and_a_vanishing_one_fails_naming_the_layer(
        pytester: pytest.Pytester) -> None:
    inner(pytester, '''
        def test_healthy(graddebug):
            torch.manual_seed(0)
            graddebug.check(relu_net(), batch(), F.cross_entropy, steps=2).assert_healthy()

        def test_vanishing(graddebug):
            torch.manual_seed(0)
            graddebug.check(sigmoid_net(), batch(), F.cross_entropy, steps=2).assert_healthy()
    ''')
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*_ test_vanishing _*",
        "E *AssertionError: graddebug found * problem* in the gradients:",
        "E *step  layer  tensor  issue      cause  severity  value     threshold  message",
        "E *0     fc0    output  vanishing  layer  warning   *  0.001      gradient vanishes at "
        "'fc0': *",
    ])
    assert "assert_healthy()" in result.stdout.str()  # the test's own line is shown
    assert "health.py" not in result.stdout.str()  # graddebug's frames are hidden


def test_watchers_are_exited_at_teardown_also_when_the_test_failed(
        pytester: pytest.Pytester) -> None:
    inner(pytester, '''
        STATE = {}

        def test_fails(graddebug):
            model = relu_net()
            dbg = graddebug(model, keep=["no_such_layer"])
            STATE.update(model=model, dbg=dbg)
            x, y = batch()
            F.cross_entropy(model(x), y).backward()
            assert dbg.active
            raise ValueError("the test's own failure")

        def test_after(graddebug):
            dbg, model = STATE["dbg"], STATE["model"]
            assert not dbg.active
            assert all(not m._forward_hooks for m in model.modules())
            assert dbg.step_index == 1  # the open step was closed on exit
            assert set(dbg.frame()["step"]) == {0}

        def test_unknown_keep_name_errors_at_teardown(graddebug):
            dbg = graddebug(relu_net(), keep=["no_such_layer"])
    ''')
    result = pytester.runpytest()
    # The failed test is not also charged with keep= names its failure kept from matching.
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_unknown_keep_name_errors_at_teardown*",
        "*UnknownNameError: keep=/intervene= names matched no layer*'no_such_layer'*",
        "*_ test_fails _*",
        "*ValueError: the test's own failure",
    ])


def test_the_marker_sets_thresholds_for_watchers_and_checks(pytester: pytest.Pytester) -> None:
    inner(pytester, '''
        LOOSE = dict(vanishing_ratio=1e-30, vanishing_floor=1e-30)

        @pytest.mark.graddebug(**LOOSE)
        def test_check_under_the_marker(graddebug):
            torch.manual_seed(0)
            report = graddebug.check(sigmoid_net(), batch(), F.cross_entropy)
            assert report.thresholds.vanishing_ratio == 1e-30
            report.assert_healthy()

        @pytest.mark.graddebug(**LOOSE)
        def test_watch_under_the_marker(graddebug):
            dbg = graddebug(sigmoid_net(), thresholds={"vanishing_floor": 1e-7})
            assert (dbg.thresholds.vanishing_ratio, dbg.thresholds.vanishing_floor) == (
                1e-30, 1e-7)  # a dict given to the call wins key by key

        @pytest.mark.graddebug(exploding_norm=5.0)
        class TestNested:
            @pytest.mark.graddebug(exploding_norm=7.0, dead_fraction=0.9)
            def test_closest_marker_wins(self, graddebug):
                t = graddebug.thresholds
                assert (t.exploding_norm, t.dead_fraction) == (7.0, 0.9)

            def test_class_marker(self, graddebug):
                assert graddebug.thresholds.exploding_norm == 5.0

        def test_no_marker(graddebug):
            torch.manual_seed(0)
            report = graddebug.check(sigmoid_net(), batch(), F.cross_entropy)
            with pytest.raises(AssertionError, match="vanishing"):
                report.assert_healthy()

        @pytest.mark.graddebug(vanishing_rate=1e-3)
        def test_typo(graddebug):
            pass

        @pytest.mark.graddebug(1e-3)
        def test_positional(graddebug):
            pass
    ''')
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_typo*",
        "*ConfigError: unknown threshold 'vanishing_rate'*",
        "*ERROR at setup of test_positional*",
        "*ConfigError: @pytest.mark.graddebug(0.001,) takes threshold keywords only*",
    ])
    assert "graddebug(**thresholds)" in pytester.runpytest("--markers").stdout.str()


def test_strict_fails_passing_tests_with_findings_at_teardown(pytester: pytest.Pytester) -> None:
    inner(pytester, '''
        def test_watch_without_asserting(graddebug):
            torch.manual_seed(0)
            model = sigmoid_net()
            train(model, graddebug(model))

        def test_healthy_watch(graddebug):
            torch.manual_seed(0)
            model = relu_net()
            train(model, graddebug(model))

        def test_failing_with_findings(graddebug):
            torch.manual_seed(0)
            model = sigmoid_net()
            train(model, graddebug(model))
            assert False, "its own failure"

        def test_without_the_fixture():
            pass
    ''')
    result = pytester.runpytest()
    result.assert_outcomes(passed=3, failed=1)
    result = pytester.runpytest("--graddebug-strict")
    result.assert_outcomes(passed=3, failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "graddebug: strict (any finding fails the test)",
        "*ERROR at teardown of test_watch_without_asserting*",
        "graddebug --graddebug-strict: the gradients of this test have findings.",
        "watch(Sequential): * finding(s)",
        "step  layer  tensor  issue      cause  severity*",
        "0     fc0    output  vanishing  layer  warning*",
    ])
    assert "ERROR at teardown of test_failing_with_findings" not in result.stdout.str()


def test_reports_are_saved_per_test_with_graddebug_dir(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pyarrow")
    import graddebug.report.load

    inner(pytester, '''
        def test_check(graddebug):
            torch.manual_seed(0)
            graddebug.check(relu_net(), batch(), F.cross_entropy)

        def test_two_runs(graddebug):
            torch.manual_seed(0)
            model = sigmoid_net()
            train(model, graddebug(model), steps=3)
            graddebug.check(relu_net(), batch(), F.cross_entropy, steps=2)

        @pytest.mark.parametrize("width", [4, 8])
        def test_param(graddebug, width):
            graddebug.check(nn.Linear(3, width), torch.ones(2, 3), lambda out: out.sum())

        def test_fails(graddebug):
            graddebug.check(nn.Linear(3, 2), torch.ones(2, 3), lambda out: out.sum())
            assert False

        def test_without_the_fixture():
            pass
    ''', name="test_save")
    result = pytester.runpytest("--graddebug-dir", "reports")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines([f"graddebug: reports in {pytester.path / 'reports'}"])
    runs = {p.name: graddebug.load(p) for p in (pytester.path / "reports").iterdir()}
    assert set(runs) == {
        "test_save.py__test_check", "test_save.py__test_two_runs",
        "test_save.py__test_two_runs--2", "test_save.py__test_param_4",
        "test_save.py__test_param_8", "test_save.py__test_fails",
    }
    meta = runs["test_save.py__test_two_runs--2"].metadata["pytest"]
    assert meta == {"nodeid": "test_save.py::test_two_runs", "run": 2,
                    "label": "check(Sequential)", "outcome": "passed"}
    assert runs["test_save.py__test_fails"].metadata["pytest"]["outcome"] == "failed"
    watched = runs["test_save.py__test_two_runs"]
    assert sorted(watched.frame()["step"].unique()) == [0, 1, 2]
    assert "vanishing" in set(watched.findings()["issue"])
    assert set(runs["test_save.py__test_param_8"].frame()["shape"]) >= {"(2, 8)"}

    # test_check's gradients, against torch.autograd.grad on the same seeded model and batch.
    torch.manual_seed(0)
    layers = []
    for i in range(5):
        linear = nn.Linear(32 if i == 0 else 64, 64)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    frame = runs["test_save.py__test_check"].frame()
    saved = frame[frame["kind"] == "parameter"]
    got = dict(zip(saved["layer"] + "." + saved["tensor"], saved["norm"], strict=True))
    assert set(got) == set(names)
    for name, grad in zip(names, grads, strict=True):
        np.testing.assert_allclose(got[name], float(torch.linalg.vector_norm(grad)), rtol=1e-6)


def test_directory_names_are_safe_short_and_unique() -> None:
    from graddebug.integrations.pytest_plugin import _dir_name

    taken: dict[str, str] = {}
    assert _dir_name("tests/test_a.py::TestX::test_b[cpu-1]", taken) == (
        "tests_test_a.py__TestX__test_b_cpu-1")
    assert _dir_name("tests/test_a.py::TestX::test_b[cpu-1]", taken) == (
        "tests_test_a.py__TestX__test_b_cpu-1")  # the same test, the same name
    # Two ids that sanitize alike: the second gets a hash of its id instead of overwriting.
    assert _dir_name("t.py::test_c[a b]", taken) == "t.py__test_c_a_b"
    digest = hashlib.sha1(b"t.py::test_c[a?b]").hexdigest()[:10]
    assert _dir_name("t.py::test_c[a?b]", taken) == f"t.py__test_c_a_b-{digest}"
    long = _dir_name("t.py::test[" + "x" * 500 + "]", taken)
    assert len(long) == 120 + 1 + 10


def test_the_plugin_loads_without_importing_a_framework_or_pandas(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_clean='''
        import sys

        def test_clean(request, graddebug):
            assert request.config.pluginmanager.hasplugin("graddebug")
            assert graddebug.thresholds.vanishing_ratio == 1e-3
            loaded = {m.split(".")[0] for m in sys.modules}
            assert not loaded & {"torch", "tensorflow", "keras", "pandas", "pyarrow"}
    ''')
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.delenv("PYTEST_PLUGINS")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_plugin_adds_under_a_tenth_of_a_second_to_pytest_start_up() -> None:
    """Start-up budget: importing the plugin after pytest itself, median of 5 fresh processes.

    pytest's own imports are excluded (they are paid with or without graddebug), so the figure
    is what graddebug adds to every pytest session where it is installed: about 15 ms here.
    """
    code = textwrap.dedent('''
        import sys, time
        import pytest
        before = set(sys.modules)
        start = time.perf_counter()
        import graddebug.integrations.pytest_plugin
        took = time.perf_counter() - start
        heavy = {"torch", "tensorflow", "keras", "pandas", "numpy", "pyarrow", "rich"}
        print(took, *sorted({m.split(".")[0] for m in set(sys.modules) - before} & heavy))
    ''')
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout.split()
        for _ in range(5)
    ]
    assert all(len(run) == 1 for run in runs), runs  # no heavy module was imported
    times = [float(run[0]) for run in runs]
    assert statistics.median(times) < 0.1, times


def test_a_fixture_watcher_is_a_graddebug_watcher_and_its_report_is_kept() -> None:
    from graddebug.integrations.pytest_plugin import GradDebugFixture

    fixture = GradDebugFixture("t.py::t", {"exploding_norm": 9.0})
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 2)))
    dbg = fixture(model)
    try:
        assert isinstance(dbg, graddebug.Watcher) and dbg.active
        assert dbg.thresholds.exploding_norm == 9.0
        model(torch.ones(3, 4)).sum().backward()
        dbg.step()
    finally:
        dbg.__exit__(None, None, None)
    (report,) = fixture.reports()
    assert isinstance(report, graddebug.Report)
    weight = report.frame().set_index(["layer", "tensor"]).loc[("fc", "weight"), "norm"]
    # d(sum(x W^T + b))/dW is 3 in every entry (3 rows of ones): the norm is 3 * sqrt(8).
    assert weight == pytest.approx(3 * np.sqrt(8), rel=1e-6)
