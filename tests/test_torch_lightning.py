"""GradDebugCallback on a tiny Lightning Trainer (CPU) against plain torch.autograd.grad.

Lightning is imported by a fixture, not at collection: importing it takes seconds, so the whole
module is marked slow.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import graddebug  # noqa: E402

LR = 0.1
BATCH = 16


def data(n: int = 8 * BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g)


def net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.fixture(scope="module")
def lit() -> SimpleNamespace:
    """Lightning, the callback, and small classes built on them."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import Logger
    from torch.utils.data import DataLoader, TensorDataset

    from graddebug_torch.lightning import GradDebugCallback

    class Module(pl.LightningModule):
        def __init__(self, model: nn.Module, nan_at: int = -1, fail_at: int = -1) -> None:
            super().__init__()
            self.net = model
            self.nan_at, self.fail_at = nan_at, fail_at

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if batch_idx == self.fail_at:
                raise RuntimeError("the model broke")
            if batch_idx == self.nan_at:
                x = x * float("nan")
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class MemoryLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    class GradNorms(pl.Callback):
        """A plain reference: the norm of each p.grad where GradDebugCallback closes steps."""

        def __init__(self) -> None:
            self.seen: list[dict[str, float]] = []

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.seen.append({n: float(torch.linalg.vector_norm(p.grad.float()))
                              for n, p in module.named_parameters()})

    def trainer(callbacks: list[Any], max_steps: int, **kwargs: Any) -> Any:
        kwargs.setdefault("logger", False)
        kwargs.setdefault("log_every_n_steps", 1)
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps,
                          enable_progress_bar=False, enable_checkpointing=False,
                          enable_model_summary=False, num_sanity_val_steps=0,
                          callbacks=callbacks, **kwargs)

    def loader() -> DataLoader:
        return DataLoader(TensorDataset(*data()), batch_size=BATCH, shuffle=False)

    return SimpleNamespace(pl=pl, Callback=GradDebugCallback, Module=Module,
                           MemoryLogger=MemoryLogger, GradNorms=GradNorms, trainer=trainer,
                           loader=loader)


def reference(model: nn.Module, steps: int, accumulate: int = 1) -> list[dict[str, Any]]:
    """Plain training with torch.autograd.grad: per step, parameter-gradient norms and the
    gradient at the first layer's output (of the first micro-batch)."""
    x_all, y_all = data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    names, params = zip(*model.named_parameters(), strict=True)
    out = []
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        first_h = None
        for micro in range(accumulate):
            i = step * accumulate + micro
            x, y = x_all[i * BATCH:(i + 1) * BATCH], y_all[i * BATCH:(i + 1) * BATCH]
            h = model[0](x)
            loss = F.cross_entropy(model[2](model[1](h)), y) / accumulate
            grads = torch.autograd.grad(loss, [h, *params])
            first_h = grads[0] if first_h is None else first_h
            total = [t + g for t, g in zip(total, grads[1:], strict=True)]
        out.append({"params": {f"net.{n}": float(torch.linalg.vector_norm(g))
                               for n, g in zip(names, total, strict=True)},
                    "h": first_h})
        for p, g in zip(params, total, strict=True):
            p.grad = g
        opt.step()
    return out


@contextlib.contextmanager
def heard_notices() -> Iterator[list[str]]:
    """The lines the callback logs through Lightning's logger, while the block runs."""
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    notices = logging.getLogger("lightning.pytorch.callbacks.graddebug")
    notices.addHandler(handler)
    try:
        yield heard
    finally:
        notices.removeHandler(handler)


def param_norms(frame: Any, step: int) -> dict[str, float]:
    rows = frame[(frame["step"] == step) & (frame["kind"] == "parameter")]
    return {f"{la}.{t}": n for la, t, n in zip(rows["layer"], rows["tensor"], rows["norm"],
                                               strict=True)}


def assert_close(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)


