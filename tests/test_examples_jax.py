"""The JAX seed-scenario examples run, and their results match independent references:
``jax.grad`` on a fresh computation, finite differences in float64 numpy (``example_checks``),
and the layers the model's code cuts."""

from __future__ import annotations

import numpy as np
import pytest

from example_checks import Scenario, finite_difference_reference, run_example

pytest.importorskip("jax")
pytest.importorskip("flax.nnx")
pytest.importorskip("optax")


@pytest.fixture(scope="module")
def scenario2() -> Scenario:
    return run_example("jax", "scenario2_split_chain_rule")


@pytest.fixture(scope="module")
def scenario3() -> Scenario:
    return run_example("jax", "scenario3_cut_graph")


@pytest.fixture(scope="module")
def scenario4() -> Scenario:
    return run_example("jax", "scenario4_vanishing")


def test_the_vjp_with_dl_dh_equals_jax_grad_and_finite_differences(scenario2):
    _, result = scenario2
    fd = finite_difference_reference()
    np.testing.assert_allclose(result["vjp"], result["direct"], rtol=1e-6)
    np.testing.assert_allclose(result["x_t_g"], fd["dl_dw"], rtol=1e-4)
    np.testing.assert_allclose(result["dl_dh"], fd["dl_dh"], rtol=1e-4)
    assert not np.allclose(result["elementwise"], fd["dl_dw"], rtol=1e-2)


def test_the_tap_records_dl_dh_and_clipping_reaches_w(scenario2):
    namespace, result = scenario2
    fd = finite_difference_reference()
    row = result["plain"]["frame"].iloc[0]
    np.testing.assert_allclose(row["norm"], np.linalg.norm(fd["dl_dh"]), rtol=1e-4)
    g = fd["dl_dh"]
    clipped = g * min(1.0, namespace["CLIP_NORM"] / np.linalg.norm(g))
    x = np.array(namespace["X0"])
    np.testing.assert_allclose(result["clipped"]["dl_dw"], x.T @ clipped, rtol=1e-4)
    np.testing.assert_allclose(result["clipped"]["frame"].iloc[0]["pre_norm"],
                               np.linalg.norm(g), rtol=1e-4)


def test_stop_gradient_is_named_as_the_cut(scenario3):
    _, result = scenario3
    cuts = result["findings"].query("issue == 'cut_graph'")
    assert list(cuts["layer"]) == ["detach"]
    acts = set(result["frame"].query("kind == 'activation'")["layer"])
    assert "encoder" not in acts and {"detach", "head"} <= acts


def test_the_sigmoid_stack_vanishes_and_the_relu_net_is_healthy(scenario4):
    _, result = scenario4
    assert "vanishing" in set(result["vanishing"].findings()["issue"])
    assert result["healthy"].findings().empty
