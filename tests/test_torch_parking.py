"""Steps ``every=`` skips run no graddebug forward hook: the modules take torch's fast path, and
the recorded steps see the hooks back, in their order, with the frame they would have had."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from torch_models import batches, forward_hooks, relu_mlp, watched_run  # noqa: E402

SAME = ["step", "layer", "tensor", "kind", "depth", "shape", "numel", "nan", "inf"]


class Cut(nn.Module):
    """A parameter-free module outside torch.nn that cuts the graph (value-flow hooks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach() * 1.0


def test_skipped_steps_run_no_forward_hook_and_recorded_rows_are_those_of_every_step():
    torch.manual_seed(0)
    model = relu_mlp(depth=4, width=16)
    reference = copy.deepcopy(model)
    seen: list[int] = []
    sparse = watched_run(model, 7, every=3, seen=seen).frame()
    # Recorded steps (0, 3, 6) find every hook; the others none at all.
    assert [n > 0 for n in seen] == [True, False, False, True, False, False, True]
    assert forward_hooks(model) == 0
    dense = watched_run(reference, 7, every=1).frame().query("step in [0, 3, 6]")
    assert sorted(sparse["step"].unique()) == [0, 3, 6]
    a = dense.sort_values(SAME[:4]).reset_index(drop=True)
    b = sparse.sort_values(SAME[:4]).reset_index(drop=True)
    assert a[SAME].equals(b[SAME])
    np.testing.assert_allclose(b["norm"], a["norm"], rtol=1e-6)


def test_a_recorded_step_after_skipped_ones_measures_the_output_gradient():
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with graddebug.watch(model, every=2) as dbg:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            dbg.step()
    h = model[:2](x)  # the output of layer "1" at step 2 (no optimizer: same weights)
    (expected,) = torch.autograd.grad(F.cross_entropy(model[2:](h), y), h)
    row = dbg.frame().query("step == 2 and layer == '1' and kind == 'activation'")
    np.testing.assert_allclose(row["norm"], [float(expected.norm())], rtol=1e-5)


def test_a_module_with_a_hook_of_its_own_keeps_graddebugs():
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    calls: list[int] = []
    model[0].register_forward_hook(lambda m, a, o: calls.append(1))
    seen: list[int] = []
    dbg = watched_run(model, 4, every=2, seen=seen)
    # On skipped steps only layer 0's two hooks (the user's and graddebug's) are left.
    assert seen[1] == seen[3] == 2 and seen[0] > 2
    assert len(calls) == 4
    assert sorted(dbg.frame()["step"].unique()) == [0, 2]


def test_a_hook_added_while_parked_runs_and_comes_after_graddebugs():
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    data = batches(3, (8, 32))
    calls: list[int] = []
    step = [0]
    with graddebug.watch(model, every=2) as dbg:
        for i, (x, y) in enumerate(data):
            step[0] = i
            if i == 1:  # parked: the user's hook is the module's only one
                model[2].register_forward_hook(lambda m, a, o: calls.append(step[0]))
            F.cross_entropy(model(x), y).backward()
            dbg.step()
            if i == 1:
                first = next(iter(model[2]._forward_hooks.values()))
                assert isinstance(first, functools.partial)  # graddebug's, back in front
                assert first.func.__name__ == "on_forward"
    assert calls == [1, 2]
    assert {"0", "1", "2"} <= set(dbg.frame().query("step == 2")["layer"])


def test_value_flow_hooks_come_back_in_their_order_and_still_find_the_cut():
    model = nn.Sequential(nn.Linear(32, 16), Cut(), nn.Linear(16, 10))
    order: list[list[int]] = []
    data = batches(5, (8, 32))
    with graddebug.watch(model, every=2) as dbg:
        for x, y in data:
            order.append(list(model[1]._forward_hooks))
            F.cross_entropy(model(x), y).backward()
            dbg.step()
    assert order[0] == order[2] == order[4] and len(order[0]) == 2
    assert order[1] == order[3] == []
    events = dbg.events().query("layer == '1' and event == 'detached_output'")
    assert sorted(events["step"]) == [0, 2, 4]


def test_leaving_while_parked_removes_every_hook_and_entering_again_records():
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    before = forward_hooks(model)
    watcher = graddebug.watch(model, every=2)
    data = batches(3, (8, 32))
    with watcher as dbg:
        x, y = data[0]
        F.cross_entropy(model(x), y).backward()
        dbg.step()  # step 1 is skipped: the hooks are parked now
    assert forward_hooks(model) == before == 0
    with watcher as dbg:
        assert forward_hooks(model) == 0  # entered on skipped step 1
        for x, y in data[1:]:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            dbg.step()
    assert forward_hooks(model) == 0
    assert sorted(watcher.frame()["step"].unique()) == [0, 2]


def test_a_layer_with_an_intervention_keeps_its_hook_on_skipped_steps():
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    seen: list[int] = []
    watched_run(model, 2, every=2, seen=seen, intervene={"1": {"scale": 0.5}})
    assert seen[1] == 1 and len(model[1]._forward_hooks) == 0
