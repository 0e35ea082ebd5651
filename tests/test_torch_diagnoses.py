"""Healthy models give no finding; broken ones are diagnosed at the right layer."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from torch_models import ResCNN, batches, relu_mlp, sigmoid_mlp, train  # noqa: E402


def watched_training(model: nn.Module, data, lr: float = 0.05, **options):
    with graddebug.watch(model, **options) as dbg:
        train(model, data, dbg, lr=lr)
    return dbg


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_relu_mlp_gives_no_finding_over_50_steps(seed: int) -> None:
    torch.manual_seed(seed)
    dbg = watched_training(relu_mlp(depth=8, width=64), batches(50, (32, 32), seed=seed))
    assert dbg.frame()["step"].nunique() == 50
    assert dbg.findings().empty, dbg.findings()["message"].tolist()


def test_healthy_residual_cnn_gives_no_finding_over_50_steps() -> None:
    torch.manual_seed(0)
    dbg = watched_training(ResCNN(), batches(50, (16, 3, 8, 8)))
    assert dbg.frame()["step"].nunique() == 50
    assert dbg.findings().empty, dbg.findings()["message"].tolist()


def test_sigmoid_mlp_vanishes_in_the_early_layers() -> None:
    torch.manual_seed(0)
    model = sigmoid_mlp(depth=12)
    dbg = watched_training(model, batches(5, (32, 32)))
    found = dbg.findings()
    vanishing = found[found["issue"] == "vanishing"]
    assert not vanishing.empty
    assert set(found["issue"]) == {"vanishing"}
    depth = dict(zip(dbg.frame()["layer"], dbg.frame()["depth"], strict=False))
    flagged = sorted(depth[layer] for layer in vanishing["layer"])
    assert flagged[0] == 0  # the first layer
    last = max(depth.values())
    assert max(flagged) < last - 4  # the layers near the loss are fine
    # Independent check: the first layer's weight gradient really is tiny relative to the last.
    model.zero_grad()
    x, y = batches(1, (32, 32), seed=9)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    assert model[0].weight.grad.norm() / model[22].weight.grad.norm() < 1e-3


def test_large_weights_explode_towards_the_input() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(10)])
    for layer in model:
        nn.init.normal_(layer.weight, std=3.0 / np.sqrt(32))
    with graddebug.watch(model) as dbg:
        for x, _ in batches(3, (16, 32)):
            model.zero_grad()
            model(x).square().mean().backward()
            dbg.step()
    found = dbg.findings()
    assert set(found["issue"]) == {"exploding"}
    first = found.set_index("layer").loc["0"]
    assert "explodes" in first["message"]  # the first layer, farthest from the loss


def test_relu_mlp_with_weights_times_five_explodes() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=8, width=64)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5)
    dbg = watched_training(model, batches(3, (32, 32)), lr=1e-12)
    found = dbg.findings()
    assert "exploding" in set(found["issue"])
    assert "0" in set(found[found["issue"] == "exploding"]["layer"])


class LogAt(nn.Module):
    """Applies log in the middle of a Linear stack: NaN is born at layer k."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == self.k:
                x = torch.log(x)  # negative pre-activations -> NaN
        return x


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


@pytest.mark.parametrize("k", [1, 3])
def test_log_of_negative_is_traced_to_its_layer(k: int) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 16) for _ in range(5)]
    layers.insert(k + 1, Log())
    model = nn.Sequential(*layers)
    with graddebug.watch(model) as dbg:
        for x, _ in batches(2, (8, 16)):
            model.zero_grad()
            model(x).sum().backward()
            dbg.step()
    found = dbg.findings()
    assert list(found["issue"]) == ["nonfinite"]
    assert found["layer"].item() == str(k + 1)
    assert found["step"].item() == 0
    assert "forward" in found["message"].item()


