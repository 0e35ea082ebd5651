"""The history rules (graddebug.detectors.history) on synthetic runs, framework-free: each
tensor against its own recent history, the update/weight ratio, dead units over a recent
window, and the loss. The same rows go through the live path (History, step by step) and the
replay of a frame (diagnose), which must agree."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from graddebug.config import Thresholds
from graddebug.detectors._steprows import StepRows
from graddebug.detectors.history import History
from graddebug.diagnosis import diagnose
from graddebug.errors import ConfigError
from graddebug.frames import event_frame, record_frame
from graddebug.records import Event, EventKind, Finding, Record, sums_record

LAYERS = ("fc0", "fc1", "fc2", "fc3", "head")
N = 64 * 64


def _row(step: int, layer: str, tensor: str, kind: str, depth: int, norm: float,
         weight: float = math.nan, update: float = math.nan, zero: float = math.nan,
         nan: bool = False) -> Record:
    return sums_record(step, layer, tensor, kind, depth, "(64, 64)", N, norm, 0.0, math.nan,
                       zero, nan, False, weight_norm=weight, update_norm=update)


def _loss(step: int, value: float) -> Record:
    return sums_record(step, "loss", "loss", "loss", -1, "()", 1, abs(value), value,
                       abs(value), math.nan, math.isnan(value), math.isinf(value))


def run(steps: int = 80, *, seed: int = 0, edit=None) -> list[list[Record]]:
    """A healthy run: per layer an output gradient and a weight, with step-to-step noise
    (about 1.3x), a slow decay over the run (100x), a warmup of the learning rate over the
    first 30 steps, and a loss that falls. ``edit(step, values)`` changes the step's values
    (a dict per layer of ``grad``, ``weight``, ``update``, and ``loss``) before the rows are
    built."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        decay = 100 ** (-step / steps)
        lr = min(1.0, step / 30)
        values = {layer: {"grad": decay * (d + 1) * math.exp(rng.normal(0, 0.25)),
                          "weight": 10.0 * (1 + 0.001 * step),
                          "update": 1e-2 * lr * math.exp(rng.normal(0, 0.25))}
                  for d, layer in enumerate(LAYERS)}
        values["loss"] = 2.0 * decay ** 0.3 * math.exp(rng.normal(0, 0.05))
        if edit is not None:
            edit(step, values)
        rows = []
        for d, layer in enumerate(LAYERS):
            v = values[layer]
            rows.append(_row(step, layer, "output", "activation", d, v["grad"],
                             zero=v.get("zero", math.nan)))
            rows.append(_row(step, layer, "weight", "parameter", d, v["grad"] * 3,
                             weight=v["weight"], update=v["update"]))
        rows.append(_loss(step, values["loss"]))
        out.append(rows)
    return out


def live(steps: list[list[Record]], thresholds: Thresholds | None = None,
         events: dict[int, list[Event]] | None = None) -> list[Finding]:
    history = History(thresholds or Thresholds())
    found = []
    for step, rows in enumerate(steps):
        found += history.observe(StepRows.from_records(step, rows, (events or {}).get(step, [])))
    return found


def replayed(steps: list[list[Record]], events: list[Event] = ()) -> list[Finding]:
    frame = diagnose(record_frame([r for rows in steps for r in rows]), event_frame(events),
                     Thresholds())
    return [Finding(*row) for row in frame.itertuples(index=False, name=None)]


def test_a_healthy_run_with_warmup_noise_and_decay_gives_no_finding() -> None:
    for seed in range(5):
        steps = run(300, seed=seed)
        assert live(steps) == []
        assert replayed(steps) == []


def test_a_collapse_of_one_layer_output_is_reported_at_its_step_naming_it() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 50:
            values["fc2"]["grad"] *= 1e-3

    steps = run(edit=edit)
    found = live(steps)
    assert len(found) == 1
    f = found[0]
    assert (f.step, f.layer, f.tensor, f.issue, f.cause) == (50, "fc2", "output", "vanishing",
                                                            "layer")
    assert "fell" in f.message and "at step 50" in f.message


    def move(layer: str) -> float:  # log10 of step 50 against the median of the 20 before it
        logs = np.log10([r.norm for rows in steps for r in rows
                         if (r.layer, r.tensor) == (layer, "output")])
        return logs[50] - np.median(logs[30:50])

    # net of what the gradient next to the loss (the head's output) did at that step
    assert f.value == pytest.approx(10 ** abs(move("fc2") - move("head")), rel=1e-9)


