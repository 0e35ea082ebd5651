"""Faults that appear mid-training (tests/midtraining.py's injectors, on its references), each
reported within 3 steps of its onset, with the right cause and source, and nothing before.

Each run trains a reference with its realistic recipe (AdamW, warmup and cosine, clipping,
dropout) for ``AT`` steps, injects the fault before step ``AT``'s forward pass, and trains a
few steps more. The GPT runs and the Keras runs are slow; the torch CNN and MLP runs are not.
"""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

import midtraining as m
from graddebug import Thresholds

AT = 70
AFTER = 6  # steps trained after the onset
WITHIN = 3  # the finding must come by step AT + WITHIN


def _describe(found: pd.DataFrame) -> str:
    with pd.option_context("display.width", 250, "display.max_colwidth", 160):
        return found[["step", "layer", "tensor", "issue", "cause", "message"]].to_string()


def check(run: m.Run, fault: m.Injected, *, layer_prefix: bool = False,
          cause: str | None = None, within: int = WITHIN) -> pd.DataFrame:
    """The findings of a run with ``fault``: none before the onset, and one within
    ``within`` steps of it with the cause (``cause``, else the fault's) that names its source
    layer (no layer for a fault of no single layer). Returns the findings by then."""
    found = run.findings()
    assert (found["step"] >= fault.at).all(), _describe(found)
    near = found[found["step"] <= fault.at + within]
    source = "" if fault.source is None else fault.source
    if layer_prefix:
        names = near["layer"].str.startswith(source + ".") | (near["layer"] == source)
    else:
        names = near["layer"] == source
    want = cause or fault.cause
    hits = near[names & (near["cause"] == want)]
    assert len(hits), f"nothing names {source!r} with cause {want!r}:\n{_describe(found)}"
    return near


# A single NaN entry in a weight: the layer whose output turned NaN first, from a finite input,
# is an affine map, so its parameters hold the NaN (cause layer), whether or not the fixed 1%
# sample of the weights happens to hold that entry.
NAN_WEIGHT_CAUSE = "layer"


SLOW = pytest.mark.slow
TORCH = [
    pytest.param("tanh_mlp", m.nan_weight("fc2", AT), id="nan-weight"),
    pytest.param("cnn", m.inf_pixel(AT), id="inf-pixel-cnn"),
    pytest.param("tanh_mlp", m.inf_pixel(AT, layer="fc1"), id="inf-pixel-mlp"),
    pytest.param("tanh_mlp", m.mlp_weight_shrink(AT), id="weight-x1e-4"),
    pytest.param("cnn", m.conv_before_batchnorm(AT), id="conv-x1e4-before-bn"),
    pytest.param("tanh_mlp", m.tanh_saturate(AT), id="tanh-weight-x1e3"),
    pytest.param("cnn", m.dead_relu_bias(AT), id="bias-50-before-relu"),
    pytest.param("cnn", m.freeze_layer("conv2", AT), id="freeze-conv"),
    pytest.param("cnn", m.lr_boost(AT), id="lr-x1e4-cnn"),
    pytest.param("gpt", m.lr_boost(AT), id="lr-x1e4-gpt", marks=SLOW),
    pytest.param("gpt", m.gpt_fc_blowup(AT), id="pre-ln-fc-x1e4", marks=SLOW),
    pytest.param("gpt", m.nan_weight("blocks.1.mlp.fc", AT), id="nan-weight-gpt", marks=SLOW),
    pytest.param("gpt", m.detach_attention(AT), id="detach-in-attention", marks=SLOW),
    pytest.param("gpt", m.freeze_layer("blocks.2.mlp.fc", AT), id="freeze-gpt", marks=SLOW),
]


@pytest.mark.parametrize(("name", "fault"), TORCH)
def test_a_torch_fault_mid_run_is_reported_at_its_onset(name: str, fault: m.Injected) -> None:
    cause = NAN_WEIGHT_CAUSE if fault.name == "nan_weight" else None
    check(m.run_torch(name, AT + AFTER, fault=fault), fault, cause=cause)


@SLOW
def test_a_fully_masked_attention_row_names_the_attention_block_whose_code_made_it() -> None:
    # The softmax of an all -inf row is NaN inside blocks.1.attn, between its children: the
    # input of its attn_drop child held NaN although no recorded output before it did, so the
    # finding names the parent, not the child that first showed it.
    fault = m.masked_attention_row(AT)
    near = check(m.run_torch("gpt", AT + AFTER, fault=fault), fault)
    assert set(near["issue"]) == {"nonfinite"}
    assert set(near["layer"]) == {"blocks.1.attn"}, _describe(near)


@pytest.mark.parametrize(("name", "fault"), TORCH[:3])
def test_the_step_result_carries_the_finding_of_the_onset(name: str, fault: m.Injected
                                                          ) -> None:
    run = m.run_torch(name, AT + 2, fault=fault, findings_each_step=True)
    assert run.findings_by_step is not None
    assert all(f.empty for f in run.findings_by_step[:AT])
    assert not run.findings_by_step[AT].empty


