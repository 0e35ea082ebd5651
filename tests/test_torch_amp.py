"""Mixed precision in a plain torch loop: watch(model, scaler=GradScaler).

References are computed independently, on a copy of the model trained in lockstep without a
scaler: torch.autograd.grad of the unscaled loss with respect to every layer output and
parameter. A power-of-two loss scale is exact in floating point, so the copy stays bitwise equal
to the scaled model and its gradients equal the scaled ones divided by the scale.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import graddebug  # noqa: E402
from graddebug.errors import ConfigError  # noqa: E402

STATS = ("norm", "mean", "std", "absmax")


def net() -> nn.Sequential:
    # Layer 0's output gradient (48x96) and layer 2's weight (64x96) are reduced in their
    # hooks; the others are staged and reduced when the step closes.
    return nn.Sequential(nn.Linear(16, 96), nn.ReLU(), nn.Linear(96, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(48, 16, generator=g), torch.randint(0, 4, (48,), generator=g)


def stats(g: torch.Tensor) -> dict[str, float]:
    g = g.detach().double()
    return {"norm": float(g.norm()), "mean": float(g.mean()),
            "std": float(g.std(unbiased=False)), "absmax": float(g.abs().max())}


class Reference:
    """A copy of the model trained without a scaler; its gradients come from autograd.grad."""

    def __init__(self, model: nn.Module) -> None:
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.seen: list[dict[str, dict[str, float]]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, factor: float = 1.0,
             skip: bool = False) -> None:
        outputs: dict[str, torch.Tensor] = {}
        handles = [m.register_forward_hook(
            lambda mod, args, out, name=name: outputs.__setitem__(name, out))
            for name, m in self.model.named_modules() if name]
        loss = F.cross_entropy(self.model(x), y) * factor
        for h in handles:
            h.remove()
        params = dict(self.model.named_parameters())
        grads = torch.autograd.grad(loss, [*outputs.values(), *params.values()])
        named = dict(zip([*outputs, *params], grads, strict=True))
        self.seen.append({name: stats(g) for name, g in named.items()})
        if not skip:
            for p, g in zip(params.values(), grads[len(outputs):], strict=True):
                p.grad = g
            self.opt.step()


def rows(dbg: Any, step: int) -> dict[str, dict[str, float]]:
    frame = dbg.frame()
    frame = frame[frame["step"] == step]
    out = {}
    for r in frame.itertuples():
        name = r.layer if r.kind == "activation" else f"{r.layer}.{r.tensor}"
        out[name] = {s: getattr(r, s) for s in STATS}
    return out


def assert_stats(got: dict[str, dict[str, float]], expected: dict[str, dict[str, float]],
                 rtol: float, atol: float = 0.0) -> None:
    assert set(got) == set(expected)
    for name, values in expected.items():
        for stat, value in values.items():
            np.testing.assert_allclose(got[name][stat], value, rtol=rtol, atol=atol,
                                       err_msg=f"{name} {stat}")


def skipped(dbg: Any) -> dict[int, str]:
    events = dbg.events()
    events = events[events["event"] == "skipped_step"]
    assert (events["layer"] == "").all() and (events["tensor"] == "").all()
    assert (events["depth"] == -1).all()
    assert not events["step"].duplicated().any()  # one event per skipped step
    return dict(zip(events["step"].astype(int), events["detail"], strict=True))


# -- the statistics are those of the unscaled gradients -------------------------------------

Loop = Callable[[Any, Any, Any, Any], None]


def close_before_unscaling(dbg: Any, scaler: Any, opt: Any, loss: Any) -> None:
    scaler.scale(loss).backward()
    dbg.step()
    scaler.step(opt)
    scaler.update()


def close_after_unscale_(dbg: Any, scaler: Any, opt: Any, loss: Any) -> None:
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # the gradient-clipping recipe
    dbg.step()
    scaler.step(opt)
    scaler.update()


def close_after_update(dbg: Any, scaler: Any, opt: Any, loss: Any) -> None:
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    dbg.step()


def close_by_optimizer(dbg: Any, scaler: Any, opt: Any, loss: Any) -> None:
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


LOOPS: dict[str, Loop] = {
    "dbg.step before scaler.step": close_before_unscaling,
    "dbg.step after unscale_": close_after_unscale_,
    "dbg.step after update": close_after_update,
    "optimizer=": close_by_optimizer,
}


@pytest.mark.parametrize("order", LOOPS)
def test_statistics_equal_those_of_the_unscaled_run(order: str) -> None:
    torch.manual_seed(0)
    model = net()
    ref = Reference(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # The scale grows at every update, so a scale read before or after the wrong update is off.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    extra = {"optimizer": opt} if order == "optimizer=" else {}
    with graddebug.watch(model, scaler=scaler, param_stats="full", full_stats_every=1,
                         **extra) as dbg:
        for step in range(3):
            x, y = batch(step)
            ref.step(x, y)
            opt.zero_grad()
            LOOPS[order](dbg, scaler, opt, F.cross_entropy(model(x), y))
    assert scaler.get_scale() == 2.0**13  # it scaled, and never skipped
    assert dbg.step_index == 3
    assert set(dbg.frame()["kind"]) == {"activation", "parameter"}
    for step, expected in enumerate(ref.seen):
        assert_stats(rows(dbg, step), expected, rtol=1e-5, atol=1e-9)
    assert skipped(dbg) == {}
    for p, q in zip(model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_kept_gradients_are_unscaled_too() -> None:
    torch.manual_seed(0)
    model = net()
    ref = Reference(model)
    x, y = batch(0)
    outputs: dict[str, torch.Tensor] = {}
    handle = ref.model[2].register_forward_hook(lambda m, a, o: outputs.setdefault("2", o))
    expected = torch.autograd.grad(F.cross_entropy(ref.model(x), y),
                                   [outputs["2"], ref.model[2].weight])
    handle.remove()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    with graddebug.watch(model, scaler=scaler, keep=["2"]) as dbg:
        close_after_update(dbg, scaler, opt, F.cross_entropy(model(x), y))
    kept = dbg.tensors(0)
    np.testing.assert_allclose(kept["2"], expected[0].numpy(), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(kept["2.weight"], expected[1].numpy(), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("order", ["dbg.step before scaler.step", "dbg.step after update"])
def test_finite_gradients_of_a_skipped_step_are_unscaled(order: str, fused: bool) -> None:
    # A fused optimizer divides its gradients inside step(), unless the step is skipped; the
    # others are divided by unscale_ whether skipped or not.
    x = torch.linspace(-1.0, 1.0, 5000)
    a = torch.ones(3, requires_grad=True)
    b = torch.zeros(5000, requires_grad=True)
    opt = torch.optim.Adam([a, b], lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with graddebug.watch(params={"a": a, "b": b}, scaler=scaler) as dbg:
        for huge in (1.0, 1e38, 1.0):
            opt.zero_grad()
            LOOPS[order](dbg, scaler, opt, (a * huge).sum() + (b * x).sum())
    frame = dbg.frame().set_index(["step", "layer"])
    assert skipped(dbg) == {1: "scale=1024.0"}
    for step in range(3):
        np.testing.assert_allclose(frame.loc[(step, "b"), "norm"], float(x.norm()), rtol=1e-6)
    assert frame.loc[(0, "a"), "norm"] == pytest.approx(math.sqrt(3))
    assert frame.loc[(1, "a"), "inf"]


TO_HOST = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize("order", ["dbg.step after update", "optimizer="])
def test_the_scale_costs_no_host_sync(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call that brings tensor values to the host is counted; a watched iteration
    makes one more than the plain one (the step's statistics), and none when every= skips."""
    count = [0]

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return original(self, *args, **kwargs)
        return counted

    for name in TO_HOST:
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))

    def run(watched: bool) -> list[int]:
        torch.manual_seed(0)
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        extra = {"optimizer": opt} if order == "optimizer=" else {}
        seen = []
        with contextlib.ExitStack() as stack:
            dbg = stack.enter_context(graddebug.watch(model, scaler=scaler, every=2, **extra)
                                      ) if watched else None
            for step in range(4):
                x, y = batch(step)
                count[0] = 0
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                LOOPS[order if watched else "optimizer="](dbg, scaler, opt, loss)
                seen.append(count[0])
        return seen

    plain, watched = run(False), run(True)
    assert [w - p for w, p in zip(watched, plain, strict=True)] == [1, 0, 1, 0]


