"""The optimizer's view in the torch adapter: ``weight_norm`` and ``update_norm`` on parameter rows.

The reference is a plain loop that keeps full copies of the weights: at each close it takes the
norm of every parameter as it is then, and the norm of the change the latest ``opt.step()``
since the previous close made (``after - before``, from copies on either side of the step),
NaN where no step ran. Tensors small enough to be taken whole must match it to float precision;
large ones are estimated from a strided sample. The relative standard error of a norm estimated
from ``k`` entries is about ``sqrt(kurtosis - 1) / (2 sqrt(k))``: 2.9% for Gaussian entries at
the ``k = 598`` that the budget gives each 512 x 512 weight of :func:`wide_mlp`. Measured over
576 steps (12 seeds, 4 steps, SGD, momentum, Adam, AdamW, 3 weights), the estimates of those
weights were off by 2.9% root mean square (6.6% at worst) and of their updates by 3.1% (11% at
worst): the tolerance, 12.5%, is four root mean squares. The 10 x 512 head is sampled with a
stride of 11, shorter than its rows, so each row's sample lies in a few residue classes of
columns: its updates were off by 4.1% root mean square but 20% at worst, and it gets 25%.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import graddebug  # noqa: E402
from graddebug import sampling  # noqa: E402
from graddebug.errors import GradDebugWarning  # noqa: E402
from graddebug_torch import updates as torch_updates  # noqa: E402
from graddebug_torch.samples import Group  # noqa: E402
from torch_models import relu_mlp  # noqa: E402

WIDE = 512
EXACT = 1e-5  # float32 norms of a few thousand entries, summed in another order
ESTIMATE = 0.125  # four root-mean-square errors of a 512 x 512 weight's update
HEAD = 0.25  # the 10 x 512 head's heavier tail (module docstring)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
}


def wide_mlp(seed: int) -> nn.Sequential:
    """Three 512 x 512 layers and a 10-way head: the weights are sampled, the biases whole."""
    torch.manual_seed(seed)
    return relu_mlp(depth=4, width=WIDE, inputs=WIDE, classes=10)


def batch(step: int, inputs: int = WIDE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(64, inputs, generator=g), torch.randint(0, 10, (64,), generator=g)


class Reference:
    """Full copies of the weights around each optimizer step and at each close."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.latest: dict[str, torch.Tensor] = {}  # the latest step's update since the close
        self.closes: list[dict[str, tuple[float, float]]] = []

    def step(self, opt: Any, *args: Any) -> Any:
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        out = opt.step(*args)
        changed = {n: p.detach() - before[n] for n, p in self.model.named_parameters()}
        self.latest = changed
        return out

    def close(self) -> None:
        self.closes.append({
            n: (float(p.detach().double().norm()),
                float(self.latest[n].double().norm()) if n in self.latest else math.nan)
            for n, p in self.model.named_parameters()})
        self.latest = {}


def rows(dbg: graddebug.Watcher) -> pd.DataFrame:
    frame = dbg.frame()
    params = frame[frame["kind"] == "parameter"].copy()
    params["name"] = params["layer"] + "." + params["tensor"]
    return params.set_index(["step", "name"])


def train(model: nn.Module, opt: torch.optim.Optimizer, loop: str, steps: int = 4,
          dbg: graddebug.Watcher | None = None, ref: Reference | None = None,
          edit: Callable[[int], None] | None = None) -> None:
    """``after``: opt.step(); dbg.step(). ``before``: dbg.step(); opt.step(). ``closure``:
    the close inside opt.step(closure), as Lightning's callback closes its steps (``edit`` runs
    in the closure, before the close). ``watch``: watch(optimizer=opt) closes them. ``edit``
    runs after each optimizer step otherwise."""
    def forward_backward(step: int) -> torch.Tensor:
        x, y = batch(step, model[0].in_features)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def close() -> None:
        if ref is not None:
            ref.close()
        if dbg is not None and loop != "watch":
            dbg.step()

    def closure(step: int) -> torch.Tensor:
        loss = forward_backward(step)
        if edit is not None:
            edit(step)
        close()
        return loss

    optimize = ref.step if ref is not None else lambda o, *args: o.step(*args)
    for i in range(steps):
        if loop == "closure":
            optimize(opt, functools.partial(closure, i))
            continue
        forward_backward(i)
        if loop == "before":
            close()
        optimize(opt)
        if edit is not None:
            edit(i)
        if loop in ("after", "watch"):
            close()