KERAS = [
    pytest.param("tanh_mlp", m.mlp_weight_shrink(AT), id="weight-x1e-4"),
    pytest.param("cnn", m.conv_before_batchnorm(AT), id="conv-x1e4-before-bn"),
    pytest.param("tanh_mlp", m.tanh_saturate(AT), id="tanh-weight-x1e3"),
    pytest.param("cnn", m.dead_relu_bias(AT), id="bias-50-before-relu"),
    pytest.param("cnn", m.lr_boost(AT), id="lr-x1e4"),
    pytest.param("tanh_mlp", m.nan_weight("fc2", AT), id="nan-weight"),
]


@SLOW
@pytest.mark.parametrize("mode", ["fit", "tape"])
@pytest.mark.parametrize(("name", "fault"), KERAS)
def test_a_keras_fault_mid_run_is_reported_at_its_onset(name: str, fault: m.Injected,
                                                        mode: str) -> None:
    pytest.importorskip("tensorflow")
    cause = NAN_WEIGHT_CAUSE if fault.name == "nan_weight" else None
    check(m.run_keras(name, AT + AFTER, mode=mode, fault=fault), fault, cause=cause)


# Sustained shifts: a fault that never crosses the abrupt factors in one step. These runs stop
# at step AT + AFTER of a 500-step schedule (m.STEPS), where the learning rate is still near
# its peak: in a 76-step schedule the cosine falls 30x over the last 6 steps, and the spread
# of every ratio's window (6 robust deviations: 30x on the CNN's conv2) hides a 7x shift.
SUSTAIN = Thresholds().history_sustain_steps
SUSTAIN_FACTOR = Thresholds().history_sustain_factor


@SLOW
def test_one_layer_whose_learning_rate_falls_7x_is_reported_stalled_once_the_shift_lasts(
        ) -> None:
    # fc3's base_lr / 7 at AT: its update/weight ratio falls 7x (AdamW's step and its decay
    # both scale with the lr) and stays there while the other layers keep learning. 7x is
    # under history_factor (10): the abrupt rule must not fire; it is over
    # history_sustain_factor (6): the sustained rule fires on the shift's SUSTAIN-th step,
    # AT + SUSTAIN - 1, and no later. Measured net of the step's common move (the median
    # move of the sampled ratios): 7.96x on fc3, 6.18x on fc2, and under 5x on fc4 and on
    # the CNN's conv2 (three sampled ratios, whose median moves with the noise): a divide by
    # 7 is close to the sustained factor, so the test takes fc3, where the margin is 1.3x.
    fault = m.lr_divide("fc3", AT)
    run = m.run_torch("tanh_mlp", AT + AFTER, fault=fault, schedule=m.STEPS,
                      measure_updates=True)
    near = check(run, fault, within=SUSTAIN - 1)
    assert len(near) == 1, _describe(near)
    hit = near.iloc[0]
    # The lr of fc3's parameter group falls, its weight's and its bias's alike: since every
    # tensor carries the norms (graddebug.sampling.plan's floor), the event may name either.
    assert (hit["step"], hit["issue"], hit["layer"]) == (AT + SUSTAIN - 1, "stalled",
                                                         "fc3"), _describe(near)
    assert hit["tensor"] in ("weight", "bias"), _describe(near)
    # the sustained rule's threshold, not history_factor's: the abrupt rule did not fire
    assert hit["threshold"] == SUSTAIN_FACTOR, _describe(near)
    assert 5 <= hit["value"] < 10, _describe(near)
    # one event: nothing more while the shift lasts
    assert len(run.findings()) == 1, _describe(run.findings())
    # the harness's own measurement: fc3's update/weight ratio fell 5-10x and stayed there
    ratio = _exact_ratio(run, "fc3")
    before = ratio.loc[AT - 20:AT - 1].median()
    assert (before / ratio.loc[AT:AT + AFTER - 1] > 5).all()
    assert (before / ratio.loc[AT:AT + AFTER - 1] < 10).all()


def _exact_ratio(run: m.Run, layer: str) -> pd.Series:
    """``layer``'s update/weight ratio at each step, as the training loop measured it."""
    assert run.updates is not None
    rows = run.updates[(run.updates["layer"] == layer) & (run.updates["tensor"] == "weight")]
    return (rows["update_norm"] / rows["weight_norm"]).set_axis(rows["step"].to_numpy())


@SLOW
@pytest.mark.parametrize("framework", ["torch", "keras-fit", "keras-tape"])
def test_a_weight_shrunk_3x_a_step_for_3_steps_is_reported_as_a_layer_edit(framework: str
                                                                          ) -> None:
    # fc3's weight / 3 before steps AT, AT + 1 and AT + 2: 27x in all, never 10x in one
    # step. The source is fc3's weight, edited outside the optimizer (cause layer); what the
    # gradients show is measured in m.gradual_shrink. By the third edit plus the SUSTAIN
    # steps a sustained shift needs: AT + 2 + SUSTAIN - 1.
    fault = m.gradual_shrink("fc3", AT)
    if framework == "torch":
        run = m.run_torch("tanh_mlp", AT + AFTER, fault=fault, schedule=m.STEPS)
    else:
        pytest.importorskip("tensorflow")
        run = m.run_keras("tanh_mlp", AT + AFTER, mode=framework.split("-")[1], fault=fault,
                          schedule=m.STEPS)
    check(run, fault, within=2 + SUSTAIN - 1)