def test_gradients_and_logged_norms_equal_autograd_grad_and_weights_equal_plain(lit) -> None:
    torch.manual_seed(0)
    model = net()
    ref_model = copy.deepcopy(model)
    expected = reference(ref_model, steps=4)
    callback = lit.Callback(keep=["net.0"])
    logger = lit.MemoryLogger()
    trainer = lit.trainer([callback], max_steps=4, logger=logger)
    trainer.fit(lit.Module(model), lit.loader())

    frame = callback.frame()
    assert sorted(frame["step"].unique()) == [0, 1, 2, 3]
    for step, ref in enumerate(expected):
        assert_close(param_norms(frame, step), ref["params"])
        np.testing.assert_allclose(callback.watcher.tensors(step)["net.0"], ref["h"].numpy(),
                                   rtol=1e-5, atol=1e-8)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)  # no observer effect

    logged = [(step, m) for step, m in logger.rows if any(k.startswith("graddebug/") for k in m)]
    assert [step for step, _ in logged] == [0, 1, 2, 3]
    for (_, metrics), ref in zip(logged, expected, strict=True):
        norms = ref["params"]
        assert metrics["graddebug/grad_norm/net.0"] == pytest.approx(
            math.hypot(norms["net.0.weight"], norms["net.0.bias"]), rel=1e-5)
        assert metrics["graddebug/grad_norm"] == pytest.approx(
            math.sqrt(sum(v * v for v in norms.values())), rel=1e-5)
        assert metrics["graddebug/findings"] == 0
        # Compact by default: one norm a layer, not one a tensor.
        assert not any(k.startswith("graddebug/norm/") for k in metrics)
    # Hooks are gone after fit; the frames stay.
    assert not callback.watcher.active
    assert all(not m._forward_hooks for m in model.modules())
    assert callback.findings().empty
    assert isinstance(callback.report(), graddebug.Report)


def test_every_thins_recording_and_logging(lit) -> None:
    torch.manual_seed(0)
    callback = lit.Callback(every=3)
    logger = lit.MemoryLogger()
    lit.trainer([callback], max_steps=7, logger=logger).fit(lit.Module(net()), lit.loader())
    assert sorted(callback.frame()["step"].unique()) == [0, 3, 6]
    assert callback.watcher.step_index == 7
    assert [s for s, m in logger.rows if "graddebug/grad_norm" in m] == [0, 3, 6]


def test_accumulated_batches_close_one_step_with_the_summed_gradient(lit) -> None:
    torch.manual_seed(0)
    model = net()
    expected = reference(copy.deepcopy(model), steps=2, accumulate=2)
    callback = lit.Callback()
    lit.trainer([callback], max_steps=2, accumulate_grad_batches=2).fit(
        lit.Module(model), lit.loader())
    assert callback.watcher.step_index == 2
    for step, ref in enumerate(expected):
        assert_close(param_norms(callback.frame(), step), ref["params"])


