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


def train_cnn_with_input_fault(fault_step: int, steps: int = 8, every: int = 1,
                               fault: str = "inf_pixel") -> graddebug.Watcher:
    """A BN CNN trained with SGD on random images; from ``fault_step`` on, one pixel of the
    batch is Inf (a bad sample), or the model itself makes a NaN (``fault="model"``)."""
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with graddebug.watch(model, every=every) as dbg:
        for step in range(steps):
            x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
            if step == fault_step and fault == "inf_pixel":
                x[1, 0, 2, 3] = float("inf")
            out = model(x)
            if step == fault_step and fault == "model":
                out = out * torch.log(-out.abs() - 1)  # the model's own code makes a NaN
            opt.zero_grad()
            nn.functional.cross_entropy(out, y).backward()
            dbg.step()
            if step == fault_step:
                break  # the NaN update would poison every later step
    return dbg


@pytest.mark.parametrize("every", [1, 2])
def test_an_inf_pixel_mid_run_is_blamed_on_the_data(every: int) -> None:
    dbg = train_cnn_with_input_fault(fault_step=4, every=every)
    found = dbg.findings()
    assert list(found["issue"]) == ["nonfinite"]
    row = found.iloc[0]
    assert (row["step"], row["cause"], row["layer"]) == (4, "data", "conv1")
    assert "model's input held NaN/Inf at step 4: args.0 (Inf)" in row["message"]
    events = dbg.events()
    inputs = events[events["event"] == "input_nonfinite"]
    assert list(inputs["step"]) == [4] and list(inputs["layer"]) == ["input"]


def test_a_nan_the_model_makes_from_a_finite_batch_is_numerics() -> None:
    dbg = train_cnn_with_input_fault(fault_step=4, fault="model")
    found = dbg.findings()
    assert list(found["issue"]) == ["nonfinite"]
    assert found["cause"].item() == "numerics"
    assert "input_nonfinite" not in set(dbg.events()["event"])


class MaskedHead(nn.Module):
    """Takes an additive mask holding -inf by design, as attention code does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.log = Log()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, broken: bool = False) -> torch.Tensor:
        scores = (self.fc(x) + mask).softmax(-1)
        return self.log(scores - 1.0) if broken else scores


def test_a_mask_input_that_is_always_infinite_is_not_bad_data() -> None:
    torch.manual_seed(0)
    model = MaskedHead()
    mask = torch.zeros(4, 8)
    mask[:, -1] = float("-inf")
    with graddebug.watch(model) as dbg:
        for step in range(4):
            out = model(torch.randn(4, 8), mask, broken=step == 3)
            model.zero_grad()
            (out * torch.randn(4, 8)).sum().backward()
            dbg.step()
    found = dbg.findings()
    assert list(found["issue"]) == ["nonfinite"]
    assert (found["step"].item(), found["cause"].item()) == (3, "numerics")


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


class MyReLU(nn.ReLU):
    """A subclass may compute anything: it keeps its forward check."""


def test_layers_that_keep_values_finite_skip_the_forward_check_and_the_birth_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Log(), nn.ReLU(), nn.Dropout(0.1), MyReLU(),
                          nn.Linear(16, 4), nn.Tanh())
    with graddebug.watch(model) as dbg:
        for x, _ in batches(1, (8, 16)):
            model(x).sum().backward()
            dbg.step()
    events = dbg.report().events()
    forward = events[events["event"] == "forward_nonfinite"]
    # the NaN born in Log passes through every module after it; only those that can make one
    # from finite values are checked
    assert forward["layer"].tolist() == ["1", "4", "5"]
    found = dbg.findings()
    assert found[found["issue"] == "nonfinite"]["layer"].tolist() == ["1"]


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


# -- findings name the source, not the victims --------------------------------------------------


class SmallCNN(nn.Module):
    """conv-BN-ReLU twice, global pooling and a Linear head, like a tiny ResNet."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.bn2 = nn.BatchNorm2d(16)
        self.relu2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))))
        return self.fc(self.pool(x).flatten(1))


class PreNormBlock(nn.Module):
    """x + proj(act(fc(ln(x)))): a transformer MLP block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.act(self.fc(self.ln(x))))


class ResidualMLP(nn.Module):
    def __init__(self, d: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(PreNormBlock(d) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def xent_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 3):
    with graddebug.watch(model) as dbg:
        for _ in range(steps):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            dbg.step()
    return dbg


def test_a_huge_last_layer_weight_is_named_as_the_source_of_the_explosion() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    with torch.no_grad():
        model.fc.weight.mul_(1e6)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    # Independently: below fc every gradient is huge, at fc's output it is not.
    feats = model.relu2(model.bn2(model.conv2(model.relu1(model.bn1(model.conv1(x))))))
    logits = model.fc(model.pool(feats).flatten(1))
    g_feats, g_logits = torch.autograd.grad(nn.functional.cross_entropy(logits, y),
                                            [feats, logits])
    assert g_feats.norm() > 1e4 > 1 > g_logits.norm()
    found = xent_steps(model, x, y).findings()
    assert list(found["issue"]) == ["exploding"]  # one finding, not one per victim
    assert found["layer"].item() == "fc"
    message = found["message"].item()
    assert "in the backward of 'fc'" in message and "the output of 'pool'" in message
    assert "Below it, 7 layer(s)" in message  # conv1 .. pool, counted


def test_a_huge_projection_is_named_where_the_gradient_vanishes_behind_it() -> None:
    torch.manual_seed(0)
    model = ResidualMLP()
    with torch.no_grad():
        model.blocks[0].proj.weight.mul_(1e8)
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    # Independently: the gradient at the projection's output collapses, and its backward
    # restores it below.
    inner = model.blocks[0].act(model.blocks[0].fc(model.blocks[0].ln(model.embed(x))))
    out = model.blocks[0].proj(inner)
    h = model.blocks[2](model.blocks[1](model.embed(x) + out))
    g_out, g_inner = torch.autograd.grad(
        nn.functional.cross_entropy(model.head(model.ln_f(h)), y), [out, inner])
    assert g_out.norm() < 1e-7 < 1e-2 < g_inner.norm()
    found = xent_steps(model, x, y).findings()
    assert list(found["issue"]) == ["vanishing"]
    assert found["layer"].item() == "blocks.0.proj"
    message = found["message"].item()
    assert "backward of 'ln_f'" in message  # where the gradient collapses
    assert "9 layer(s)" in message


def test_no_dead_findings_from_the_victims_of_a_nan() -> None:
    # NaN is born at "5"; Hardtanh's backward gives NaN inputs a zero gradient, so the layers
    # below "7" see all-zero gradients: victims, not dead units.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Hardtanh(),
                          nn.Linear(32, 32), Log(), nn.Linear(32, 32), nn.Hardtanh(),
                          nn.Linear(32, 4))
    dbg = watched_training(model, batches(5, (16, 16), classes=4), lr=0.1)
    frame = dbg.frame()
    victim = frame.loc[(frame["layer"] == "2") & frame["zero_frac"].notna(), "zero_frac"]
    assert victim.median() == 1.0  # the victims' gradients really are all zero
    found = dbg.findings()
    assert list(found["issue"]) == ["nonfinite"]
    assert found["layer"].item() == "5"
