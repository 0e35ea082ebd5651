"""The Hugging Face Trainer callback, on a tiny GPT-2 and a few random batches (no download)."""

from __future__ import annotations

import math
import re
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
    options = {"logging_steps": 1, **args}
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=2, num_train_epochs=1,
        learning_rate=1e-2, seed=0, dataloader_num_workers=0, **options)
    return transformers.Trainer(model=model, args=arguments, train_dataset=_data(),
                                callbacks=list(callbacks))


class BeforeClip(transformers.Trainer):
    """A Trainer that notes every gradient's norm, and their total, just before it clips."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.before: list[dict[str, float]] = []
        self.totals: list[float] = []

    def _clip_grad_norm(self, model):
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        self.before.append({n: float(torch.linalg.vector_norm(g)) for n, g in named})
        self.totals.append(float(torch.nn.utils.get_total_norm([g for _, g in named])))
        return super()._clip_grad_norm(model)


class AfterClip(transformers.TrainerCallback):
    """Reads torch's own ``p.grad`` where the optimizer is about to apply it."""

    def __init__(self) -> None:
        self.after: list[dict[str, float]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.after.append({n: float(torch.linalg.vector_norm(p.grad))
                           for n, p in model.named_parameters() if p.grad is not None})


def _rows(frame, step: int) -> dict[str, tuple[float, float]]:
    rows = frame[(frame["kind"] == "parameter") & (frame["step"] == step)]
    return {f"{la}.{t}": (n, c) for la, t, n, c in zip(
        rows["layer"], rows["tensor"], rows["norm"], rows["clipped_norm"], strict=True)}


def test_norms_are_the_pooled_gradients_before_the_clip_and_clipped_norm_after(
        tmp_path: Path) -> None:
    model = _model()
    after = AfterClip()
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, logging_steps=1, per_device_train_batch_size=2, num_train_epochs=1,
        learning_rate=1e-2, seed=0, gradient_accumulation_steps=2, max_grad_norm=0.5)
    trainer = BeforeClip(model=model, args=arguments, train_dataset=_data(),
                         callbacks=[after])
    callback = GradDebugCallback.attach(trainer)
    trainer.train()
    frame = callback.frame()
    # 8 examples, batches of 2, 2 micro-batches per optimizer step: 2 graddebug steps.
    assert sorted(frame["step"].unique()) == [0, 1]
    grad_norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    for step in (0, 1):
        rows = _rows(frame, step)
        assert set(rows) == set(trainer.before[step])
        for name, (norm, clipped) in rows.items():
            assert norm == pytest.approx(trainer.before[step][name], rel=1e-5), name
            assert clipped == pytest.approx(after.after[step][name], rel=1e-4), name
        # graddebug's total is the Trainer's own grad_norm, before the clip ...
        total = math.sqrt(sum(n * n for n, _ in rows.values()))
        assert total == pytest.approx(trainer.totals[step], rel=1e-5)
        assert total == pytest.approx(grad_norms[step], rel=1e-5)
        assert total > 0.5
        # ... and the clipped gradients are what the optimizer got.
        assert math.sqrt(sum(c * c for _, c in rows.values())) == pytest.approx(0.5, rel=1e-4)
    # The metrics of each logging interval, in an entry of their own at the logging step.
    logged = [e for e in trainer.state.log_history if "graddebug/grad_norm" in e]
    assert [e["step"] for e in logged] == [1, 2]
    assert logged[0]["graddebug/grad_norm"] == pytest.approx(trainer.totals[0], rel=1e-5)
    # Cleanup: no hook left on the model.
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_plain_callback_logs_to_log_history_at_the_logging_steps(tmp_path: Path) -> None:
    callback = GradDebugCallback(every=2)
    trainer = _trainer(_model(), tmp_path, [callback], max_steps=6, logging_steps=3)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "graddebug/grad_norm" in e]
    assert [e["step"] for e in logged] == [3, 6]
    assert sorted(callback.frame()["step"].unique()) == [0, 2, 4]
    # Each entry holds the latest value and the largest since the last log.
    frame = callback.frame()
    rows = frame[(frame["kind"] == "parameter") & (frame["layer"] == LATE)]
    by_step = rows.groupby("step")["norm"].apply(lambda s: math.sqrt((s ** 2).sum()))
    assert logged[0][f"graddebug/grad_norm/{LATE}"] == pytest.approx(by_step[2], rel=1e-6)
    assert logged[0][f"graddebug/grad_norm/{LATE}/max"] == pytest.approx(
        max(by_step[0], by_step[2]), rel=1e-6)
    assert logged[1][f"graddebug/grad_norm/{LATE}"] == pytest.approx(by_step[4], rel=1e-6)