def watched(model: nn.Module, opt: torch.optim.Optimizer, loop: str, steps: int = 4,
            edit: Callable[[int], None] | None = None, **options: Any
            ) -> tuple[graddebug.Watcher, Reference]:
    ref = Reference(model)
    if loop == "watch":
        options["optimizer"] = opt
    with graddebug.watch(model, strict=True, **options) as dbg:
        train(model, opt, loop, steps, dbg, ref, edit)
    return dbg, ref


def tolerance(name: str) -> float:
    """The relative tolerance of a parameter of :func:`wide_mlp` (the module docstring)."""
    if name.endswith(".bias"):
        return EXACT
    return HEAD if name == "6.weight" else ESTIMATE


def check(dbg: graddebug.Watcher, ref: Reference, steps: list[int] | None = None) -> None:
    """Every parameter row of :func:`wide_mlp` against the reference."""
    found = rows(dbg)
    steps = steps if steps is not None else list(range(len(ref.closes)))
    assert sorted(found.index.get_level_values("step").unique()) == steps
    for step in steps:
        for name, (weight, update) in ref.closes[step].items():
            row = found.loc[(step, name)]
            rel = tolerance(name)
            assert row["weight_norm"] == pytest.approx(weight, rel=rel), (step, name)
            if math.isnan(update):
                assert math.isnan(row["update_norm"]), (step, name)
            else:
                assert row["update_norm"] == pytest.approx(update, rel=rel), (step, name)


# -- the values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_small_tensors_are_exact_and_large_ones_within_ten_percent(name: str) -> None:
    for seed in range(3):
        model = wide_mlp(seed)
        dbg, ref = watched(model, OPTIMIZERS[name](model.parameters()), "after")
        check(dbg, ref)
        assert rows(dbg)["update_norm"].notna().all()


@pytest.mark.parametrize("loop", ["before", "closure", "watch"])
def test_every_loop_order_reads_the_weights_at_the_close_and_the_latest_update(loop: str) -> None:
    model = wide_mlp(1)
    dbg, ref = watched(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loop)
    check(dbg, ref)
    found = rows(dbg)
    if loop == "watch":
        assert found["update_norm"].notna().all()
    else:  # the close comes before the update: step 0 has none yet, step k has step k-1's
        assert found.loc[0, "update_norm"].isna().all()
        assert found.drop(index=0, level="step")["update_norm"].notna().all()


def test_without_an_optimizer_the_weights_are_there_and_the_update_is_nan() -> None:
    model = wide_mlp(2)
    with graddebug.watch(model, strict=True) as dbg:
        for i in range(3):
            x, y = batch(i)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
            dbg.step()
    found = rows(dbg)
    assert found["update_norm"].isna().all()
    for name, p in model.named_parameters():
        assert found.loc[(2, name), "weight_norm"] == pytest.approx(
            float(p.detach().double().norm()), rel=tolerance(name))


def test_a_group_with_lr_zero_has_an_update_of_exactly_zero() -> None:
    model = wide_mlp(3)
    frozen = list(model[2].parameters())
    others = [p for p in model.parameters() if all(p is not q for q in frozen)]
    opt = torch.optim.AdamW([{"params": others}, {"params": frozen, "lr": 0.0}], lr=1e-3,
                            weight_decay=0.1)
    dbg, ref = watched(model, opt, "after")
    found = rows(dbg).reset_index()
    still = found[found["name"].str.startswith("2.")]
    moving = found[~found["name"].str.startswith("2.")]
    assert len(still) == 4 * 2 and (still["update_norm"] == 0.0).all()
    assert (moving["update_norm"] > 0).all()
    check(dbg, ref)


@pytest.mark.parametrize("how", ["replaced", "in place"])
@pytest.mark.parametrize("loop", ["after", "before"])
def test_changed_weights_are_seen_at_the_next_close(loop: str, how: str) -> None:
    # Scaled by 1e4 after the last step's update, whose close sees it: the network would
    # blow up in the steps after, where the estimates are no longer the point.
    model = wide_mlp(4)
    scaled = {"0.bias": model[0].bias, "2.weight": model[2].weight}
    at = 3 if loop == "after" else 2  # the step after whose update the weights change

    def edit(step: int) -> None:
        for p in scaled.values():
            if step == at and how == "replaced":
                p.data = p.data * 1e4  # a new storage: a new data_ptr
            elif step == at:
                with torch.no_grad():
                    p.mul_(1e4)  # the same storage: a new version
            elif step == 1:  # a milder change, with updates measured after it
                if how == "replaced":
                    p.data = p.data * 2.0
                else:
                    with torch.no_grad():
                        p.mul_(2.0)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dbg, ref = watched(model, opt, loop, edit=edit)
    check(dbg, ref)
    found = rows(dbg)
    for name in scaled:
        assert found.loc[(3, name), "weight_norm"] > 1e3 * found.loc[(2, name), "weight_norm"]


