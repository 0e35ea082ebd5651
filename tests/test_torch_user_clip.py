"""A user's own ``torch.nn.utils.clip_grad_norm_`` between ``backward()`` and ``dbg.step()``:
``norm`` stays the gradient backward produced, ``clipped_norm`` is what the optimizer got."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _params(dbg: graddebug.Watcher, step: int):
    frame = dbg.frame()
    rows = frame[(frame["kind"] == "parameter") & (frame["step"] == step)]
    return {(r.layer, r.tensor): r for r in rows.itertuples()}


@pytest.mark.parametrize("max_norm", [0.01, 1e6])
def test_the_rows_hold_the_gradient_before_and_after_the_users_clip(max_norm: float) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    before: dict[tuple[str, str], float] = {}
    after: dict[tuple[str, str], float] = {}
    with graddebug.watch(model) as dbg:
        for _ in range(2):
            opt.zero_grad()
            (100 * nn.functional.mse_loss(model(x), y)).backward()
            before = {(n.rsplit(".", 1)[0], n.rsplit(".", 1)[1]): p.grad.norm().item()
                      for n, p in model.named_parameters()}
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            after = {(n.rsplit(".", 1)[0], n.rsplit(".", 1)[1]): p.grad.norm().item()
                     for n, p in model.named_parameters()}
            opt.step()
            dbg.step()
    rows = _params(dbg, 1)
    assert set(rows) == set(before)
    for key, row in rows.items():
        assert row.norm == pytest.approx(before[key], rel=1e-4), key
        assert row.clipped_norm == pytest.approx(after[key], rel=1e-4), key
    # The total graddebug sees is the one clip_grad_norm_ returned (before the clip).
    seen = math.sqrt(sum(r.norm ** 2 for r in rows.values()))
    assert seen == pytest.approx(total.item(), rel=1e-4)


def test_without_a_clip_clipped_norm_is_nan_and_torch_is_restored() -> None:
    original = torch.nn.utils.clip_grad_norm_
    model = _model()
    with graddebug.watch(model) as dbg:
        assert torch.nn.utils.clip_grad_norm_ is not original
        nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 2)).backward()
        dbg.step()
    assert torch.nn.utils.clip_grad_norm_ is original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is original
    assert dbg.frame().query("kind == 'parameter'")["clipped_norm"].isna().all()


def test_an_explosion_clipped_by_the_user_is_still_found() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    with graddebug.watch(model) as dbg:
        for step in range(40):
            if step == 30:
                with torch.no_grad():
                    model[2].weight.mul_(1e4)
            x = torch.randn(32, 8, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), torch.randn(32, 2, generator=gen)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            dbg.step()
    found = dbg.findings()
    assert not found.empty and (found["step"] >= 30).all(), found[["step", "issue", "layer"]]
    # Reference: the weight gradient at step 30, before the clip, really jumped.
    rows = dbg.frame().query("kind == 'parameter' and layer == '0' and tensor == 'weight'")
    by_step = dict(zip(rows["step"], rows["norm"], strict=True))
    assert by_step[30] / by_step[29] > 100


def test_a_clip_after_the_step_closed_leaves_the_next_step_as_backward_made_it() -> None:
    # A host that closes its step and then clips (the Trainer under attach(), Lightning): that
    # clip acts on a closed step's gradients, and the next step's rows are not scaled by it.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    with graddebug.watch(model) as dbg:
        for _ in range(2):
            opt.zero_grad()
            (100 * nn.functional.mse_loss(model(x), y)).backward()
            before = {(n.rsplit(".", 1)[0], n.rsplit(".", 1)[1]): p.grad.norm().item()
                      for n, p in model.named_parameters()}
            dbg.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
    rows = _params(dbg, 1)
    assert set(rows) == set(before)
    for key, row in rows.items():
        assert row.norm == pytest.approx(before[key], rel=1e-4), key
        assert math.isnan(row.clipped_norm), key