def test_under_amp_the_gradients_are_read_unscaled(lit) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    callback, plain = lit.Callback(), lit.GradNorms()
    trainer = lit.trainer([callback, plain], max_steps=3,
                          plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(lit.Module(net()), lit.loader())
    assert scaler.get_scale() >= 2.0**10  # the loss really was scaled
    assert len(plain.seen) == 3
    for step, ref in enumerate(plain.seen):
        assert_close(param_norms(callback.frame(), step), ref)


def test_stop_on_nonfinite_stops_at_the_step_and_names_the_layer(lit) -> None:
    torch.manual_seed(0)
    callback = lit.Callback(stop_on=("nonfinite",))
    trainer = lit.trainer([callback], max_steps=8)
    with heard_notices() as heard:
        trainer.fit(lit.Module(net(), nan_at=2), lit.loader())
    assert trainer.global_step == 3  # steps 0, 1 and the NaN step 2
    assert callback.stop_reason is not None
    assert callback.stop_reason.startswith("graddebug stopped training at step 2:")
    assert "'net.0'" in callback.stop_reason  # the NaN is born at the first layer's output
    lines = heard
    assert len(lines) == 1  # one notice: the finding and the stop, on one line
    assert lines[0].startswith("graddebug: step 2: nonfinite at net.0")
    assert "Training stops" in lines[0]
    # Without stop_on, the same run goes on to max_steps.
    torch.manual_seed(0)
    other = lit.Callback()
    trainer = lit.trainer([other], max_steps=8)
    trainer.fit(lit.Module(net(), nan_at=2), lit.loader())
    assert trainer.global_step == 8 and other.stop_reason is None


def test_an_exception_in_fit_detaches_and_keeps_the_frames(lit) -> None:
    torch.manual_seed(0)
    model = net()
    callback = lit.Callback()
    with pytest.raises(RuntimeError, match="the model broke"):
        lit.trainer([callback], max_steps=8).fit(lit.Module(model, fail_at=2), lit.loader())
    assert not callback.watcher.active
    assert all(not m._forward_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert sorted(callback.frame()["step"].unique()) == [0, 1]


def test_dbg_callback_serves_a_watcher_the_with_block_owns(lit) -> None:
    torch.manual_seed(0)
    model = net()
    module = lit.Module(model)
    expected = reference(copy.deepcopy(model), steps=3)
    with graddebug.watch(module, outputs=False) as dbg:
        callback = dbg.callback()
        assert isinstance(callback, lit.Callback)
        lit.trainer([callback], max_steps=3).fit(module, lit.loader())
        assert dbg.active  # fit's end leaves the Watcher to its with block
    assert callback.watcher is dbg
    assert set(dbg.frame()["kind"]) == {"parameter", "loss"}  # the callback passes the loss
    for step, ref in enumerate(expected):
        assert_close(param_norms(dbg.frame(), step), ref["params"])


def test_bad_options_raise_before_training(lit) -> None:
    with pytest.raises(graddebug.ConfigError, match="stop_on='vanishing' is not supported"):
        lit.Callback(stop_on="vanishing")
    with pytest.raises(graddebug.ConfigError, match="unknown option 'layer'"):
        lit.Callback(layer=["net.0"])
    with pytest.raises(graddebug.ConfigError, match="leave out optimizer="):
        lit.Callback(optimizer=object())
    with pytest.raises(graddebug.WatcherStateError, match=r"call trainer\.fit\(\) first"):
        lit.Callback().frame()


def test_gradient_clip_val_keeps_the_norms_before_the_clip_and_records_those_after(lit) -> None:
    class AfterClip(lit.pl.Callback):
        """The norm of each p.grad once Lightning clipped it (before zero_grad)."""

        def __init__(self) -> None:
            self.seen: list[dict[str, float]] = []

        def on_before_zero_grad(self, trainer: Any, module: Any, optimizer: Any) -> None:
            if all(p.grad is not None for p in module.parameters()):  # not before the first
                self.seen.append({n: float(torch.linalg.vector_norm(p.grad))
                                  for n, p in module.named_parameters()})

    torch.manual_seed(0)
    callback, before, after = lit.Callback(), lit.GradNorms(), AfterClip()
    trainer = lit.trainer([before, callback, after], max_steps=3, gradient_clip_val=0.05)
    trainer.fit(lit.Module(net()), lit.loader())
    frame = callback.frame()
    params = frame[frame["kind"] == "parameter"]
    # Lightning zeroes the gradients at the start of the next step: the last one is not seen.
    assert len(after.seen) >= 2
    for step in range(len(after.seen)):
        rows = params[params["step"] == step]
        pre = torch.nn.utils.get_total_norm(
            [torch.tensor(v) for v in before.seen[step].values()])
        assert float(pre) > 0.05  # the clip acted
        for layer, tensor, norm, clipped in zip(rows["layer"], rows["tensor"], rows["norm"],
                                                rows["clipped_norm"], strict=True):
            name = f"{layer}.{tensor}"
            assert norm == pytest.approx(before.seen[step][name], rel=1e-5)
            assert clipped == pytest.approx(after.seen[step][name], rel=1e-4)


@pytest.mark.slow
def test_default_logger_and_progress_bar_a_quiet_console_and_one_notice(lit, capfd,
                                                                        tmp_path) -> None:
    def fit(callbacks: list[Any], explode_at: int | None) -> tuple[str, Any]:
        torch.manual_seed(0)
        model = net()
        if explode_at is not None:
            model[2].weight.register_hook(
                lambda g: g * 1e4 if trainer.global_step == explode_at else g)
        trainer = lit.pl.Trainer(accelerator="cpu", devices=1, max_steps=100,
                                 default_root_dir=str(tmp_path), enable_checkpointing=False,
                                 log_every_n_steps=10, gradient_clip_val=1.0,
                                 callbacks=callbacks)
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(*data(n=400)), batch_size=4, shuffle=False)
        trainer.fit(lit.Module(model), loader)
        out, err = capfd.readouterr()
        return out + err, trainer

    plain, _ = fit([], None)
    callback = lit.Callback()
    with heard_notices() as heard:
        watched, _ = fit([callback], explode_at=50)
    # The console: the progress bar's lines and Lightning's own, plus one notice line.
    assert watched.count("\n") <= plain.count("\n") + 3
    assert len(heard) == 1 and "step 50" in heard[0] and "net.2" in heard[0]
    # The clip hid the explosion from the optimizer, not from graddebug.
    frame = callback.frame()
    rows = frame[(frame["kind"] == "parameter") & (frame["step"] == 50)]
    assert math.sqrt((rows["norm"] ** 2).sum()) > 100
    assert math.sqrt((rows["clipped_norm"] ** 2).sum()) == pytest.approx(1.0, rel=1e-4)
