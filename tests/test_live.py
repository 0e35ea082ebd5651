"""Findings while a torch run records: the step's own findings on its StepResult, the loss
row, and what the Watcher keeps once the block has ended."""

from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

import graddebug  # noqa: E402
from graddebug.errors import ConfigError, WatcherStateError  # noqa: E402


def tanh_mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(5):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 4))


def train(model, steps: int, fault_at: int | None = None, every_result=None):
    """Adam on a fixed random problem; at ``fault_at`` the weight of ``model[4]`` (a Linear in
    the middle) is scaled by 1e-4 before the forward pass."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 32, generator=gen), torch.randint(0, 4, (256,), generator=gen)
    losses = []
    with graddebug.watch(model) as dbg:
        for step in range(steps):
            if step == fault_at:
                with torch.no_grad():
                    model[4].weight.mul_(1e-4)
            idx = torch.randint(0, 256, (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            result = dbg.step(loss=loss)
            losses.append(loss.item())
            if every_result is not None:
                every_result(step, result, dbg)
    return dbg, losses


def test_the_step_result_carries_the_findings_the_step_brought() -> None:
    seen: dict[int, list[str]] = {}

    def read(step, result, dbg) -> None:
        seen[step] = list(result.findings["issue"])

    dbg, _ = train(tanh_mlp(), 40, fault_at=30, every_result=read)
    assert all(not seen[s] for s in range(30)), {s: v for s, v in seen.items() if v}
    assert "vanishing" in seen[30]
    found = dbg.findings()
    first = found[found["step"] == 30]
    assert "4" in set(first["layer"])  # the scaled weight's layer


def test_findings_inside_the_block_are_those_so_far_and_kept_after_it() -> None:
    inside: dict[int, int] = {}

    def read(step, result, dbg) -> None:
        inside[step] = len(dbg.findings())

    dbg, _ = train(tanh_mlp(), 40, fault_at=30, every_result=read)
    assert max(inside[s] for s in range(30)) == 0
    assert inside[30] >= 1
    after = dbg.findings()
    assert len(after) >= inside[39]
    assert (after["step"] >= 30).all()


def test_the_loss_is_a_row_of_kind_loss_with_its_value() -> None:
    dbg, losses = train(tanh_mlp(), 6)
    frame = dbg.frame()
    rows = frame[frame["kind"] == "loss"]
    assert list(rows["step"]) == list(range(6))
    assert list(rows["layer"]) == ["loss"] * 6
    assert rows["mean"].tolist() == pytest.approx(losses, rel=1e-6)
    assert (rows["norm"] == rows["mean"].abs()).all()
    # the loss is no gradient: the summary of layers keeps it apart, no rule reads it as one
    assert dbg.findings().empty


def test_a_loss_known_after_the_close_is_recorded_for_that_step() -> None:
    model = tanh_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    with graddebug.watch(model, optimizer=opt) as dbg:
        for _ in range(3):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # closes the graddebug step
            dbg.record_loss(loss.item())
            dbg.record_loss(123.0)  # the step has one already: ignored
    rows = dbg.frame().query("kind == 'loss'")
    assert list(rows["step"]) == [0, 1, 2]
    assert 123.0 not in set(rows["mean"])


@pytest.mark.parametrize("bad", [torch.ones(3), "0.5", [1.0]])
def test_a_loss_that_is_not_one_number_is_a_config_error(bad) -> None:
    model = tanh_mlp()
    with graddebug.watch(model) as dbg:
        model(torch.randn(2, 32)).sum().backward()
        with pytest.raises(ConfigError, match="one number"):
            dbg.step(loss=bad)


def test_record_loss_outside_the_block_is_a_state_error() -> None:
    dbg = graddebug.watch(tanh_mlp())
    with pytest.raises(WatcherStateError):
        dbg.record_loss(1.0)


def test_a_nonfinite_loss_with_finite_gradients_names_the_loss() -> None:
    model = tanh_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    with graddebug.watch(model) as dbg:
        for step in range(12):
            out = model(x)
            loss = out.square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            # the reported loss divides by a count that is 0 at step 10; the gradients are
            # those of the well-defined mean
            count = 0 if step == 10 else 1
            dbg.step(loss=loss.item() / count if count else math.inf)
    found = dbg.findings()
    assert list(zip(found["step"], found["layer"], found["issue"], found["cause"],
                    strict=True)) == [(10, "loss", "nonfinite", "numerics")]


def test_a_bug_in_the_live_rules_fails_open(monkeypatch: pytest.MonkeyPatch) -> None:
    from graddebug.detectors.history import History

    def broken(self, rows):
        raise RuntimeError("boom")

    monkeypatch.setattr(History, "observe", broken)
    inside = {}

    def read(step, result, dbg) -> None:
        inside[step] = dbg.findings()

    with pytest.warns(graddebug.GradDebugWarning):
        dbg, losses = train(tanh_mlp(), 3, every_result=read)
    assert len(losses) == 3  # training went on
    assert "internal_error" in set(inside[2]["issue"])
    assert (dbg.frame()["kind"] == "loss").sum() == 3


class _Clock:
    """A clock the test moves: each step takes ``step`` seconds, each window diagnosis
    ``diagnosis`` seconds."""

    def __init__(self, step: float, diagnosis: float) -> None:
        self.now, self.step, self.diagnosis = 0.0, step, diagnosis
        self.diagnoses = 0

    def __call__(self) -> float:
        return self.now


def _window_runs(monkeypatch: pytest.MonkeyPatch, clock: _Clock, steps: int) -> list[int]:
    """The steps after which the window rules ran, in a loop that reads every step's
    findings on the clock ``clock``."""
    from graddebug.capture import live

    real = live.diagnose
    ran: list[int] = []

    def timed(records, *args, **kwargs):
        ran.append(int(records["step"].max()))  # the latest step of the window
        clock.now += clock.diagnosis
        return real(records, *args, **kwargs)

    monkeypatch.setattr(live, "_clock", clock)
    monkeypatch.setattr(live, "diagnose", timed)

    def read(step, result, dbg) -> None:
        result.findings  # noqa: B018 - reading it is what runs the rules when due
        clock.now += clock.step

    train(tanh_mlp(), steps, every_result=read)
    return ran


def test_the_window_rules_run_every_window_when_they_are_cheap(monkeypatch) -> None:
    # 1 s steps, diagnoses of no time: every history_window (20) steps.
    assert _window_runs(monkeypatch, _Clock(1.0, 0.0), 61) == [0, 20, 40, 60]


def test_the_window_rules_wait_while_they_would_cost_more_than_their_budget(
        monkeypatch) -> None:
    from graddebug.capture.live import WINDOW_BUDGET

    # 0.5 s steps, 0.1 s diagnoses: a run waits until 0.1 / budget seconds of steps have
    # passed since the last one ended, longer than history_window steps.
    clock = _Clock(0.5, 0.1)
    ran = _window_runs(monkeypatch, clock, 161)
    wait = 0.1 / WINDOW_BUDGET / 0.5  # steps
    assert wait > 20
    gaps = [b - a for a, b in itertools.pairwise(ran)]
    assert ran[0] == 0 and len(ran) >= 4, ran
    assert all(wait <= g <= wait + 1 for g in gaps), ran  # +1: the float sum of step times