def test_the_first_tensor_in_backward_order_is_named_and_the_others_counted() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 45:  # fc3's backward scaled up: fc3 and everything below it jump
            for layer in ("fc0", "fc1", "fc2", "fc3"):
                values[layer]["grad"] *= 1e3

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.issue) for f in found] == [(45, "fc3", "exploding")]
    assert "7 other tensor(s)" in found[0].message


def test_a_weight_edited_outside_the_optimizer_is_the_source() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 40:  # fc1's weight x1e4 in front of a normalisation: its gradient falls
            values["fc1"]["weight"] *= 1e4
            values["fc1"]["grad"] *= 1e-4
            values["fc1"]["update"] *= 1.0  # Adam's update keeps its size: the ratio falls

    found = live(run(edit=edit))
    assert len(found) == 1
    f = found[0]
    assert (f.step, f.layer, f.tensor, f.issue, f.cause) == (40, "fc1", "weight", "stalled",
                                                            "layer")
    assert "outside the optimizer" in f.message


def test_every_update_jumping_at_once_is_one_global_finding() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 50:
            for layer in LAYERS:
                values[layer]["update"] *= 1e4
        if step >= 51:  # the ruined weights make every gradient jump at the next step
            for layer in LAYERS:
                values[layer]["grad"] *= 1e2

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.issue, f.cause) for f in found] == [
        (50, "", "update_too_large", "optimizer")]


def test_a_layer_the_optimizer_stopped_moving_is_stalled() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 60:
            values["fc2"]["update"] = 0.0

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.tensor, f.issue, f.cause) for f in found] == [
        (60, "fc2", "weight", "stalled", "optimizer")]


def test_a_zero_update_everywhere_at_the_start_of_a_warmup_is_no_finding() -> None:
    def edit(step: int, values: dict) -> None:
        if step == 0:
            for layer in LAYERS:
                values[layer]["update"] = 0.0

    assert live(run(edit=edit)) == []


def test_a_loss_spike_with_no_tensor_moving_comes_from_the_data() -> None:
    def edit(step: int, values: dict) -> None:
        if step == 60:
            values["loss"] *= 20

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.issue, f.cause) for f in found] == [
        (60, "loss", "loss_spike", "data")]


def test_a_loss_spike_after_an_event_names_its_source() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 60:
            values["fc3"]["grad"] *= 1e3
        if step == 61:
            values["loss"] *= 20

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.issue) for f in found] == [(60, "fc3", "exploding"),
                                                          (61, "fc3", "loss_spike")]
    assert found[1].cause == "layer"


def test_a_nonfinite_loss_with_finite_gradients_names_the_loss() -> None:
    def edit(step: int, values: dict) -> None:
        if step == 30:
            values["loss"] = math.inf

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.issue, f.cause) for f in found] == [
        (30, "loss", "nonfinite", "numerics")]


def test_a_nan_step_is_left_out_and_does_not_poison_the_baselines() -> None:
    steps = run()
    steps[40] = [r._replace(norm=math.nan, nan=True) if r.layer == "fc1" else r
                 for r in steps[40]]
    assert live(steps) == []


def test_steps_a_loss_scaler_skipped_are_left_out() -> None:
    def edit(step: int, values: dict) -> None:
        if step == 50:
            for layer in LAYERS:
                values[layer]["grad"] *= 1e5

    skipped = {50: [Event(50, "", "", -1, EventKind.SKIPPED_STEP.value, "scale=65536.0")]}
    assert live(run(edit=edit), events=skipped) == []


def test_units_that_die_mid_run_are_dead_two_steps_later_naming_the_deepest() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 50:  # fc2's units die: no gradient reaches fc2 or anything below it
            for layer in ("fc0", "fc1", "fc2"):
                values[layer]["grad"] = 0.0

    found = [f for f in live(run(edit=edit)) if f.issue == "dead"]
    assert [(f.step, f.layer, f.cause) for f in found] == [(51, "fc2", "layer")]
    assert "2 layer(s) below it" in found[0].message