def test_inside_a_closure_the_update_counts_from_the_step_s_start() -> None:
    # The close inside opt.step(closure) must leave the copy the pre-hook made: a weight
    # changed in the closure, before the close, is part of what that step() call did.
    model = wide_mlp(4)

    def edit(step: int) -> None:
        with torch.no_grad():
            model[0].bias.mul_(2.0)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dbg, ref = watched(model, opt, "closure", edit=edit)
    check(dbg, ref)


def test_every_n_measures_the_recorded_steps_only() -> None:
    model = wide_mlp(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dbg, ref = watched(model, opt, "after", steps=7, every=3)
    check(dbg, ref, steps=[0, 3, 6])
    assert rows(dbg)["update_norm"].notna().all()


@pytest.mark.parametrize("loop", ["before", "closure"])
def test_every_n_with_the_close_before_the_update_reads_the_step_before(loop: str) -> None:
    model = wide_mlp(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dbg, ref = watched(model, opt, loop, steps=7, every=3)
    check(dbg, ref, steps=[0, 3, 6])
    assert rows(dbg).drop(index=0, level="step")["update_norm"].notna().all()


@pytest.mark.parametrize("param_stats", ["norm", "full"])
@pytest.mark.parametrize("outputs", [True, False])
def test_every_row_builder_carries_both_columns(param_stats: str, outputs: bool) -> None:
    model = wide_mlp(6)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dbg, ref = watched(model, opt, "after", steps=2, param_stats=param_stats, outputs=outputs)
    check(dbg, ref)


def test_gradient_accumulation_measures_the_one_step_of_several_backward_passes() -> None:
    model = wide_mlp(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = Reference(model)
    with graddebug.watch(model, optimizer=opt, strict=True) as dbg:
        for i in range(8):
            x, y = batch(i)
            (F.cross_entropy(model(x), y) / 4).backward()
            if (i + 1) % 4 == 0:
                ref.step(opt)
                ref.close()
                opt.zero_grad()
    assert dbg.step_index == 2
    check(dbg, ref)


def test_a_step_the_grad_scaler_skips_has_no_update_and_the_next_one_its_own() -> None:
    model = wide_mlp(9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ref = Reference(model)
    with graddebug.watch(model, scaler=scaler, strict=True) as dbg:
        for i in range(3):
            x, y = batch(i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y) * (math.inf if i == 1 else 1.0)
            scaler.scale(loss).backward()
            before = [p.detach().clone() for p in model.parameters()]
            if i == 1:
                scaler.step(opt)  # skips opt.step(): the scaled gradients are not finite
                assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(),
                                                             strict=True))
            else:
                scaler.unscale_(opt)
                ref.step(scaler, opt)
            scaler.update()
            ref.close()
            dbg.step()
    found = rows(dbg)
    assert found.loc[1, "update_norm"].isna().all()
    assert found.loc[2, "update_norm"].notna().all()
    for step in (0, 2):
        for name, (weight, update) in ref.closes[step].items():
            rel = tolerance(name)
            assert found.loc[(step, name), "update_norm"] == pytest.approx(update, rel=rel)
            assert found.loc[(step, name), "weight_norm"] == pytest.approx(weight, rel=rel)


def test_a_compiled_model_has_both_columns() -> None:
    torch._dynamo.reset()
    model = wide_mlp(10)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref = Reference(model)
    with graddebug.watch(compiled, strict=True) as dbg:
        for i in range(3):
            x, y = batch(i)
            opt.zero_grad()
            F.cross_entropy(compiled(x), y).backward()
            ref.step(opt)
            ref.close()
            dbg.step()
    torch._dynamo.reset()
    check(dbg, ref)


def test_a_channels_last_weight_is_read_in_memory_order_and_a_strided_one_is_nan() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, WIDE),
                          nn.ReLU(), nn.Linear(WIDE, WIDE))
    model[0].to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    model[3].weight.data = torch.randn(WIDE, 2 * 288)[:, ::2]  # not dense: no view holds it
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = Reference(model)
    with graddebug.watch(model, strict=True) as dbg:
        for i in range(2):
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            model(x).square().mean().backward()
            ref.step(opt)
            ref.close()
            dbg.step()
    found = rows(dbg)
    for step, expected in enumerate(ref.closes):
        for name in ("0.weight", "0.bias"):
            weight, update = expected[name]
            assert found.loc[(step, name), "weight_norm"] == pytest.approx(weight, rel=EXACT)
            assert found.loc[(step, name), "update_norm"] == pytest.approx(update, rel=EXACT)
        assert found.loc[(step, "3.weight"), ["weight_norm", "update_norm"]].isna().all()