# -- skipped steps ----------------------------------------------------------------------------

def fp16_run(watch: dict[str, Any] | None, steps: int = 4) -> tuple[Any, nn.Module, list[float],
                                                                  list[bool]]:
    """Train ``net()`` under float16 autocast from the default scale of 65536, at which the
    first steps overflow; return the Watcher (or None), the model, the scale of each step and
    whether the scaler skipped it (its scale went down)."""
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    scales, skips = [], []
    by_optimizer = bool(watch and watch.pop("optimizer", False))

    def loop(dbg: Any) -> None:
        for step in range(steps):
            x, _ = batch(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scales.append(scaler.get_scale())
            scaler.scale(out.float().mean() * 10).backward()
            scaler.step(opt)
            scaler.update()
            skips.append(scaler.get_scale() < scales[-1])
            if dbg is not None and not by_optimizer:
                dbg.step()

    if watch is None:
        loop(None)
        return None, model, scales, skips
    options = {"optimizer": opt} if by_optimizer else {}
    with graddebug.watch(model, scaler=scaler, **watch, **options) as dbg:
        loop(dbg)
    return dbg, model, scales, skips


@pytest.mark.parametrize("by_optimizer", [False, True], ids=["dbg.step", "optimizer="])
def test_an_overflowing_step_is_marked_skipped_with_its_scale(by_optimizer: bool) -> None:
    dbg, _, scales, skips = fp16_run({"optimizer": by_optimizer})
    assert skips[0] and not skips[-1]  # the scale settles: a skip or two, then none
    assert dbg.step_index == 4
    assert skipped(dbg) == {s: f"scale={scales[s]!r}" for s in range(4) if skips[s]}
    assert skipped(dbg)[0] == "scale=65536.0"
    frame = dbg.frame()
    bad = frame[frame["nan"] | frame["inf"]]
    assert not bad.empty and set(bad["step"]) <= {s for s in range(4) if skips[s]}
    assert "forward_nonfinite" not in set(dbg.events()["event"])


def test_a_skipped_step_is_no_nonfinite_error() -> None:
    pytest.importorskip("graddebug.detectors.overflow")
    dbg, *_ = fp16_run({})
    findings = dbg.findings()
    assert "nonfinite" not in set(findings["issue"])
    overflow = findings[findings["issue"] == "overflow"]
    assert list(overflow["severity"]) == ["warning"]


@pytest.mark.parametrize("order", LOOPS)
def test_an_overflow_on_every_step_marks_every_step(order: str) -> None:
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    extra = {"optimizer": opt} if order == "optimizer=" else {}
    with graddebug.watch(model, scaler=scaler, **extra) as dbg:
        for step in range(4):
            x, y = batch(step)
            opt.zero_grad()
            LOOPS[order](dbg, scaler, opt, F.cross_entropy(model(x), y) * 1e38)
    assert dbg.step_index == 4
    assert skipped(dbg) == {0: "scale=1024.0", 1: "scale=512.0", 2: "scale=256.0",
                            3: "scale=128.0"}
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize("every", [1, 2])
def test_under_optimizer_each_scaler_step_closes_one_step_skipped_or_not(every: int) -> None:
    torch.manual_seed(0)
    model = net()
    ref = Reference(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    overflow = {1, 2}
    with graddebug.watch(model, scaler=scaler, optimizer=opt, every=every,
                         param_stats="full", full_stats_every=1) as dbg:
        for step in range(5):
            x, y = batch(step)
            factor = 1e38 if step in overflow else 1.0
            ref.step(x, y, factor, skip=step in overflow)
            opt.zero_grad()
            close_by_optimizer(dbg, scaler, opt, F.cross_entropy(model(x), y) * factor)
            assert dbg.step_index == step + 1
    recorded = set(range(0, 5, every))
    assert set(dbg.frame()["step"]) == recorded
    assert set(skipped(dbg)) == overflow & recorded
    # Each step holds its own gradients, not those of a skipped step merged in.
    for step in recorded - overflow:
        assert_stats(rows(dbg, step), ref.seen[step], rtol=1e-5, atol=1e-9)
    for p, q in zip(model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("by_optimizer", [False, True], ids=["dbg.step", "optimizer="])
def test_weights_are_bitwise_those_of_the_unwatched_run(by_optimizer: bool) -> None:
    _, plain, plain_scales, plain_skips = fp16_run(None)
    _, watched, scales, skips = fp16_run({"optimizer": by_optimizer})
    assert any(skips) and (scales, skips) == (plain_scales, plain_skips)
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


# -- bfloat16 and float16 ---------------------------------------------------------------------

def test_bf16_autocast_matches_float32_within_bf16_precision() -> None:
    torch.manual_seed(0)
    model = net()
    ref = Reference(model)
    x, y = batch(0)
    ref.step(x, y)
    with graddebug.watch(model, param_stats="full") as dbg:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16
        F.cross_entropy(out.float(), y).backward()
        dbg.step()
    frame = dbg.frame()
    assert np.isfinite(frame[list(STATS)].to_numpy()).all()
    assert not (frame["nan"] | frame["inf"]).any()
    got, expected = rows(dbg, 0), ref.seen[0]
    for name in expected:  # means are sums of cancelling terms: judged against the norm
        for stat in ("norm", "std", "absmax"):
            np.testing.assert_allclose(got[name][stat], expected[name][stat], rtol=0.05,
                                       err_msg=f"{name} {stat}")
        assert abs(got[name]["mean"] - expected[name]["mean"]) <= 0.05 * expected[name]["norm"]


@pytest.mark.parametrize("numel", [1000, 5000], ids=["staged", "in the hook"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_are_summed_in_float32(dtype: torch.dtype, numel: int) -> None:
    # 300**2 * numel overflows float16 (largest 65504); the norm itself does not.
    leaf = torch.zeros(numel, dtype=dtype, requires_grad=True)
    with graddebug.watch(params={"w": leaf}, param_stats="full") as dbg:
        t = dbg.tap(leaf * 1, "t")
        (t.float() * 300.0).sum().backward()
        dbg.step()
    frame = dbg.frame().set_index("layer")
    names = ("t", "w") if numel > 4096 else ("t",)  # small parameters: see the next test
    for name in names:
        assert frame.loc[name, "norm"] == pytest.approx(300.0 * math.sqrt(numel), rel=1e-6)
        assert frame.loc[name, "mean"] == pytest.approx(300.0, rel=1e-6)
        assert frame.loc[name, "std"] == pytest.approx(0.0, abs=1e-2)
        assert frame.loc[name, "absmax"] == 300.0
        assert not frame.loc[name, "inf"]


def test_half_precision_parameter_norms_taken_at_the_close_are_float32() -> None:
    # Two backward passes: the gradient changed after its hook, so the close measures it.
    leaf = torch.zeros(5000, dtype=torch.float16, requires_grad=True)
    with graddebug.watch(params={"w": leaf}) as dbg:
        for _ in range(2):
            (leaf.float() * 500.0).sum().backward()
        dbg.step()
    assert dbg.frame()["norm"].iloc[0] == pytest.approx(1000.0 * math.sqrt(5000), rel=1e-6)


# -- options --------------------------------------------------------------------------------

def test_a_disabled_scaler_records_the_plain_statistics() -> None:
    def run(scaler: Any) -> Any:
        torch.manual_seed(0)
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        options = {} if scaler is None else {"scaler": scaler}
        with graddebug.watch(model, optimizer=opt, **options) as dbg:
            for step in range(2):
                x, y = batch(step)
                opt.zero_grad()
                if scaler is None:
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                else:
                    close_by_optimizer(dbg, scaler, opt, F.cross_entropy(model(x), y))
        return dbg

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    off, plain = run(scaler), run(None)
    assert off.step_index == 2 and off.frame().equals(plain.frame())
    assert skipped(off) == {}
    assert not {"scale", "unscale_", "step", "update"} & set(vars(scaler))


@pytest.mark.parametrize("value", ["amp", torch.optim.SGD([torch.zeros(1,
                                                                       requires_grad=True)])])
def test_a_scaler_that_is_no_grad_scaler_is_refused_on_entering(value: Any) -> None:
    model = net()
    with (pytest.raises(ConfigError, match=r"scaler= got a (str|SGD), not a torch\.amp\.Grad"),
          graddebug.watch(model, scaler=value)):
        pass
    assert all(not m._forward_hooks for m in model.modules())  # nothing left installed


def test_the_scaler_is_given_back_on_exit_also_after_an_error() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with (pytest.raises(RuntimeError, match="boom"),
          graddebug.watch(model, scaler=scaler, optimizer=opt)):
        assert {"scale", "unscale_", "step", "update"} <= set(vars(scaler))
        raise RuntimeError("boom")
    assert not {"scale", "unscale_", "step", "update"} & set(vars(scaler))
    # A scaler someone else patched keeps that patch.
    mine = scaler.update
    scaler.update = mine  # an instance attribute now
    with graddebug.watch(model, scaler=scaler):
        assert scaler.update is not mine
    assert scaler.update is mine


# -- Lightning ------------------------------------------------------------------------------

@pytest.mark.slow
def test_lightning_follows_the_precision_plugins_scaler() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    from graddebug_torch.lightning import GradDebugCallback

    class Module(pl.LightningModule):
        def __init__(self, blow_up_at: int = -1) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = net()
            self.blow_up_at = blow_up_at

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x).float(), y)
            return loss * 1e6 if batch_idx == self.blow_up_at else loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    def fit(precision: Any, blow_up_at: int = -1) -> Any:
        callback = GradDebugCallback()
        xs, ys = zip(*(batch(step) for step in range(3)), strict=True)
        loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=48)
        options = {"plugins": [precision]} if precision is not None else {}
        pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
                   enable_progress_bar=False, enable_checkpointing=False,
                   enable_model_summary=False, callbacks=[callback], **options,
                   ).fit(Module(blow_up_at), loader)
        return callback

    def amp() -> Any:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        return MixedPrecision("16-mixed", "cpu", scaler)

    plain, mixed = fit(None), fit(amp())
    for step in range(3):
        got, expected = rows(mixed, step), rows(plain, step)
        assert set(got) == set(expected)
        for name in expected:  # float16 autocast against float32; the scale was 1024
            np.testing.assert_allclose(got[name]["norm"], expected[name]["norm"], rtol=0.02,
                                       err_msg=f"{step} {name}")
    assert skipped(mixed.watcher) == {}
    blown = fit(amp(), blow_up_at=1)
    assert blown.watcher.step_index == 3
    assert skipped(blown.watcher) == {1: "scale=1024.0"}