def test_the_replay_of_a_frame_gives_what_the_live_rules_gave() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 40:
            values["fc1"]["weight"] *= 1e4
            values["fc1"]["grad"] *= 1e-4
        if step == 70:
            values["loss"] *= 30

    steps = run(edit=edit)
    online = live(steps)
    assert len(online) == 2
    history = {(f.step, f.layer, f.tensor, f.issue, f.cause) for f in online}
    assert history <= {(f.step, f.layer, f.tensor, f.issue, f.cause) for f in replayed(steps)}


def test_slow_drift_over_orders_of_magnitude_never_fires() -> None:
    def edit(step: int, values: dict) -> None:
        for d, layer in enumerate(LAYERS):  # 1e5 over 400 steps: 3% a step
            values[layer]["grad"] *= 10 ** (-5 * step / 400) * (d + 1)

    assert live(run(400, edit=edit)) == []


@pytest.mark.parametrize("changes", [{"history_window": 2.5}, {"history_numel": 16.0},
                                     {"loss_sigma": -1.0}, {"history_factor": 0}])
def test_unusable_history_thresholds_are_refused(changes: dict) -> None:
    with pytest.raises(ConfigError):
        Thresholds().replace(**changes)


def test_weights_that_jump_together_with_no_update_known_are_one_global_finding() -> None:
    def edit(step: int, values: dict) -> None:
        for layer in LAYERS:
            values[layer]["update"] = math.nan  # a tape loop: no optimizer view
            if step >= 50:  # a learning rate x1e4 moves every weight far
                values[layer]["weight"] *= 100

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.issue, f.cause) for f in found] == [
        (50, "", "update_too_large", "optimizer")]


# -- sustained shifts ---------------------------------------------------------------------------


def flat(steps: int, fall: dict[int, float], *, update: str = "") -> list[list[Record]]:
    """A noise-free run: every gradient 1.0 and every update/weight ratio 1e-3, but fc2's
    gradient (output and weight) divided by ``fall[step]`` from each step in ``fall`` on, or,
    where ``update`` names a layer, that layer's update instead."""
    out, factor = [], 1.0
    for step in range(steps):
        factor = fall.get(step, factor)
        grad = {layer: 1.0 / factor if layer == "fc2" and not update else 1.0
                for layer in LAYERS}
        out.append([row for d, layer in enumerate(LAYERS) for row in (
            _row(step, layer, "output", "activation", d, grad[layer]),
            _row(step, layer, "weight", "parameter", d, grad[layer], weight=1.0,
                 update=1e-3 / factor if layer == update else 1e-3))])
    return out


def test_a_gradient_that_falls_70x_over_two_steps_and_stays_is_one_sustained_vanishing() -> None:
    def edit(step: int, values: dict) -> None:
        if step == 50:
            values["fc2"]["grad"] *= 0.3
        if step >= 51:  # 70x below: under the 100x of an abrupt change, over the 50x
            values["fc2"]["grad"] /= 70

    steps = run(edit=edit)
    found = live(steps)
    assert [(f.step, f.layer, f.tensor, f.issue, f.cause) for f in found] == [
        (53, "fc2", "output", "vanishing", "layer")]
    assert "has stayed" in found[0].message and "before step 51 for 3 steps" in found[0].message
    assert found[0].threshold == Thresholds().history_sustain_grad_factor
    assert {(f.step, f.layer, f.issue) for f in found} <= {
        (f.step, f.layer, f.issue) for f in replayed(steps)}


def test_one_layers_update_ratio_falling_7x_while_the_others_learn_is_stalled() -> None:
    # its learning rate divided by 7 at step 40: under the 10x of an abrupt change
    found = live(flat(80, {40: 7.0}, update="fc1"))
    assert [(f.step, f.layer, f.tensor, f.issue, f.cause) for f in found] == [
        (42, "fc1", "weight", "stalled", "optimizer")]
    assert "update/weight ratio" in found[0].message
    assert "has stayed 7x below its median of the 20 steps before step 40 for 3 steps" \
        in found[0].message


def test_slow_drift_of_an_update_ratio_by_1000x_over_500_steps_never_fires() -> None:
    def edit(step: int, values: dict) -> None:
        values["fc1"]["update"] *= 10 ** (-3 * step / 500)
        values["fc3"]["grad"] *= 10 ** (3 * step / 500)

    assert live(run(500, edit=edit)) == []


def test_a_sawtooth_below_the_abrupt_factor_is_no_sustained_shift() -> None:
    def edit(step: int, values: dict) -> None:
        if step >= 40 and step % 2:  # 30x down every other step: never three in a row
            values["fc2"]["grad"] /= 30

    assert live(run(edit=edit)) == []