_RUN = """
import json, sys, torch, transformers
from graddebug_torch.transformers import GradDebugCallback
mode, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                 bos_token_id=0, eos_token_id=0)
model = transformers.GPT2LMHeadModel(config)
g = torch.Generator().manual_seed(1)
data = [{"input_ids": r, "labels": r} for r in torch.randint(0, 50, (400, 8), generator=g)]
args = transformers.TrainingArguments(output_dir=out + ".dir", report_to=[], use_cpu=True,
    save_strategy="no", max_steps=100, logging_steps=10, per_device_train_batch_size=4, seed=0)
before = []
class Trainer(transformers.Trainer):
    def _clip_grad_norm(self, model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        before.append(float(torch.nn.utils.get_total_norm(grads)))
        return super()._clip_grad_norm(model)
trainer = Trainer(model=model, args=args, train_dataset=data)
if mode == "fault":
    model.transformer.h[1].mlp.c_fc.weight.register_hook(
        lambda grad: grad * 1e4 if trainer.state.global_step == 50 else grad)
    callback = GradDebugCallback.attach(trainer)
trainer.train()
result = {"log_history": trainer.state.log_history, "before": before}
if mode == "fault":
    frame = callback.frame()
    rows = frame[frame["kind"] == "parameter"]
    result["total"] = rows.groupby("step")["norm"].apply(
        lambda s: float((s ** 2).sum() ** 0.5)).tolist()
json.dump(result, open(out, "w"))
"""


def _not_bar(text: str) -> list[str]:
    """The console's lines, less the progress bar's redraws."""
    return [line for line in text.replace("\r", "\n").splitlines()
            if line.strip() and not re.search(r"\d+/\d+ \[", line)]


def test_default_args_progress_bar_a_quiet_console_and_one_notice(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_RUN)
    runs = {}
    for mode in ("plain", "fault"):
        out = tmp_path / f"{mode}.json"
        done = subprocess.run([sys.executable, str(script), mode, str(out)],
                              capture_output=True, text=True, timeout=600, check=True)
        runs[mode] = (done.stdout, done.stderr, json.loads(out.read_text()))
    plain_out, plain_err, _ = runs["plain"]
    out, err, fault = runs["fault"]
    # The console: the Trainer's own log lines, the same as without graddebug, and one notice.
    assert len(out) <= len(plain_out) + 10
    notices = [line for line in (out + err).splitlines() if "graddebug" in line]
    assert len(notices) == 1
    assert "step 50" in notices[0] and "transformer.h.1.mlp.c_fc" in notices[0]
    # The progress bar redraws on a clock (more often in a slower run): compare the rest.
    assert len(_not_bar(err)) <= len(_not_bar(plain_err)) + 1
    # The metrics reach log_history at the logging steps only.
    history = fault["log_history"]
    losses = [e["step"] for e in history if "loss" in e]
    assert losses == list(range(10, 101, 10))
    assert [e["step"] for e in history if "graddebug/grad_norm" in e] == losses
    # The total before the clip, against the Trainer's gradients just before it clipped, and
    # the explosion that the clip to max_grad_norm=1 hid from the optimizer shows.
    assert fault["total"] == pytest.approx(fault["before"], rel=1e-5)
    at_50 = next(e for e in history if e["step"] == 60 and "graddebug/grad_norm" in e)
    assert at_50["graddebug/grad_norm/max"] > 100 * at_50["graddebug/grad_norm"]
    assert at_50["graddebug/findings"] == 1


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
