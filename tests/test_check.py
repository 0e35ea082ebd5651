"""graddebug.check: one-shot steps against torch.autograd.grad, the batch rule, bad input."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from graddebug import ConfigError, check
from graddebug.integrations.check import split_batch

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from torch_models import relu_mlp, sigmoid_mlp  # noqa: E402


def data(seed: int = 0, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def param_norms(report, step: int) -> dict[str, float]:
    frame = report.frame()
    rows = frame[(frame["step"] == step) & (frame["kind"] == "parameter")]
    return {f"{layer}.{tensor}": norm
            for layer, tensor, norm in zip(rows["layer"], rows["tensor"], rows["norm"],
                                           strict=True)}


def reference_norms(model: nn.Module, loss: torch.Tensor) -> dict[str, float]:
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, params)
    return {n: float(torch.linalg.vector_norm(g)) for n, g in zip(names, grads, strict=True)}


def assert_norms_equal(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)


# -- the batch rule (no framework needed) ------------------------------------------------------

def test_a_pair_is_inputs_and_targets_and_anything_else_is_the_input() -> None:
    assert split_batch(("x", "y")) == ("x", ("y",))
    assert split_batch(["x", "y"]) == ("x", ("y",))
    assert split_batch("x") == ("x", ())
    assert split_batch(("a", "b", "c")) == (("a", "b", "c"), ())
    assert split_batch({"x": 1, "y": 2}) == ({"x": 1, "y": 2}, ())
    # targets= makes the batch the input as it is, pair or not.
    assert split_batch(("a", "b"), targets="y") == (("a", "b"), ("y",))
    assert split_batch(("a", "b"), targets=None) == (("a", "b"), ())


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [0, -1, True, 1.5, "2"])
def test_steps_must_be_a_positive_int(steps: object) -> None:
    with pytest.raises(ConfigError, match=f"steps={steps!r} must be a positive int"):
        check(relu_mlp(), data(), F.cross_entropy, steps)  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_fn", [None, "cross_entropy", 3])
def test_loss_fn_must_be_callable(loss_fn: object) -> None:
    with pytest.raises(ConfigError, match=f"loss_fn={loss_fn!r} is not callable"):
        check(relu_mlp(), data(), loss_fn)  # type: ignore[arg-type]


def test_unknown_options_and_a_missing_model_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown option 'layer'\. Did you mean 'layers'"):
        check(relu_mlp(), data(), F.cross_entropy, layer=["0"])
    with pytest.raises(ConfigError, match="needs a model"):
        check(None, data(), F.cross_entropy)


def test_a_loss_that_is_not_a_scalar_raises_and_leaves_no_hook() -> None:
    model = relu_mlp(depth=3, width=8)
    with pytest.raises(ConfigError, match=r"scalar tensor, got Tensor\(16,\)"):
        check(model, data(), lambda out, y: F.cross_entropy(out, y, reduction="none"))
    assert all(not m._forward_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


# -- what it records -----------------------------------------------------------------------------

def test_one_step_records_what_autograd_grad_computes_and_changes_no_weight() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=4, width=16)
    ref = copy.deepcopy(model)
    x, y = data()
    report = check(model, (x, y), F.cross_entropy)
    assert sorted(report.frame()["step"].unique()) == [0]
    assert_norms_equal(param_norms(report, 0), reference_norms(ref, F.cross_entropy(ref(x), y)))
    activations = report.frame()[report.frame()["kind"] == "activation"]
    assert list(activations["layer"]) == [str(i) for i in range(7)]  # 4 Linear + 3 ReLU
    assert report.findings().empty, report.findings()["message"].tolist()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    # The last step's gradients stay on the model, as after a plain backward().
    assert model[0].weight.grad is not None
    assert all(not m._forward_hooks for m in model.modules())


def test_steps_without_an_optimizer_see_the_same_gradients_each_time() -> None:
    # Zeroing between steps is what keeps them equal: accumulated gradients would grow 1x, 2x, 3x.
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    report = check(model, data(), F.cross_entropy, steps=3)
    first = param_norms(report, 0)
    assert param_norms(report, 1) == first
    assert param_norms(report, 2) == first


def test_steps_with_an_optimizer_train_exactly_like_a_plain_loop() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=4, width=16)
    ref = copy.deepcopy(model)
    x, y = data()
    report = check(model, (x, y), F.cross_entropy, steps=3,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        expected = {n: float(torch.linalg.vector_norm(p.grad)) for n, p in ref.named_parameters()}
        assert_norms_equal(param_norms(report, step), expected)
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_loss_fn_takes_one_argument_without_targets() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=16)
    ref = copy.deepcopy(model)
    x, _ = data()
    report = check(model, x, lambda out: out.square().mean())
    assert_norms_equal(param_norms(report, 0), reference_norms(ref, ref(x).square().mean()))


class PairInput(nn.Module):
    """A model whose one input is a pair: the case that needs targets=."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 10)
        self.b = nn.Linear(32, 10)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.a(pair[0]) * self.b(pair[1])


def test_targets_keyword_keeps_a_pair_as_the_models_input() -> None:
    torch.manual_seed(0)
    model = PairInput()
    ref = copy.deepcopy(model)
    (u, y), (v, _) = data(0), data(1)
    report = check(model, (u, v), F.cross_entropy, targets=y)
    expected = reference_norms(ref, F.cross_entropy(ref((u, v)), y))
    assert_norms_equal(param_norms(report, 0), expected)
    report = check(model, (u, v), lambda out: out.sum(), targets=None)
    assert_norms_equal(param_norms(report, 0), reference_norms(ref, ref((u, v)).sum()))


def test_a_deep_sigmoid_net_is_reported_vanishing_from_its_first_layer() -> None:
    torch.manual_seed(0)
    report = check(sigmoid_mlp(depth=12), data(n=32), F.cross_entropy, steps=2)
    found = report.findings()
    assert set(found["issue"]) == {"vanishing"}
    assert "0" in set(found["layer"])  # the first Linear
    with pytest.raises(AssertionError, match="gradient vanishes at '0'"):
        report.assert_healthy()


def test_watch_options_reach_the_watcher() -> None:
    torch.manual_seed(0)
    report = check(relu_mlp(depth=4, width=16), data(), F.cross_entropy, layers=["0", "6"],
                   outputs=False,
                   thresholds={"exploding_ratio": 0.001, "exploding_gain": 0.001})
    assert set(report.frame()["layer"]) == {"0", "6"}
    assert set(report.frame()["kind"]) == {"parameter"}
    assert report.thresholds.exploding_ratio == 0.001
    assert "exploding" in set(report.findings()["issue"])