class SqrtAtZero(nn.Module):
    """Finite forward; in backward sqrt' = inf at the masked zeros, and inf * 0 = NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(x)
        mask[:, 0] = 0
        return torch.sqrt(x.square() * mask)


def test_backward_born_nan_is_traced_to_the_layer_below_the_op() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), SqrtAtZero(), nn.Linear(8, 1))
    with graddebug.watch(model) as dbg:
        model(torch.randn(4, 8)).sum().backward()
        dbg.step()
    found = dbg.findings()
    assert list(found["issue"]) == ["nonfinite"]
    assert found["layer"].item() == "0"  # the first non-finite gradient, behind sqrt
    assert "'1'" in found["message"].item()  # and the layer whose backward produced it


class Detached(nn.Module):
    def __init__(self, numpy_round_trip: bool = False) -> None:
        super().__init__()
        self.numpy_round_trip = numpy_round_trip
        self.block1 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.block2 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block1(x)
        h = torch.from_numpy(h.detach().numpy()) if self.numpy_round_trip else h.detach()
        return self.head(self.block2(h))


@pytest.mark.parametrize("numpy_round_trip", [False, True])
def test_detach_between_blocks_names_the_boundary(numpy_round_trip: bool) -> None:
    torch.manual_seed(0)
    dbg = watched_training(Detached(numpy_round_trip), batches(3, (4, 8), classes=3))
    found = dbg.findings()
    cut = found[(found["issue"] == "cut_graph") & (found["severity"] == "error")]
    assert len(cut) == 1
    assert cut["layer"].item() == "block2.0"
    assert "between 'block1.1' and 'block2.0'" in cut["message"].item()
    starved = found[(found["issue"] == "cut_graph") & (found["severity"] == "warning")]
    assert list(starved["layer"]) == ["block1.0"]


class DetachInside(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach() * 2


def test_layer_that_detaches_its_own_output_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4), DetachInside(), nn.Linear(4, 1))
    with graddebug.watch(model) as dbg:
        model(torch.randn(2, 4)).sum().backward()
        dbg.step()
    found = dbg.findings()
    errors = found[found["severity"] == "error"]
    assert list(errors["layer"]) == ["1"]
    assert "its input requires a gradient" in errors["message"].item()


def test_dead_relu_units_are_found() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=32)
    with torch.no_grad():
        model[2].bias[:28] = -1e3  # 28 of 32 units never fire
    dbg = watched_training(model, batches(5, (16, 32)), lr=1e-3)
    found = dbg.findings()
    assert list(found["issue"]) == ["dead"]
    assert found["layer"].item() == "2"
    assert 28 / 32 <= found["value"].item() < 1


def test_parameters_only_still_diagnoses_vanishing() -> None:
    torch.manual_seed(0)
    dbg = watched_training(sigmoid_mlp(depth=12), batches(3, (32, 32)), outputs=False)
    found = dbg.findings()
    assert set(found["issue"]) == {"vanishing"}
    assert "0" in set(found["layer"])


def test_thresholds_option_silences_a_finding() -> None:
    torch.manual_seed(0)
    dbg = watched_training(sigmoid_mlp(depth=12), batches(3, (32, 32)),
                           thresholds={"vanishing_ratio": 1e-12, "vanishing_floor": 1e-12})
    assert dbg.findings().empty


def test_functional_code_cut_is_named_at_the_detached_tap() -> None:
    x = torch.tensor([2.0, -1.0], requires_grad=True)
    w = torch.tensor([0.5, 3.0], requires_grad=True)
    with graddebug.watch(params={"x": x, "w": w}) as dbg:
        u = dbg.tap(2 * x + 3, "u")
        cut = dbg.tap(u.detach(), "u_detached")
        y = dbg.tap(cut**3 * w, "y")
        y.sum().backward()
        dbg.step()
    assert x.grad is None and w.grad is not None  # the cut, independently of graddebug
    found = dbg.findings()
    errors = found[found["severity"] == "error"]
    assert list(errors["layer"]) == ["u_detached"]
    assert "the tapped tensor does not require a gradient" in errors["message"].item()
    starved = found[found["severity"] == "warning"]
    assert list(starved["layer"]) == ["x"]
    assert starved["message"].item().startswith("parameter 'x' requires a gradient")