# -- memory --------------------------------------------------------------------------------------


def held(dbg: graddebug.Watcher, model: nn.Module) -> int:
    """The entries the samples' buffers hold; every sample must be a view of its parameter."""
    layout = dbg.adapter._updates._layout  # type: ignore[union-attr]
    assert layout is not None
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for group in layout.groups:
        assert all(v.untyped_storage().data_ptr() in storages for v in group.views)
        assert group.buffer.untyped_storage().data_ptr() not in storages
    return sum(group.buffer.numel() for group in layout.groups)


def many_small() -> nn.Sequential:
    """200 tensors of at most 256 entries and one of 64k: most tensors are tiny."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, 256)]
    for _ in range(100):
        layers += [nn.ReLU(), nn.Linear(256, 1, bias=True), nn.Linear(1, 256)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize(("build", "measured"), [
    (lambda: nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(512, 512), nn.ReLU())]),
     32),
    (many_small, 402),  # every tensor: the 100 one-entry biases whole, the others at the floor
    (lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), 4),  # the floor
], ids=["16x512", "many-small", "tiny"])
def test_the_samples_hold_at_most_twice_the_budget_and_the_floor(build: Callable[[], nn.Module],
                                                                 measured: int) -> None:
    model = build()
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with graddebug.watch(model, strict=True) as dbg:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, model[0].in_features)).square().mean().backward()
            opt.step()
            dbg.step()
        entries = held(dbg, model)
    assert entries <= 2 * (sampling.BUDGET * total + sampling.FLOOR * len(params))
    last = rows(dbg).loc[1]
    assert last["weight_norm"].notna().sum() == last["update_norm"].notna().sum() == measured


# -- the hooks' lifetime and the observer effect -------------------------------------------------


def global_hooks() -> tuple[int, int]:
    from torch.optim import optimizer as optim
    return len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks)


def test_the_hooks_are_removed_on_exit_also_after_an_exception() -> None:
    model = wide_mlp(11)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = global_hooks()
    with graddebug.watch(model) as dbg:
        assert global_hooks() == (before[0] + 1, before[1] + 1)
        train(model, opt, "after", steps=2, dbg=dbg)
    assert global_hooks() == before
    frame = dbg.frame()
    train(model, opt, "after", steps=2)  # an optimizer step after exit changes nothing
    assert dbg.frame().equals(frame) and global_hooks() == before
    with pytest.raises(RuntimeError, match="boom"), graddebug.watch(model, optimizer=opt):
        train(model, opt, "watch", steps=1)
        raise RuntimeError("boom")
    assert global_hooks() == before and not opt._optimizer_step_post_hooks


@pytest.mark.parametrize("loop", ["after", "before", "closure", "watch"])
@pytest.mark.parametrize("name", ["momentum", "adamw"])
def test_weights_stay_bitwise_those_of_the_unwatched_run(loop: str, name: str) -> None:
    base = wide_mlp(12)
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    train(plain, OPTIMIZERS[name](plain.parameters()), loop)
    dbg, _ = watched(model, OPTIMIZERS[name](model.parameters()), loop)
    assert rows(dbg)["update_norm"].notna().any()
    for (pname, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), pname


def broken(*args: Any, **kwargs: Any) -> Any:
    raise ZeroDivisionError("bug inside graddebug")


@pytest.mark.parametrize(("where", "column"), [
    ("_held", "update_norm"),  # the pre-hook
    ("stepped", "update_norm"),  # the post-hook
    ("weight_norms", "weight_norm"),  # the close
])
def test_a_bug_in_the_optimizer_hooks_fails_open(monkeypatch: pytest.MonkeyPatch, where: str,
                                                 column: str) -> None:
    base = wide_mlp(13)
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    train(plain, torch.optim.Adam(plain.parameters(), lr=1e-3), "after")
    monkeypatch.setattr(torch_updates if where == "_held" else Group, where,
                        broken)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.warns(GradDebugWarning, match="bug inside graddebug"), \
            graddebug.watch(model) as dbg:
        train(model, opt, "after", dbg=dbg)
    found = dbg.findings()
    assert set(found["issue"]) == {"internal_error"}
    params = rows(dbg)
    assert len(params) == 4 * 8 and params["norm"].notna().all()  # the rows are all there
    assert params[column].isna().all()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)  # training went on, untouched


def test_strict_raises_a_bug_in_the_optimizer_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    before = global_hooks()
    model = wide_mlp(14)
    monkeypatch.setattr(torch_updates, "_held", broken)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(graddebug.GradDebugInternalError), \
            graddebug.watch(model, strict=True) as dbg:
        train(model, opt, "after", steps=1, dbg=dbg)
    assert global_hooks() == before


# -- distributed ---------------------------------------------------------------------------------


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group."""
    dist = torch.distributed
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_rows_are_those_of_the_wrapped_module(group: None) -> None:
    model = wide_mlp(15)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref = Reference(model)
    with graddebug.watch(ddp, strict=True) as dbg:
        for i in range(3):
            x, y = batch(i)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            ref.step(opt)
            ref.close()
            dbg.step()
    check(dbg, ref)


