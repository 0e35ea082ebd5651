"""watch(model, optimizer=opt): each optimizer step closes a graddebug step, with no dbg.step()."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import graddebug  # noqa: E402
from torch_models import batches, relu_mlp  # noqa: E402

DATA = batches(20, (16, 32), seed=3)


def grad_norms(model: nn.Module) -> dict[str, float]:
    return {n: float(torch.linalg.vector_norm(p.grad)) for n, p in model.named_parameters()}


def plain(model: nn.Module, data=DATA, accumulate: int = 1) -> list[dict[str, float]]:
    """Train without graddebug; return the parameter-gradient norms seen at each opt.step()."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen = []
    for i, (x, y) in enumerate(data):
        F.cross_entropy(model(x), y).backward()
        if (i + 1) % accumulate == 0:
            seen.append(grad_norms(model))
            opt.step()
            opt.zero_grad()
    return seen


def watched(model: nn.Module, manual: str = "", data=DATA, accumulate: int = 1, **options):
    """The same loop under watch(model, optimizer=opt); ``manual`` adds dbg.step() calls."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with graddebug.watch(model, optimizer=opt, **options) as dbg:
        for i, (x, y) in enumerate(data):
            F.cross_entropy(model(x), y).backward()
            if (i + 1) % accumulate:
                continue
            if manual == "before":
                dbg.step()
            opt.step()
            if manual == "after":
                dbg.step()
            opt.zero_grad()
    return dbg


def frame_norms(dbg, step: int) -> dict[str, float]:
    frame = dbg.frame()
    rows = frame[(frame["step"] == step) & (frame["kind"] == "parameter")]
    return {f"{la}.{t}": n for la, t, n in zip(rows["layer"], rows["tensor"], rows["norm"],
                                               strict=True)}


def assert_matches_reference(dbg, reference: list[dict[str, float]]) -> None:
    assert sorted(dbg.frame()["step"].unique()) == list(range(len(reference)))
    for step, expected in enumerate(reference):
        got = frame_norms(dbg, step)
        assert set(got) == set(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=f"{step} {name}")


@pytest.mark.parametrize("manual", ["", "before"])
def test_each_optimizer_step_closes_one_step_and_weights_stay_bitwise_equal(manual: str) -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=4, width=32)
    ref = copy.deepcopy(model)
    reference = plain(ref)
    dbg = watched(model, manual=manual)
    assert dbg.step_index == 20  # dbg.step() before opt.step() closes early, never twice
    assert_matches_reference(dbg, reference)
    assert set(dbg.frame()["kind"]) == {"activation", "parameter"}
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_dbg_step_after_the_optimizer_closed_the_step_raises() -> None:
    model = relu_mlp(depth=3, width=16)
    with pytest.raises(graddebug.WatcherStateError,
                       match=r"SGD\.step\(\) has closed this step already.*Leave dbg\.step"):
        watched(model, manual="after")
    assert all(not m._forward_hooks for m in model.modules())
    # Without optimizer=, the same loop closes its steps with dbg.step() as always.
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddebug.watch(model) as dbg:
        for x, y in DATA[:3]:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            dbg.step()
            opt.zero_grad()
    assert dbg.step_index == 3


def test_gradient_accumulation_pools_the_micro_batches_of_one_optimizer_step() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    reference = plain(copy.deepcopy(model), accumulate=4)
    dbg = watched(model, accumulate=4)
    assert len(reference) == 5
    assert_matches_reference(dbg, reference)
    # The layer output of 4 micro-batches of 16 rows pools 64 rows.
    acts = dbg.frame()[dbg.frame()["kind"] == "activation"]
    assert set(acts[acts["layer"] == "0"]["numel"]) == {4 * 16 * 16}


def test_every_n_records_one_optimizer_step_in_n() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    reference = plain(copy.deepcopy(model))
    dbg = watched(model, every=6)
    assert dbg.step_index == 20
    assert sorted(dbg.frame()["step"].unique()) == [0, 6, 12, 18]
    for step in (0, 6, 12, 18):
        for name, value in reference[step].items():
            np.testing.assert_allclose(frame_norms(dbg, step)[name], value, rtol=1e-6)


def test_the_hook_is_removed_on_exit_also_after_an_exception() -> None:
    model = relu_mlp(depth=3, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = DATA[0]
    with pytest.raises(RuntimeError, match="boom"), \
            graddebug.watch(model, optimizer=opt) as dbg:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        raise RuntimeError("boom")
    assert dbg.step_index == 1
    assert not opt._optimizer_step_post_hooks
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert dbg.step_index == 1


def test_an_optimizer_of_other_parameters_or_not_an_optimizer_raises_config_error() -> None:
    model = relu_mlp(depth=3, width=16)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(graddebug.ConfigError, match="holds none of the watched parameters"), \
            graddebug.watch(model, optimizer=other):
        pass
    with pytest.raises(graddebug.ConfigError, match=r"'sgd' is a str, not a torch\.optim"), \
            graddebug.watch(model, optimizer="sgd"):
        pass
    assert all(not m._forward_hooks for m in model.modules())


def test_an_optimizer_of_part_of_the_model_is_accepted() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    opt = torch.optim.SGD(model[-1].parameters(), lr=0.1)  # fine-tuning the head only
    x, y = DATA[0]
    with graddebug.watch(model, optimizer=opt) as dbg:
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert dbg.step_index == 3


@pytest.mark.parametrize("where", ["both", "train_step", "watch"])
def test_train_step_closes_exactly_one_step_per_call(where: str) -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    ref = copy.deepcopy(model)
    reference = plain(ref, data=DATA[:3]) if where != "watch" else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    on_watch = opt if where in ("both", "watch") else None
    on_step = opt if where in ("both", "train_step") else None
    with graddebug.watch(model, optimizer=on_watch) as dbg:
        for x, y in DATA[:3]:
            dbg.train_step(x, (y,), F.cross_entropy, on_step)
    assert dbg.step_index == 3
    if reference is not None:
        assert_matches_reference(dbg, reference)
    # Trained like the plain loop; or, with the optimizer given to watch() only, never stepped.
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
