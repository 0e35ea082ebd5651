"""The PyTorch seed-scenario examples run, and their results match independent references.

Each example is loaded from ``examples/torch`` with ``runpy`` and its ``main()`` runs in this
process, once per module. References are computed without graddebug (here or in
``example_checks``): with
``torch.autograd`` on a fresh forward pass, with explicit per-stage Jacobians, or with finite
differences in float64 numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest

from example_checks import (
    X_SEED,
    Scenario,
    assert_early_layers_only,
    check_exploding,
    check_healthy,
    check_vanishing,
    finite_difference_reference,
    run_example,
)

torch = pytest.importorskip("torch")

@pytest.fixture(scope="module")
def scenario1() -> Scenario:
    return run_example("torch", "scenario1_layer_gradient")


@pytest.fixture(scope="module")
def scenario2() -> Scenario:
    return run_example("torch", "scenario2_split_chain_rule")


@pytest.fixture(scope="module")
def scenario3() -> Scenario:
    return run_example("torch", "scenario3_cut_graph")


@pytest.fixture(scope="module")
def scenario4() -> Scenario:
    return run_example("torch", "scenario4_vanishing_exploding")


# -- scenario 1: the gradient at layer_2 -----------------------------------------------------


def _layer2_autograd(model: Any, x: Any) -> np.ndarray:
    outputs: list[Any] = []
    handle = model.layer_2.register_forward_hook(lambda m, a, out: outputs.append(out))
    try:
        out = model(x)
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(out.sum(), outputs[0])
    return grad.numpy()


def test_scenario1_kept_gradient_equals_autograd_grad(scenario1: Scenario) -> None:
    namespace, result = scenario1
    model, x = namespace["build"]()
    reference = _layer2_autograd(model, x)
    kept = result["kept"]
    assert kept.shape == reference.shape == (x.shape[0], model.layer_2.out_features)
    assert np.abs(reference).max() > 0
    assert np.allclose(kept, reference, rtol=1e-6, atol=0)


def test_scenario1_kept_gradient_is_a_product_of_transposed_jacobians(
    scenario1: Scenario,
) -> None:
    namespace, result = scenario1
    model, x = namespace["build"]()
    stages: list[Callable[[Any], Any]] = [
        torch.tanh,
        model.layer_3,
        torch.tanh,
        model.layer_4,
        torch.tanh,
        model.layer_5,
    ]
    with torch.no_grad():
        z2 = model.layer_2(torch.tanh(model.layer_1(x)))
    for i in range(x.shape[0]):
        value, jacobians = z2[i].detach(), []
        for stage in stages:
            jacobians.append(torch.autograd.functional.jacobian(stage, value))
            value = stage(value).detach()
        g = torch.ones_like(value)  # d(sum)/d(output) for one sample
        for jacobian in reversed(jacobians):
            g = g @ jacobian
        assert np.allclose(result["kept"][i], g.numpy(), rtol=1e-5, atol=1e-7)
    assert np.allclose(result["chain_rule"], result["kept"], rtol=1e-5, atol=1e-7)


def test_scenario1_watching_leaves_parameter_gradients_unchanged(scenario1: Scenario) -> None:
    _, result = scenario1
    assert result["weight_grads_equal"] is True
    assert result["max_abs_diff"] == pytest.approx(0.0, abs=1e-7)
    frame = result["frame"]
    assert set(frame.loc[frame["kind"] == "activation", "layer"]) == {
        f"layer_{i}" for i in range(1, 6)
    }


# -- scenario 2: the split chain rule ----------------------------------------------------------

@pytest.fixture(scope="module")
def numeric() -> dict[str, np.ndarray]:
    return finite_difference_reference()


def test_scenario2_elementwise_product_is_not_the_chain_rule(
    scenario2: Scenario, numeric: dict[str, np.ndarray]
) -> None:
    _, result = scenario2
    assert np.allclose(result["direct"], numeric["dl_dw"], rtol=1e-4, atol=1e-9)
    assert result["elementwise"].shape == numeric["dl_dw"].shape
    assert not np.allclose(result["elementwise"], numeric["dl_dw"])
    assert not np.allclose(result["elementwise"], result["direct"])


def test_scenario2_vjp_is_the_chain_rule(
    scenario2: Scenario, numeric: dict[str, np.ndarray]
) -> None:
    _, result = scenario2
    assert np.allclose(result["dl_dh"], numeric["dl_dh"], rtol=1e-4, atol=1e-9)
    assert np.allclose(result["vjp"], numeric["dl_dw"], rtol=1e-4, atol=1e-9)
    assert np.allclose(result["vjp"], X_SEED.T @ numeric["dl_dh"], rtol=1e-4, atol=1e-9)
    assert np.allclose(result["vjp"], result["x_t_g"], rtol=1e-6)
    assert np.allclose(result["vjp"], result["direct"], rtol=1e-6)


def test_scenario2_clip_norm_at_the_tap_reaches_w(
    scenario2: Scenario, numeric: dict[str, np.ndarray]
) -> None:
    _, result = scenario2
    g = numeric["dl_dh"]
    c = result["clip_norm"]
    norm = float(np.linalg.norm(g))
    assert c < norm  # the example must actually clip
    clipped = g * (c / norm)
    run = result["clipped"]
    assert np.allclose(run["w_grad"], X_SEED.T @ clipped, rtol=1e-4, atol=1e-9)
    assert np.allclose(run["b_grad"], clipped.sum(axis=0), rtol=1e-4, atol=1e-9)
    assert not np.allclose(run["w_grad"], numeric["dl_dw"])
    assert run["pre_norm"] == pytest.approx(norm, rel=1e-5)
    assert run["norm"] == pytest.approx(c, rel=1e-5)


def test_scenario2_mask_at_the_tap_reaches_w(
    scenario2: Scenario, numeric: dict[str, np.ndarray]
) -> None:
    namespace, result = scenario2
    mask = np.array(namespace["MASK"], dtype=np.float64)
    assert 0 < mask.sum() < mask.size  # the mask must stop some gradient and pass some
    masked = numeric["dl_dh"] * mask
    run = result["masked"]
    assert np.allclose(run["w_grad"], X_SEED.T @ masked, rtol=1e-4, atol=1e-9)
    assert np.allclose(run["b_grad"], masked.sum(axis=0), rtol=1e-4, atol=1e-9)
    assert run["pre_norm"] == pytest.approx(np.linalg.norm(numeric["dl_dh"]), rel=1e-5)
    assert run["norm"] == pytest.approx(np.linalg.norm(masked), rel=1e-5)


# -- scenario 3: a cut graph -----------------------------------------------------------------


def _boundary_messages(findings: pd.DataFrame) -> list[str]:
    cuts = findings[findings["issue"] == "cut_graph"]
    return [m for m in cuts["message"] if "between" in m and "block1" in m and "block2" in m]


@pytest.mark.parametrize("variant", ["detach", "numpy", "functional"])
def test_scenario3_names_the_cut_between_block1_and_block2(
    scenario3: Scenario, variant: str
) -> None:
    _, result = scenario3
    findings = result[variant]
    messages = _boundary_messages(findings)
    assert len(messages) == 1, findings["message"].tolist()
    assert messages[0].index("block1") < messages[0].index("block2")
    assert "head" not in set(findings["layer"])
    starved = findings[(findings["issue"] == "cut_graph") & (findings["severity"] == "warning")]
    assert len(starved) == 1
    assert starved["layer"].iloc[0] in {"block1.0", "W1"}


def test_scenario3_block1_really_stops_learning(scenario3: Scenario) -> None:
    namespace, result = scenario3
    assert result["block1_frozen"] == {"detach": True, "numpy": True}
    # Control: the same network without the cut learns in block1 and raises no finding.
    findings, frozen = namespace["train_module"](lambda h: h, namespace["BLOCKS"])
    assert frozen is False
    assert findings.empty


# -- scenario 4: vanishing and exploding gradients -------------------------------------------


def _first_last_ratio(namespace: dict[str, Any], name: str) -> float:
    """||dL/d layer_1 output|| / ||dL/d layer_12 output|| at initialisation, without graddebug."""
    model = namespace["build"](name)
    _, shape, _ = namespace["MODELS"][name]
    x, y = namespace["batches"](shape, 1)[0]
    outputs: dict[str, Any] = {}
    handles = [
        getattr(model, layer).register_forward_hook(
            lambda m, a, out, layer=layer: outputs.__setitem__(layer, out)
        )
        for layer in ("layer_1", "layer_12")
    ]
    try:
        loss = torch.nn.functional.cross_entropy(model(x), y)
    finally:
        for handle in handles:
            handle.remove()
    first, last = torch.autograd.grad(loss, [outputs["layer_1"], outputs["layer_12"]])
    return float(first.norm() / last.norm())


def test_scenario4_sigmoid_net_vanishes_at_its_early_layers(scenario4: Scenario) -> None:
    check_vanishing(*scenario4, _first_last_ratio)


@pytest.mark.parametrize("name", ["relu_large_weights", "linear_large_weights"])
def test_scenario4_large_weights_explode(scenario4: Scenario, name: str) -> None:
    check_exploding(*scenario4, _first_last_ratio, name)


def test_scenario4_large_relu_weights_explode_towards_the_input(scenario4: Scenario) -> None:
    _, result = scenario4
    assert_early_layers_only(
        result["findings"]["relu_large_weights"], result["frames"]["relu_large_weights"]
    )


@pytest.mark.parametrize("name", ["relu_he_init", "small_resnet"])
def test_scenario4_healthy_networks_have_no_findings(scenario4: Scenario, name: str) -> None:
    check_healthy(*scenario4, _first_last_ratio, name)
