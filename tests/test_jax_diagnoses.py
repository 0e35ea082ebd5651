"""The core's diagnoses on JAX rows: vanishing, exploding, dead, nonfinite, cut_graph, and no
finding for a healthy model."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import graddebug  # noqa: E402
from jax_models import MLP, CutNet, batch, square_loss  # noqa: E402


def run(model, x, steps=3, loss=square_loss, **options):
    with graddebug.watch(model, **options) as dbg:
        step = nnx.jit(nnx.grad(loss))
        for _ in range(steps):
            dbg.step(step(model, x))
    return dbg


def issues(dbg):
    return set(dbg.findings()["issue"])


def test_a_stop_gradient_inside_a_module_is_named_as_a_cut_graph():
    dbg = run(CutNet(), batch())
    found = dbg.findings().query("issue == 'cut_graph'")
    assert "cut" in set(found["layer"])
    assert "first" not in set(dbg.frame().query("kind == 'activation'")["layer"])


def test_a_deep_sigmoid_stack_vanishes():
    model = MLP([4] + [32] * 12 + [1], act=jax.nn.sigmoid)
    assert "vanishing" in issues(run(model, batch()))


def test_large_weights_explode():
    model = MLP([4] + [64] * 6 + [1], act=lambda h: h)
    for layer in model.layers:
        layer.kernel.set_value(layer.kernel.get_value() * 12.0)
    assert "exploding" in issues(run(model, batch()))


def test_dead_relu_units_are_found():
    model = MLP([4, 32, 32, 1])
    model.layers[0].bias.set_value(jnp.full((32,), -50.0))
    assert "dead" in issues(run(model, batch()))


def test_nonfinite_is_born_at_the_layer_whose_forward_made_it():
    model = MLP([4, 8, 8, 1])

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    model.layers[1].kernel.set_value(model.layers[1].kernel.get_value() * jnp.inf)
    dbg = run(model, batch(), steps=1, loss=loss)
    found = dbg.findings().query("issue == 'nonfinite'")
    assert not found.empty
    assert found.iloc[0]["layer"] == "layers.1"


@pytest.mark.parametrize(("value", "word"), [(jnp.nan, "NaN"), (jnp.inf, "Inf")])
def test_nonfinite_says_whether_the_output_held_nan_or_inf(value, word):
    model = MLP([4, 8, 8, 1])
    # a bias of +inf makes every entry of the layer's output +inf, and none NaN
    model.layers[1].bias.set_value(jnp.full((8,), value))
    dbg = run(model, batch(), steps=1, loss=lambda m, x: jnp.mean(m(x) ** 2))
    found = dbg.findings().query("issue == 'nonfinite'")
    assert found.iloc[0]["layer"] == "layers.1"
    assert f"output held {word} in the forward pass" in found.iloc[0]["message"]


def _train_with_a_bad_batch(model, bad_step, value, steps=5, every=1):
    """A jitted loop whose batch at ``bad_step`` holds ``value`` in one entry; the model's
    input is the only source of the NaN/Inf."""
    grad = nnx.jit(nnx.grad(square_loss))
    with graddebug.watch(model, every=every) as dbg:
        for i in range(steps):
            x = jax.random.normal(jax.random.PRNGKey(i), (16, 4))
            if i == bad_step:
                x = x.at[3, 1].set(value)
            dbg.step(grad(model, x))
    return dbg


@pytest.mark.parametrize(("value", "word"), [(jnp.inf, "Inf"), (jnp.nan, "NaN")])
def test_a_bad_batch_is_blamed_on_the_data_at_its_step(value, word):
    dbg = _train_with_a_bad_batch(MLP([4, 8, 8, 1]), 2, value)
    events = dbg.events().query("event == 'input_nonfinite'")
    assert events[["step", "layer", "tensor", "detail"]].values.tolist() == [
        [2, "input", "args.0", word]]  # model(x): its first argument
    found = dbg.findings().query("issue == 'nonfinite'").iloc[0]
    assert (found["step"], found["cause"], found["layer"]) == (2, "data", "layers.0")


def test_a_model_that_makes_its_own_nan_from_a_finite_batch_is_not_blamed_on_the_data():
    model = MLP([4, 8, 8, 1])
    model.layers[1].bias.set_value(jnp.full((8,), jnp.nan))
    dbg = _train_with_a_bad_batch(model, -1, 0.0, steps=2)
    assert dbg.events().query("event == 'input_nonfinite'").empty
    found = dbg.findings().query("issue == 'nonfinite'").iloc[0]
    assert found["cause"] != "data" and found["layer"] == "layers.1"


def test_a_bad_batch_on_a_step_that_every_skips_leaves_no_event():
    dbg = _train_with_a_bad_batch(MLP([4, 8, 8, 1]), 1, jnp.inf, steps=4, every=2)
    assert dbg.events().query("event == 'input_nonfinite'").empty


def test_a_healthy_relu_net_has_no_finding():
    model = MLP([4, 64, 64, 64, 3], seed=2)
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 4))
    dbg = run(model, x, steps=5)
    assert dbg.findings().empty, dbg.findings()[["layer", "issue", "message"]]


def test_a_bad_batch_that_is_itself_differentiated_is_still_blamed_on_the_data():
    model = MLP([4, 8, 1])
    grad = nnx.jit(nnx.grad(square_loss, argnums=(0, 1)))  # a saliency map: dL/dx too
    with graddebug.watch(model) as dbg:
        for i in range(3):
            x = jax.random.normal(jax.random.PRNGKey(i), (16, 4))
            if i == 1:
                x = x.at[3, 1].set(jnp.inf)
            grads, _ = grad(model, x)
            dbg.step(grads)
    events = dbg.events().query("event == 'input_nonfinite'")
    assert events[["step", "tensor", "detail"]].values.tolist() == [[1, "args.0", "Inf"]]