def test_fully_sharded_parameters_carry_the_norms_of_their_slices(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def local(p: torch.Tensor) -> torch.Tensor:
        out = p.to_local() if hasattr(p, "to_local") else p
        return out.detach().double().clone()

    model = wide_mlp(16)
    fully_shard(model[2], mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    truth: dict[tuple[int, str], tuple[float, float]] = {}
    with graddebug.watch(model, strict=True) as dbg:
        for step in range(2):
            before = {n: local(p) for n, p in model.named_parameters()}
            x, y = batch(step, model[0].in_features)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            dbg.step()
            for n, p in model.named_parameters():
                truth[(step, n)] = (float(local(p).norm()), float((local(p) - before[n]).norm()))
    found = rows(dbg)
    assert found.index.get_level_values("name").str.startswith("2.").any()
    # A DTensor's slice (here all of it) is sampled as a plain tensor is: the plan's estimate,
    # within its sampling error of the whole tensor's norms.
    for (step, name), row in found.iterrows():
        weight, update = truth[(step, name)]
        assert row["weight_norm"] == pytest.approx(weight, rel=0.15), (step, name)
        assert row["update_norm"] == pytest.approx(update, rel=0.15), (step, name)


# -- Lightning -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_lightning_closes_inside_the_step_and_rows_carry_the_step_before(
        tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from graddebug_torch.lightning import GradDebugCallback

    model = wide_mlp(17)
    ref = Reference(model)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Copies(pl.Callback):
        """The reference's closes, where the graddebug callback closes its steps."""

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            ref.close()

    # The reference's full copies around each step, as the optimizer runs it.
    from torch.optim import optimizer as optim
    before: dict[str, torch.Tensor] = {}

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        before.update({n: p.detach().clone() for n, p in model.named_parameters()})

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        ref.latest = {n: p.detach() - before[n] for n, p in model.named_parameters()}

    x, y = batch(0)
    loader = DataLoader(TensorDataset(x.repeat(4, 1), y.repeat(4)), batch_size=64)
    callback = GradDebugCallback(log=False, strict=True)
    handles = [optim.register_optimizer_step_pre_hook(pre),
               optim.register_optimizer_step_post_hook(post)]
    try:
        trainer = pl.Trainer(max_steps=4, callbacks=[callback, Copies()], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu",
                             default_root_dir=tmp_path)
        trainer.fit(Module(), loader)
    finally:
        for handle in handles:
            handle.remove()
    assert callback.watcher is not None
    frame = callback.watcher.frame()
    params = frame[frame["kind"] == "parameter"].copy()
    params["name"] = params["layer"].str.removeprefix("net.") + "." + params["tensor"]
    found = params.set_index(["step", "name"])
    assert sorted(found.index.get_level_values("step").unique()) == [0, 1, 2, 3]
    assert found.loc[0, "update_norm"].isna().all()
    for step in (1, 2, 3):
        for name, (weight, update) in ref.closes[step].items():
            rel = tolerance(name)
            assert found.loc[(step, name), "weight_norm"] == pytest.approx(weight, rel=rel)
            assert found.loc[(step, name), "update_norm"] == pytest.approx(update, rel=rel)
