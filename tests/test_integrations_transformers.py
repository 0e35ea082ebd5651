"""The Hugging Face Trainer callback, on a tiny GPT-2 and a few random batches (no download)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import graddebug  # noqa: E402
from graddebug.errors import ConfigError  # noqa: E402
from graddebug_torch.transformers import GradDebugCallback  # noqa: E402

pytestmark = pytest.mark.slow  # a Trainer takes seconds to start

EARLY = "transformer.h.0.attn.c_attn"
LATE = "transformer.h.1.mlp.c_proj"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _data(n: int = 8) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (n, 8), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(model: torch.nn.Module, tmp_path: Path, callbacks=(), **args) -> transformers.Trainer:
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, logging_steps=1, per_device_train_batch_size=2, num_train_epochs=1,
        learning_rate=1e-2, seed=0, dataloader_num_workers=0, **args)
    return transformers.Trainer(model=model, args=arguments, train_dataset=_data(),
                                callbacks=list(callbacks))


class Reference(transformers.TrainerCallback):
    """Reads torch's own ``p.grad`` where the optimizer is about to apply it."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.norms: list[dict[str, float]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = dict(model.named_parameters())
        self.norms.append({n: float(params[f"{n}.weight"].grad.norm()) for n in self.names})


def test_norms_are_the_pooled_gradients_the_optimizer_applies(tmp_path: Path) -> None:
    model = _model()
    reference = Reference((EARLY, LATE))
    trainer = _trainer(model, tmp_path, [reference], gradient_accumulation_steps=2)
    callback = GradDebugCallback.attach(trainer)
    trainer.train()
    frame = callback.frame()
    # 8 examples, batches of 2, 2 micro-batches per optimizer step: 2 graddebug steps.
    assert sorted(frame["step"].unique()) == [0, 1]
    params = frame[frame["kind"] == "parameter"]
    for step, expected in enumerate(reference.norms):
        for name, norm in expected.items():
            row = params[(params["step"] == step) & (params["layer"] == name)
                         & (params["tensor"] == "weight")]
            assert float(row["norm"].iloc[0]) == pytest.approx(norm, rel=1e-5)
    # The Trainer clipped them to max_grad_norm=1 before this event: the total is 1.
    grad_norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert min(grad_norms) > 1.0
    for step in (0, 1):
        total = math.sqrt((params[params["step"] == step]["norm"] ** 2).sum())
        assert total == pytest.approx(1.0, rel=1e-4)
    # The norms went through trainer.log, next to the Trainer's loss at the same step.
    logged = [e for e in trainer.state.log_history if f"graddebug/{LATE}.weight/norm" in e]
    assert [e["step"] for e in logged] == [1, 2]
    assert logged[0][f"graddebug/{LATE}.weight/norm"] == pytest.approx(
        reference.norms[0][LATE], rel=1e-5)
    assert any(e.get("step") == 1 and "loss" in e for e in trainer.state.log_history)
    assert f"graddebug/{EARLY}.output/norm" in logged[0]  # layer outputs too
    # Cleanup: no hook left on the model.
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_plain_callback_logs_to_log_history(tmp_path: Path) -> None:
    callback = GradDebugCallback(every=2)
    trainer = _trainer(_model(), tmp_path, [callback], max_steps=3)
    trainer.train()
    logged = [e["step"] for e in trainer.state.log_history
              if f"graddebug/{LATE}.weight/norm" in e]
    assert logged == [1, 3]  # recorded steps 0 and 2, at the Trainer's step after them
    assert sorted(callback.frame()["step"].unique()) == [0, 2]


def test_stops_on_nonfinite_and_names_the_layer(tmp_path: Path) -> None:
    model = _model()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = math.nan
    callback = GradDebugCallback(stop_on="nonfinite")
    trainer = _trainer(model, tmp_path, [callback], max_steps=4)
    trainer.train()
    assert trainer.state.global_step == 1
    assert callback.stop_reason is not None
    assert "graddebug stopped training at step 0" in callback.stop_reason
    assert "transformer.h.1.mlp.c_fc" in callback.stop_reason


def test_bound_callback_serves_the_with_block(tmp_path: Path) -> None:
    model = _model()
    with graddebug.watch(model) as dbg:
        trainer = _trainer(model, tmp_path, [GradDebugCallback.bound(dbg)], max_steps=2)
        trainer.train()
        assert dbg.active
    assert sorted(dbg.frame()["step"].unique()) == [0, 1]


def test_options_are_checked_early() -> None:
    with pytest.raises(ConfigError, match="stop_on='dead'"):
        GradDebugCallback(stop_on="dead")
    with pytest.raises(ConfigError, match="evry"):
        GradDebugCallback(evry=2)
    with pytest.raises(ConfigError, match="optimizer="):
        GradDebugCallback(optimizer=object())
