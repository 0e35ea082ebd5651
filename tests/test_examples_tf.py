"""The TensorFlow/Keras seed-scenario examples run, and their results match independent references.

Each example is loaded from ``examples/tf`` with ``runpy`` and its ``main()`` runs in this
process, once per module. References are computed without graddebug (here or in
``example_checks``): with
``tape.gradient`` on a fresh forward pass, with explicit per-stage Jacobians from
``tape.jacobian``, or with finite differences in float64 numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from example_checks import (
    B_SEED,
    W_SEED,
    X_SEED,
    Y0_SEED,
    Scenario,
    assert_early_layers_only,
    check_exploding,
    check_healthy,
    check_vanishing,
    finite_difference_reference,
    run_example,
)

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

@pytest.fixture(scope="module")
def scenario1() -> Scenario:
    return run_example("tf", "scenario1_layer_gradient")


@pytest.fixture(scope="module")
def scenario2() -> Scenario:
    return run_example("tf", "scenario2_split_chain_rule")


@pytest.fixture(scope="module")
def scenario3() -> Scenario:
    return run_example("tf", "scenario3_cut_graph")


@pytest.fixture(scope="module")
def scenario4() -> Scenario:
    return run_example("tf", "scenario4_vanishing_exploding")


# -- scenario 1: the gradient at layer_2 -----------------------------------------------------

AFTER_LAYER_2 = ["tanh_2", "layer_3", "tanh_3", "layer_4", "tanh_4", "layer_5"]


def _layer2_output(model: Any, x: Any) -> Any:
    """z_2, the Dense output of ``layer_2`` before ``tanh_2``, by calling the layers by hand."""
    return model.get_layer("layer_2")(model.get_layer("tanh_1")(model.get_layer("layer_1")(x)))


def _layer2_tape_gradient(model: Any, x: Any) -> np.ndarray:
    with tf.GradientTape() as tape:
        z2 = _layer2_output(model, x)
        out = z2
        for name in AFTER_LAYER_2:
            out = model.get_layer(name)(out)
        total = tf.reduce_sum(out)
    np.testing.assert_allclose(out.numpy(), model(x).numpy(), rtol=1e-6)  # same network
    return tape.gradient(total, z2).numpy()


def test_scenario1_kept_gradient_equals_tape_gradient(scenario1: Scenario) -> None:
    namespace, result = scenario1
    model, x = namespace["build"]()
    reference = _layer2_tape_gradient(model, x)
    kept = result["kept"]
    assert kept.shape == reference.shape == (x.shape[0], model.get_layer("layer_2").units)
    assert np.abs(reference).max() > 0
    np.testing.assert_allclose(kept, reference, rtol=1e-6, atol=1e-7)
    # The example's own references must agree with this one too.
    np.testing.assert_allclose(result["tf_gradients"], reference, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result["multi_output"], reference, rtol=1e-6, atol=1e-7)


def test_scenario1_kept_gradient_is_a_product_of_transposed_jacobians(
    scenario1: Scenario,
) -> None:
    namespace, result = scenario1
    model, x = namespace["build"]()
    value = _layer2_output(model, x)
    batch = int(x.shape[0])
    blocks = []  # per stage: (batch, out, in), one Jacobian per sample
    for name in AFTER_LAYER_2:
        with tf.GradientTape() as tape:
            tape.watch(value)
            out = model.get_layer(name)(value)
        jacobian = tape.jacobian(out, value).numpy()  # (batch, out, batch, in)
        diagonal = np.stack([jacobian[i, :, i, :] for i in range(batch)])
        off_diagonal = jacobian.copy()
        for i in range(batch):
            off_diagonal[i, :, i, :] = 0.0
        assert not off_diagonal.any()  # samples do not interact
        blocks.append(diagonal.astype(np.float64))
        value = out
    g = np.ones((batch, int(value.shape[1])))  # d(sum)/d(output)
    for block in reversed(blocks):
        g = np.einsum("bo,boi->bi", g, block)
    np.testing.assert_allclose(result["kept"], g, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(result["chain_rule"], g, rtol=1e-5, atol=1e-7)


def test_scenario1_watching_leaves_parameter_gradients_unchanged(scenario1: Scenario) -> None:
    namespace, result = scenario1
    assert result["weight_grads_equal"] is True
    assert result["max_abs_diff"] == pytest.approx(0.0, abs=1e-7)
    frame = result["frame"]
    activations = frame[frame["kind"] == "activation"].set_index("layer")
    assert set(activations.index) == {f"layer_{i}" for i in range(1, 6)} | {
        f"tanh_{i}" for i in range(1, 5)
    }
    model, x = namespace["build"]()
    reference = _layer2_tape_gradient(model, x)
    assert activations.loc["layer_2", "norm"] == pytest.approx(np.linalg.norm(reference), rel=1e-5)
    params = frame[frame["kind"] == "parameter"]
    assert len(params) == len(model.trainable_variables) == 10


# -- scenario 2: the split chain rule ----------------------------------------------------------

@pytest.fixture(scope="module")
def numeric() -> dict[str, np.ndarray]:
    return finite_difference_reference()


def test_scenario2_uses_the_shared_seed_values(scenario2: Scenario) -> None:
    namespace, _ = scenario2
    for name, want in (("W0", W_SEED), ("B0", B_SEED), ("X0", X_SEED), ("Y0", Y0_SEED)):
        np.testing.assert_array_equal(np.array(namespace[name]), want)


def test_scenario2_elementwise_product_is_not_the_chain_rule(
    scenario2: Scenario, numeric: dict[str, np.ndarray]
) -> None:
    _, result = scenario2
    np.testing.assert_allclose(result["direct"], numeric["dl_dw"], rtol=1e-4, atol=1e-9)
    assert result["elementwise"].shape == numeric["dl_dw"].shape
    assert not np.allclose(result["elementwise"], numeric["dl_dw"])
    assert not np.allclose(result["elementwise"], result["direct"])
    # What it does compute: dL/dh times the column sums of x, i.e. d(sum h)/dW.
    dh_dw = np.broadcast_to(X_SEED.sum(axis=0)[:, None], W_SEED.shape)
    np.testing.assert_allclose(result["elementwise"], numeric["dl_dh"] * dh_dw, rtol=1e-4)


def test_scenario2_vjp_is_the_chain_rule(
    scenario2: Scenario, numeric: dict[str, np.ndarray]
) -> None:
    _, result = scenario2
    np.testing.assert_allclose(result["dl_dh"], numeric["dl_dh"], rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(result["vjp"], numeric["dl_dw"], rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(result["vjp"], X_SEED.T @ numeric["dl_dh"], rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(result["vjp"], result["x_t_g"], rtol=1e-6)
    np.testing.assert_allclose(result["vjp"], result["direct"], rtol=1e-6)


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
    np.testing.assert_allclose(run["w_grad"], X_SEED.T @ clipped, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(run["b_grad"], clipped.sum(axis=0), rtol=1e-4, atol=1e-9)
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
    np.testing.assert_allclose(run["w_grad"], X_SEED.T @ masked, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(run["b_grad"], masked.sum(axis=0), rtol=1e-4, atol=1e-9)
    assert run["pre_norm"] == pytest.approx(np.linalg.norm(numeric["dl_dh"]), rel=1e-5)
    assert run["norm"] == pytest.approx(np.linalg.norm(masked), rel=1e-5)


# -- scenario 3: a cut graph -----------------------------------------------------------------

VARIANTS = ["stop_gradient", "numpy", "raw", "fit"]


def _boundary_messages(findings: pd.DataFrame) -> list[str]:
    cuts = findings[findings["issue"] == "cut_graph"]
    return [m for m in cuts["message"] if "between" in m and "block1" in m and "block2" in m]


def _starved(findings: pd.DataFrame) -> pd.DataFrame:
    return findings[(findings["issue"] == "cut_graph") & (findings["severity"] == "warning")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_scenario3_names_the_cut_between_block1_and_block2(
    scenario3: Scenario, variant: str
) -> None:
    _, result = scenario3
    findings = result[variant]
    assert set(findings["issue"]) == {"cut_graph"}
    messages = _boundary_messages(findings)
    assert len(messages) == 1, findings["message"].tolist()
    assert messages[0].index("block1") < messages[0].index("block2")
    assert "head" not in set(findings["layer"])
    starved = _starved(findings)
    assert len(starved) == 1
    if variant == "raw":
        assert starved["layer"].item() == "W1"
    else:
        assert starved["layer"].item() == "block1"
        assert "kernel, bias" in starved["message"].item()


@pytest.mark.parametrize("variant", ["stop_gradient", "numpy", "raw", "fit"])
def test_scenario3_starved_variables_are_counted_in_every_step(
    scenario3: Scenario, variant: str
) -> None:
    namespace, result = scenario3
    steps = namespace["STEPS"]
    assert f"in {steps} step(s)" in _starved(result[variant])["message"].item()


@pytest.mark.parametrize("cut", ["stop_gradient", "numpy_round_trip"])
def test_scenario3_the_cut_is_real(scenario3: Scenario, cut: str) -> None:
    namespace, _ = scenario3
    model = namespace["build"](namespace[cut])
    x, y = namespace["data"](1)[0]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = dict(
        zip(
            [v.path for v in model.trainable_variables],
            tape.gradient(loss, model.trainable_variables),
            strict=True,
        )
    )
    assert len(grads) == 6
    for path, grad in grads.items():
        if "/block1/" in path:
            assert grad is None, path
        else:
            assert grad is not None and np.abs(grad.numpy()).max() > 0, path


def test_scenario3_block1_really_stops_learning(scenario3: Scenario) -> None:
    namespace, result = scenario3
    assert result["block1_frozen"] == {"stop_gradient": True, "numpy": True, "fit": True}
    # Control: the same network without the cut learns in block1 and raises no finding.
    control = namespace["train_module"](namespace["no_cut"])
    assert control["frozen"] is False
    assert control["findings"].empty
    assert control["keras_warnings"] == []


@pytest.mark.parametrize("variant", ["stop_gradient", "numpy", "fit"])
def test_scenario3_keras_only_lists_the_variables(scenario3: Scenario, variant: str) -> None:
    _, result = scenario3
    said = result["keras_warnings"][variant]
    assert said
    assert all("block1/kernel" in m and "block1/bias" in m for m in said)
    assert not any("block2" in m for m in said)  # nothing about where the graph was cut


# -- scenario 4: vanishing and exploding gradients -------------------------------------------


def _first_last_ratio(namespace: dict[str, Any], name: str) -> float:
    """||dL/d layer_1 output|| / ||dL/d layer_12 output|| at initialisation, without graddebug."""
    model = namespace["build"](name)
    _, shape, _ = namespace["MODELS"][name]
    x, y = namespace["batches"](shape, 1)[0]
    probe = keras.Model(model.inputs, [model.get_layer(n).output for n in ("layer_1", "layer_12")])
    with tf.GradientTape() as tape:
        first, last = probe(x, training=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=last))
    g_first, g_last = tape.gradient(loss, [first, last])
    return float(tf.norm(g_first) / tf.norm(g_last))


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