@pytest.mark.parametrize(("factor", "fires"), [(10.0, True), (9.9, False)])
def test_a_shift_exactly_at_the_sustained_factor_fires_and_one_just_under_does_not(
        factor: float, fires: bool) -> None:
    # log10(1/10) is exactly -1: the move equals log10 of the threshold to the last bit
    thresholds = Thresholds(history_sustain_grad_factor=10.0)
    found = live(flat(60, {30: factor}), thresholds)
    expected = [(32, "fc2", "output", "vanishing")] if fires else []
    assert [(f.step, f.layer, f.tensor, f.issue) for f in found] == expected


def _with_and_without_quiet_steps(steps: list[list[Record]],
                                  monkeypatch: pytest.MonkeyPatch) -> list[Finding]:
    """The live findings of ``steps``, checked equal to those of the full rules alone (the
    quiet step path switched off); both paths must have run many times."""
    taken = []
    quiet = History._quiet

    def counted(self: History, rows: StepRows) -> bool:
        taken.append(quiet(self, rows))
        return taken[-1]

    monkeypatch.setattr(History, "_quiet", counted)
    found = live(steps)
    assert 100 < sum(taken) < len(taken) - 50
    monkeypatch.setattr(History, "_quiet", lambda self, rows: False)
    assert found == live(steps) and len(found) > 10
    return found


