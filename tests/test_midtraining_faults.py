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

AT = 70
AFTER = 6  # steps trained after the onset
WITHIN = 3  # the finding must come by step AT + WITHIN


def _describe(found: pd.DataFrame) -> str:
    with pd.option_context("display.width", 250, "display.max_colwidth", 160):
        return found[["step", "layer", "tensor", "issue", "cause", "message"]].to_string()


def check(run: m.Run, fault: m.Injected, *, layer_prefix: bool = False,
          cause: str | None = None) -> pd.DataFrame:
    """The findings of a run with ``fault``: none before the onset, and one within
    ``WITHIN`` steps of it with the cause (``cause``, else the fault's) that names its source
    layer (no layer for a fault of no single layer). Returns the findings by then."""
    found = run.findings()
    assert (found["step"] >= fault.at).all(), _describe(found)
    near = found[found["step"] <= fault.at + WITHIN]
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
