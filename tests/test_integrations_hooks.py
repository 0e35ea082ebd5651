"""The ``graddebug_step_recorded`` and ``graddebug_run_finished`` hooks: what a wandb or MLflow
logger subscribes to."""

from __future__ import annotations

import pytest

import graddebug
from graddebug.errors import GradDebugInternalError, GradDebugWarning
from graddebug.plugins import new_plugin_manager

torch = pytest.importorskip("torch")


class Logger:
    """A third-party logger: keeps what each recorded step handed it."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.finished: list[object] = []

    @graddebug.hookimpl
    def graddebug_step_recorded(self, watcher, step, result):
        self.steps.append((step, {f"{r.layer}.{r.tensor}": r.norm for r in result.records}))

    @graddebug.hookimpl
    def graddebug_run_finished(self, watcher):
        self.finished.append(watcher)


class Broken:
    """A logger with a bug."""

    @graddebug.hookimpl
    def graddebug_step_recorded(self, watcher, step, result):
        raise RuntimeError("logger is down")


def _train(dbg: graddebug.Watcher, model: torch.nn.Module, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 3)).square().sum().backward()
        dbg.step()
        model.zero_grad()


def test_each_recorded_step_reaches_a_subscriber_once() -> None:
    pm, logger = new_plugin_manager(), Logger()
    pm.register(logger)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    with graddebug.watch(model, every=2, plugin_manager=pm) as dbg:
        _train(dbg, model, 5)
        assert logger.finished == []
    assert [step for step, _ in logger.steps] == [0, 2, 4]
    assert logger.finished == [dbg]
    # What the subscriber saw is what the Watcher recorded, and both equal autograd's.
    frame = dbg.frame()
    for step, norms in logger.steps:
        rows = frame[frame["step"] == step]
        assert norms == {f"{r.layer}.{r.tensor}": r.norm for r in rows.itertuples()}
    assert set(logger.steps[0][1]) >= {"0.weight", "2.output"}


def test_a_subscriber_bug_fails_open() -> None:
    pm = new_plugin_manager()
    pm.register(Broken())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with (pytest.warns(GradDebugWarning, match="logger is down"),
          graddebug.watch(model, plugin_manager=pm) as dbg):
        _train(dbg, model, 2)
    findings = dbg.findings()
    internal = findings[findings["issue"] == "internal_error"]
    assert list(internal["layer"]) == ["graddebug_step_recorded plugin"] * 2
    assert len(dbg.frame()) == 2 * 3  # the records were kept: output, weight, bias per step


def test_a_subscriber_bug_raises_under_strict() -> None:
    pm = new_plugin_manager()
    pm.register(Broken())
    model = torch.nn.Linear(3, 2)
    with (pytest.raises(GradDebugInternalError, match="logger is down"),
          graddebug.watch(model, plugin_manager=pm, strict=True) as dbg):
        _train(dbg, model, 1)
