"""Clip, mask and scale gradients in flight; checked against x.T @ modified(dL/dh) in numpy."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from graddebug import MaskShapeError  # noqa: E402


def seed_problem():
    W = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    b = torch.tensor([0.5, 0.5], requires_grad=True)
    x = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    y0 = torch.tensor([[0.8, 0.9], [0.7, 0.6]])
    return W, b, x, y0


def dl_dh_numpy(W, b, x, y0) -> np.ndarray:
    """dL/dh for L = mean((tanh(xW+b) - y0)^2), by hand in float64."""
    h = x.numpy().astype(np.float64) @ W.detach().numpy() + b.detach().numpy()
    y = np.tanh(h)
    return 2 * (y - y0.numpy()) / y.size * (1 - y**2)


def run_tapped(**intervention):
    W, b, x, y0 = seed_problem()
    with graddebug.watch(params={"W": W, "b": b}) as dbg:
        h = dbg.tap(x @ W + b, "h", **intervention)
        loss = (torch.tanh(h) - y0).square().mean()
        loss.backward()
        dbg.step()
    return W, b, x, y0, dbg


def clip_norm_np(g: np.ndarray, c: float) -> np.ndarray:
    return g * min(1.0, c / np.linalg.norm(g))


@pytest.mark.parametrize(
    ("options", "modify"),
    [
        ({"clip_norm": 0.01}, lambda g: clip_norm_np(g, 0.01)),
        ({"clip_value": 0.005}, lambda g: np.clip(g, -0.005, 0.005)),
        ({"mask": torch.tensor([[True, False], [False, True]])},
         lambda g: g * np.array([[1, 0], [0, 1]])),
        ({"mask": torch.tensor([[1.0, 0.0]])}, lambda g: g * np.array([[1, 0]])),
        ({"scale": -2.5}, lambda g: g * -2.5),
        ({"mask": lambda g: g.flip(0)}, lambda g: g[::-1]),
        ({"scale": 3.0, "clip_norm": 0.02}, lambda g: clip_norm_np(g * 3.0, 0.02)),
    ],
)
def test_tap_intervention_changes_dl_dw_by_the_vjp_formula(options, modify) -> None:
    W, b, x, y0, dbg = run_tapped(**options)
    g = dl_dh_numpy(W, b, x, y0)
    modified = modify(g)
    expected_w = x.numpy().astype(np.float64).T @ modified
    np.testing.assert_allclose(W.grad.numpy(), expected_w, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(b.grad.numpy(), modified.sum(0), rtol=1e-5, atol=1e-9)
    row = dbg.frame().query("layer == 'h'")
    assert row["pre_norm"].item() == pytest.approx(np.linalg.norm(g), rel=1e-5)
    assert row["norm"].item() == pytest.approx(np.linalg.norm(modified), rel=1e-5)


def test_elementwise_product_is_not_the_chain_rule_but_the_vjp_is() -> None:
    W, b, x, y0 = seed_problem()
    h = x @ W + b
    loss = (torch.tanh(h) - y0).square().mean()
    direct, = torch.autograd.grad(loss, W, retain_graph=True)
    dl_dh, = torch.autograd.grad(loss, h, retain_graph=True)
    dh_dw, = torch.autograd.grad(h.sum(), W, retain_graph=True)
    assert not np.allclose((dl_dh * dh_dw).numpy(), direct.numpy())
    vjp, = torch.autograd.grad(h, W, grad_outputs=dl_dh)
    np.testing.assert_allclose(vjp.numpy(), direct.numpy(), rtol=1e-6)
    np.testing.assert_allclose((x.T @ dl_dh).numpy(), direct.numpy(), rtol=1e-6)


def test_no_intervention_leaves_no_pre_norm_column() -> None:
    _, _, _, _, dbg = run_tapped()
    assert "pre_norm" not in dbg.frame().columns
    assert set(dbg.frame()["layer"]) == {"h", "W", "b"}
    assert set(dbg.frame().query("kind == 'parameter'")["tensor"]) == {"W", "b"}


def test_intervene_on_a_layer_output_and_record_pre_norm() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    # Reference: the gradient at layer 0's output, clipped by hand, pushed through W0.
    h = model[0](x)
    g, = torch.autograd.grad(model[2](model[1](h)).square().sum(), h)
    g = g.double().numpy()
    clipped = clip_norm_np(g, 0.1)
    with graddebug.watch(model, intervene={"0": {"clip_norm": 0.1}}) as dbg:
        model(x).square().sum().backward()
        dbg.step()
    np.testing.assert_allclose(model[0].weight.grad.numpy(), clipped.T @ x.double().numpy(),
                               rtol=1e-5)
    row = dbg.frame().query("layer == '0' and kind == 'activation'")
    assert row["pre_norm"].item() == pytest.approx(np.linalg.norm(g), rel=1e-5)
    assert row["norm"].item() == pytest.approx(0.1, rel=1e-5)
    others = dbg.frame().query("layer != '0'")
    assert others["pre_norm"].isna().all()


def test_interventions_act_on_steps_that_every_skips() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    with graddebug.watch(model, every=2, intervene={"0": {"scale": 0.0}}) as dbg:
        for _ in range(2):
            model.zero_grad()
            model(x).sum().backward()
            assert torch.count_nonzero(model[0].weight.grad) == 0
            dbg.step()


def test_mask_that_does_not_broadcast_names_layer_and_both_shapes() -> None:
    model = nn.Sequential(nn.Linear(3, 4))
    bad = torch.ones(3, 5, dtype=torch.bool)
    with pytest.raises(MaskShapeError, match=r"'0'.*\(3, 5\).*\(2, 4\)"), \
            graddebug.watch(model, intervene={"0": {"mask": bad}}):
        model(torch.randn(2, 3))


def test_a_later_tap_with_another_mask_that_does_not_fit_raises() -> None:
    W, b, x, _ = seed_problem()
    with graddebug.watch(params={"W": W}) as dbg:
        dbg.tap(x @ W + b, "h", mask=torch.ones(1, W.shape[1], dtype=torch.bool))
        with pytest.raises(MaskShapeError, match="'h'"):
            dbg.tap(x @ W + b, "h", mask=torch.ones(3, 5, dtype=torch.bool))


def test_mask_callable_returning_wrong_shape_raises() -> None:
    W, b, x, y0 = seed_problem()
    with graddebug.watch(params={"W": W}) as dbg:
        h = dbg.tap(x @ W + b, "h", mask=lambda g: g[:1])
        with pytest.raises(MaskShapeError, match="'h'"):
            (torch.tanh(h) - y0).square().mean().backward()


def test_float64_tap_with_clip_norm() -> None:
    W = torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    with graddebug.watch(params={"W": W}) as dbg:
        h = dbg.tap(x @ W, "h", clip_norm=0.1)
        h.sum().backward()  # dL/dh = [[1, 1]], norm sqrt(2)
        dbg.step()
    clipped = np.array([[1.0, 1.0]]) * 0.1 / np.sqrt(2)
    np.testing.assert_allclose(W.grad.numpy(), x.numpy().T @ clipped, rtol=1e-12)
    assert dbg.findings().empty
