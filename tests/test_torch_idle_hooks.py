"""``watch(model, outputs=False)``: the forward hook of a torch module finds nothing once its
layer's depth is known, and is removed; modules of the user's own, and torch containers that
hold one, keep theirs for the cut check."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from torch_models import batches, forward_hooks, relu_mlp, watched_run  # noqa: E402


def test_parameter_capture_drops_the_forward_hooks_after_the_first_step_with_the_same_rows():
    torch.manual_seed(0)
    model = relu_mlp(depth=4, width=16)
    reference = copy.deepcopy(model)
    seen: list[int] = []
    frame = watched_run(model, 4, seen, outputs=False).frame()
    # One hook per leaf module (4 Linear, 3 ReLU) on the first step, none after it.
    assert seen == [7, 0, 0, 0]
    assert forward_hooks(model) == 0
    # The rows are those of a watch that records the outputs too, its parameter rows.
    full = watched_run(reference, 4).frame().query("kind == 'parameter'")
    keys = ["step", "layer", "tensor", "depth", "shape", "numel"]
    a = full.sort_values(keys).reset_index(drop=True)
    b = frame.sort_values(keys).reset_index(drop=True)
    assert a[keys].equals(b[keys])
    np.testing.assert_allclose(b["norm"], a["norm"], rtol=1e-6)
    # Depth follows the forward order of the owning layers.
    depths = frame.query("step == 3 and tensor == 'weight'").sort_values("depth")
    assert list(depths["layer"]) == ["0", "2", "4", "6"]


class Gate(nn.Module):
    """A module of the user's own: it cuts the graph from the step it is told to."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach() if self.cut else x


class Branchy(nn.Module):
    """A head that runs only when asked: its layer's depth is known only from that step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 16)
        self.gate = Gate()
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(torch.relu(self.body(x)))
        if self.use_extra:
            h = self.extra(h)
        return self.head(h)


def test_a_module_of_the_users_keeps_its_hook_and_a_late_module_gets_its_depth():
    torch.manual_seed(0)
    model = Branchy()
    data = batches(4, (8, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddebug.watch(model, outputs=False) as dbg:
        for step, (x, y) in enumerate(data):
            model.use_extra = step >= 1
            model.gate.cut = step == 3
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            dbg.step()
            opt.step()
            hooked = {name for name, m in model.named_modules() if m._forward_hooks}
            # "extra" keeps its hook until its first forward (step 1) gave it a depth.
            assert hooked == ({"gate", "extra"} if step == 0 else {"gate"})
    events = dbg.events()
    cuts = events[events["event"] == "detached_output"]
    assert list(zip(cuts["step"], cuts["layer"], strict=True)) == [(3, "gate")]
    frame = dbg.frame()
    # Depths are the order of first forwards: "extra" first ran at step 1, after "head".
    order = frame.query("step == 2 and tensor == 'weight'").sort_values("depth")["layer"]
    assert list(order) == ["body", "head", "extra"]


def test_parameter_capture_keeps_a_hook_that_is_not_graddebugs():
    torch.manual_seed(0)
    model = relu_mlp(depth=2, width=8)
    calls: list[int] = []
    model[0].register_forward_hook(lambda m, a, o: calls.append(1))
    seen: list[int] = []
    watched_run(model, 3, seen, outputs=False)
    assert seen == [4, 1, 1]  # graddebug's three and the user's, then the user's alone
    assert len(calls) == 3
    assert forward_hooks(model) == 1


def test_a_torch_container_holding_a_module_of_the_users_keeps_its_hook():
    torch.manual_seed(0)
    gate = Gate()
    model = nn.Sequential(nn.Linear(32, 16), nn.Sequential(nn.ReLU(), gate), nn.Linear(16, 10))
    data = batches(3, (8, 32))
    with graddebug.watch(model, outputs=False, layers=["1", "2"]) as dbg:
        for step, (x, y) in enumerate(data):
            gate.cut = step == 2
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            dbg.step()
            # The container "1" runs a module of the user's: its hook stays; "2" is torch's.
            assert [bool(m._forward_hooks) for m in model] == [False, True, False]
    events = dbg.events()
    cuts = events[events["event"] == "detached_output"]
    assert list(zip(cuts["step"], cuts["layer"], strict=True)) == [(2, "1")]
