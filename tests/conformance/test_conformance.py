"""The adapter conformance suite: every scenario of :mod:`scenarios` on every mode of
:mod:`modes`. An adapter is done when it passes it (docs: "Writing an adapter").

The test ids name the mode and the scenario: ``test_conformance[tf-function-cut]``. Keras on
the torch and JAX backends runs in one child process per backend, which runs every scenario of
its mode once and answers with each one's outcome; each outcome is still its own test here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from modes import BY_ID, MODES, Mode
from scenarios import SCENARIOS

from graddebug.adapter.capabilities import declared_options

HERE = Path(__file__).resolve().parent
MARK = "GD-CONFORMANCE "

CHILD = f"""
import json, sys, traceback, warnings
sys.path.insert(0, {str(HERE)!r})
from graddebug.errors import GradDebugWarning
from modes import BY_ID
from scenarios import SCENARIOS
warnings.simplefilter("error", GradDebugWarning)  # as pytest's filterwarnings does
mode = BY_ID[sys.argv[1]]
driver, out = mode.build(), {{}}
for name in sys.argv[2:]:
    try:
        SCENARIOS[name](driver)
        out[name] = ""
    except BaseException:
        out[name] = traceback.format_exc()
print({MARK!r} + json.dumps(out))
"""


def _missing(mode: Mode) -> str | None:
    for module in mode.needs:
        if importlib.util.find_spec(module) is None:
            return module
    return None


def _cases() -> list[Any]:
    cases = []
    for mode in MODES:
        for name in SCENARIOS:
            marks: list[Any] = [pytest.mark.slow] if mode.slow else []
            if name in mode.excluded:
                marks.append(pytest.mark.skip(reason=f"{mode.id}: {mode.excluded[name]}"))
            if name in mode.xfail:
                marks.append(pytest.mark.xfail(strict=True, reason=mode.xfail[name]))
            cases.append(pytest.param(mode.id, name, id=f"{mode.id}-{name}", marks=marks))
    return cases


@cache
def _driver(mode_id: str) -> Any:
    return BY_ID[mode_id].build()


@cache
def _child(mode_id: str) -> dict[str, str]:
    """Every runnable scenario of a Keras mode, in one child process on its backend."""
    mode = BY_ID[mode_id]
    names = [n for n in SCENARIOS if n not in mode.excluded]
    env = {**os.environ, "KERAS_BACKEND": str(mode.backend), "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_ENABLE_ONEDNN_OPTS": "0", "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CHILD, mode_id, *names], env=env,
                          capture_output=True, text=True, timeout=600, cwd=HERE)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MARK)]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len(MARK):])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("mode_id", "name"), _cases())
def test_conformance(mode_id: str, name: str) -> None:
    mode = BY_ID[mode_id]
    missing = _missing(mode)
    if missing is not None:
        pytest.skip(f"{mode_id} needs {missing}")
    if mode.backend is None:
        SCENARIOS[name](_driver(mode_id))
        return
    failure = _child(mode_id)[name]
    if failure:
        raise AssertionError(f"{mode_id}-{name}, in its child process:\n{failure}")


def test_every_mode_of_the_issue_is_in_the_table() -> None:
    assert [m.id for m in MODES] == [
        "torch", "tf-eager", "tf-function", "keras-fit-tf", "keras-fit-torch", "keras-fit-jax",
        "tf1-session", "jax-eager", "jax-jit", "toy"]
    for mode in MODES:
        assert set(mode.excluded) <= set(SCENARIOS), mode.id
        assert set(mode.xfail) <= set(SCENARIOS), mode.id
        assert all(reason.strip() for reason in (*mode.excluded.values(), *mode.xfail.values()))


NEEDS = {name: "intervene" for name in SCENARIOS if name.startswith("intervene-")}
"""The ``watch`` option each scenario relies on, where it relies on one."""

IN_PROCESS = [m for m in MODES if m.backend is None]


def _adapter_class(mode: Mode) -> type:
    driver = _driver(mode.id)
    run = driver.build()
    with driver.watch(run) as dbg:
        return type(dbg.adapter)


@pytest.mark.parametrize("mode", IN_PROCESS, ids=[m.id for m in IN_PROCESS])
def test_a_scenario_is_excluded_exactly_where_its_adapter_declares_no_option_for_it(
        mode: Mode) -> None:
    missing = _missing(mode)
    if missing is not None:
        pytest.skip(f"{mode.id} needs {missing}")
    declared = declared_options(_adapter_class(mode))
    assert declared is not None, f"{mode.id}: its adapter declares no watch_options"
    for name, option in NEEDS.items():
        assert (name in mode.excluded) == (option not in declared), (mode.id, name, option)


EXCLUDED = [pytest.param(m.id, n, id=f"{m.id}-{n}") for m in IN_PROCESS for n in m.excluded]


@pytest.mark.parametrize(("mode_id", "name"), EXCLUDED)
def test_an_excluded_scenario_does_fail_on_its_mode(mode_id: str, name: str) -> None:
    # An exclusion is a claim about the adapter: the day it holds no more, this test says so
    # and the scenario joins the suite.
    missing = _missing(BY_ID[mode_id])
    if missing is not None:
        pytest.skip(f"{mode_id} needs {missing}")
    with pytest.raises(AssertionError):
        SCENARIOS[name](_driver(mode_id))