def test_the_quiet_step_path_gives_the_full_rules_findings_near_every_threshold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Moves on both sides of what a quiet step allows (half the smaller factor: 7.07x for
    # gradients, 2.45x for update/weight ratios) and of every threshold, one every 4 steps.
    moves = [("grad", f) for f in (0.01, 0.05, 0.13, 0.15, 0.2, 5.0, 7.0, 7.2, 60.0, 120.0)] \
        + [("update", f) for f in (0.1, 0.3, 0.45, 2.4, 2.5, 7.0, 12.0, 1e-9)] \
        + [("weight", f) for f in (0.09, 1.5, 11.0)] + [("zero", f) for f in (0.69, 0.71)]
    rng = np.random.default_rng(0)
    picks = {step: (moves[int(rng.integers(len(moves)))], LAYERS[int(rng.integers(5))])
             for step in range(30, 400, 4)}

    def edit(step: int, values: dict) -> None:
        for layer in LAYERS if step % 5 == 0 else ():  # fractions measured at some steps
            values[layer]["zero"] = 0.2
        if step in picks:
            (what, factor), layer = picks[step]
            values[layer][what] = factor if what == "zero" else values[layer][what] * factor

    steps = run(400, edit=edit)
    found = _with_and_without_quiet_steps(steps, monkeypatch)
    # the moves past the factors are reported, by every rule that judges a series
    assert {f.issue for f in found} == {"exploding", "vanishing", "stalled", "update_too_large"}


@pytest.mark.parametrize("scale", [1.0, 1e-4])
def test_the_quiet_step_path_agrees_where_some_tensors_have_no_series(
        scale: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rows a real model gives beside its large tensors, on every step: a bias of 10
    # entries (under history_numel), a parameter whose weight and update were not sampled
    # (NaN), and layer outputs whose zero fraction is measured on some steps only; with
    # every update scaled down 1e4 (update/weight ratios near 1e-7, where no layer counts as
    # learning for the stall floor), also one whose update rounds to 0 (a conv's bias before
    # a batch norm, trained by SGD at a small learning rate). Plus moves on both sides of
    # every threshold, one every 4 steps, as in the test above.
    moves = [("grad", f) for f in (0.01, 0.13, 0.2, 7.0, 7.2, 60.0, 120.0)] \
        + [("update", f) for f in (0.1, 0.45, 2.4, 2.5, 7.0, 12.0, 1e-9)] \
        + [("weight", f) for f in (0.09, 1.5, 11.0)] + [("zero", f) for f in (0.69, 0.71)]
    rng = np.random.default_rng(1)
    picks = {step: (moves[int(rng.integers(len(moves)))], LAYERS[int(rng.integers(5))])
             for step in range(30, 400, 4)}

    def edit(step: int, values: dict) -> None:
        values["head"]["zero"] = 0.1  # a small output: measured on every step
        for layer in LAYERS[:2] if step % 5 == 0 else ():
            values[layer]["zero"] = 0.2 if step < 360 or layer != "fc0" else 0.8  # it dies
        for layer in LAYERS:
            values[layer]["update"] *= scale
        if step in picks:
            (what, factor), layer = picks[step]
            values[layer][what] = factor if what == "zero" else values[layer][what] * factor

    steps = run(400, edit=edit)
    for step, rows in enumerate(steps):
        grad = 0.01 * (1 + 0.2 * math.sin(step))
        rows += [
            sums_record(step, "head", "bias", "parameter", 4, "(10,)", 10, grad, 0.0,
                        math.nan, math.nan, False, False, weight_norm=1.0,
                        update_norm=1e-3 * scale),
            sums_record(step, "fc1", "bias", "parameter", 1, "(64,)", 64, grad, 0.0,
                        math.nan, math.nan, False, False),
        ]
        if scale < 1:
            rows.append(sums_record(step, "fc2", "bias", "parameter", 2, "(64,)", 64,
                                    grad * 1e-6, 0.0, math.nan, math.nan, False, False,
                                    weight_norm=0.5, update_norm=0.0))
    found = _with_and_without_quiet_steps(steps, monkeypatch)
    # fc0's units die at its measured steps 360 and 365, four unmeasured steps apart
    assert ("fc0", "dead", 365) in {(f.layer, f.issue, f.step) for f in found}


# -- weights edited over several steps --------------------------------------------------------


@pytest.mark.parametrize("updates", [True, False])
def test_a_weight_divided_by_3_at_three_steps_is_an_edit_over_those_steps(updates: bool
                                                                         ) -> None:
    # 27x in all, never 10x from one step to the next. With the updates known (Adam-like:
    # they keep their size) the update/weight ratio climbs 3x a step, and the run's noise
    # takes it past the abrupt factor at 51, where the weight's own move (9x over two steps)
    # explains it; without them (a loop that hands over gradients only) the weight's 27x
    # over the three steps is reported at 52.
    def edit(step: int, values: dict) -> None:
        if step >= 50:
            values["fc2"]["weight"] /= 3 ** min(step - 49, 3)
        if not updates:
            for layer in LAYERS:
                values[layer]["update"] = math.nan

    found = live(run(edit=edit))
    step, moved = (51, r"8\.9\d") if updates else (52, r"26\.\d")
    assert [(f.step, f.layer, f.tensor, f.cause) for f in found] == [
        (step, "fc2", "weight", "layer")]
    assert re.search(rf"shrank {moved}x over the \d recorded steps up to step {step}",
                     found[0].message), found[0].message


def test_a_ratio_that_jumps_because_its_weight_shrank_names_the_weight_not_the_optimizer(
        ) -> None:
    # the weight / 3 at steps 50 and 51 (9x, never 10x a step), the update 1.5x larger at 51:
    # the ratio jumps 13.5x at 51, past the abrupt factor, but the weight explains most of it
    def edit(step: int, values: dict) -> None:
        if step >= 50:
            values["fc2"]["weight"] /= 3 ** min(step - 49, 2)
        if step == 51:
            values["fc2"]["update"] *= 1.5

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.tensor, f.cause) for f in found] == [
        (51, "fc2", "weight", "layer")]
    assert re.search(r"shrank 8\.9\dx over the \d recorded steps up to step 51",
                     found[0].message)


def test_one_layers_update_that_jumps_with_its_weight_still_is_the_optimizer() -> None:
    # its learning rate x20 at step 50: the ratio jumps 20x, the weight moves by a few percent
    def edit(step: int, values: dict) -> None:
        if step >= 50:
            values["fc2"]["update"] *= 20
            values["fc2"]["weight"] *= 1.05

    found = live(run(edit=edit))
    assert [(f.step, f.layer, f.issue, f.cause) for f in found] == [
        (50, "fc2", "update_too_large", "optimizer")]


def test_weights_that_grow_1_5x_a_step_for_three_steps_are_no_edit() -> None:
    # 3.4x in three steps: the most a healthy weight norm moves (1.5x a step, measured)
    def edit(step: int, values: dict) -> None:
        if step >= 50:
            values["fc2"]["weight"] *= 1.5 ** min(step - 49, 3)

    assert [f for f in live(run(edit=edit)) if f.layer == "fc2" and f.cause == "layer"] == []
