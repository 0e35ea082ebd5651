"""The routes of the JAX transport (:class:`graddebug_jax.transport.Route`): each is taken where
the module's table says, and the rows it carries equal ``jax.grad``'s."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import graddebug  # noqa: E402
import graddebug_jax  # noqa: E402
from graddebug_jax.transport import Route, choose_route  # noqa: E402
from jax_models import MLP, batch, square_loss, train_step  # noqa: E402

SIZES = [4, 8, 8, 3]
STEPS = 2


def _references(model: MLP, x: jax.Array) -> tuple[list[float], dict[str, float]]:
    """The gradient norms at each Linear's output (the output perturbed by zeros, then
    differentiated) and of each parameter (``nnx.grad``), graddebug not watching."""
    def loss_of(zs: list[jax.Array]) -> jax.Array:
        h = x
        for i, layer in enumerate(model.layers):
            h = layer(h) + zs[i]
            if i < len(model.layers) - 1:
                h = model.act(h)
        return jax.numpy.mean(h ** 2)

    zeros = [jax.numpy.zeros((x.shape[0], b)) for b in SIZES[1:]]
    outputs = [float(np.linalg.norm(np.asarray(g))) for g in jax.grad(loss_of)(zeros)]
    grads = nnx.grad(square_loss)(model, x)
    params = {f"layers.{i}.{name}": float(np.linalg.norm(np.asarray(
        grads["layers"][i][name].get_value()))) for i in range(len(SIZES) - 1)
        for name in ("kernel", "bias")}
    return outputs, params


def _check_rows(dbg: graddebug.Watcher, model: MLP, x: jax.Array) -> None:
    """Every step's rows against the references (a learning rate of 0 keeps the weights)."""
    outputs, params = _references(model, x)
    frame = dbg.frame()
    assert sorted(set(frame["step"])) == list(range(STEPS))
    for step in range(STEPS):
        rows = frame.query(f"step == {step}")
        acts = rows.query("kind == 'activation'").set_index("layer")
        np.testing.assert_allclose(
            acts.loc[[f"layers.{i}" for i in range(len(SIZES) - 1)], "norm"], outputs,
            rtol=1e-5)
        grads = rows.query("kind == 'parameter'")
        got = {f"{r.layer}.{r.tensor}": r.norm for r in grads.itertuples()}
        assert got.keys() == params.keys()
        np.testing.assert_allclose([got[k] for k in params], list(params.values()), rtol=1e-5)


def _monitored(jit: bool, hand: str) -> tuple[graddebug.Watcher, MLP, jax.Array]:
    model, x = MLP(SIZES, seed=2), batch()
    tx = graddebug_jax.monitor(optax.adam(0.0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def eager(model: MLP, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(square_loss)(model, x)
        optimizer.update(model, grads)
        return loss

    step = train_step() if jit else eager
    with graddebug.watch(model, optimizer=optimizer if hand == "optimizer" else tx) as dbg:
        for _ in range(STEPS):
            step(model, optimizer, x)
            dbg.step()
    return dbg, model, x


def test_eager_parcels_are_held_and_fetched_by_the_close():
    dbg, model, x = _monitored(jit=False, hand="optimizer")
    assert dict(dbg.adapter.routes) == {Route.HELD: STEPS}  # one gather a step
    assert dbg.adapter.transfers == STEPS
    _check_rows(dbg, model, x)


def test_a_jitted_step_whose_nnx_optimizer_is_named_stores_its_rows_in_the_state():
    dbg, model, x = _monitored(jit=True, hand="optimizer")
    assert dict(dbg.adapter.routes) == {Route.STATE: 1}  # chosen once, when traced
    assert dbg.adapter.transfers == STEPS
    _check_rows(dbg, model, x)


def test_given_tx_alone_the_update_ties_one_callback_to_its_step_count():
    dbg, model, x = _monitored(jit=True, hand="tx")
    assert dict(dbg.adapter.routes) == {Route.TIED: 1}
    assert dbg.adapter.transfers == STEPS
    _check_rows(dbg, model, x)


def test_a_backward_pass_with_no_carrier_sends_its_rows_by_an_effectful_callback():
    model, x = MLP(SIZES, seed=2), batch()
    grad = nnx.jit(nnx.grad(square_loss))
    with graddebug.watch(model) as dbg:
        for _ in range(STEPS):
            dbg.step(grad(model, x))  # the gradients handed over are held, then fetched
    assert dict(dbg.adapter.routes) == {Route.EFFECT: 1}
    assert dbg.adapter.transfers == 2 * STEPS
    _check_rows(dbg, model, x)


@pytest.mark.parametrize(("traced", "fits_state", "tie", "route"), [
    (False, True, True, Route.HELD),
    (True, True, True, Route.STATE),
    (True, False, True, Route.TIED),
    (True, False, False, Route.EFFECT),
])
def test_the_route_is_chosen_in_the_order_of_the_table(traced, fits_state, tie, route):
    assert choose_route(traced=traced, fits_state=fits_state, tie=tie) is route


def test_the_jax_wing_reads_no_private_jax_api_and_no_stack_frame():
    import importlib.util
    from pathlib import Path

    keras_spec = importlib.util.find_spec("graddebug_keras")
    files = sorted(Path(graddebug_jax.__file__).parent.glob("*.py"))
    if keras_spec is not None and keras_spec.origin is not None:
        files.append(Path(keras_spec.origin).parent / "jax_backend.py")
    for path in files:
        text = path.read_text()
        for private in ("jax._src", "._trace", "_getframe", "f_locals", "jax.interpreters"):
            assert private not in text, f"{path.name} uses {private}"


@pytest.mark.parametrize(("hand", "route"), [("optimizer", Route.STATE), ("tx", Route.TIED)])
def test_either_route_leaves_the_weights_bitwise_those_of_plain_training(hand, route):
    x = batch()
    plain, watched = MLP([4, 32, 32, 3], seed=1), MLP([4, 32, 32, 3], seed=1)
    plain_opt = nnx.Optimizer(plain, optax.adam(1e-2), wrt=nnx.Param)
    tx = graddebug_jax.monitor(optax.adam(1e-2))
    watched_opt = nnx.Optimizer(watched, tx, wrt=nnx.Param)
    step = train_step()
    for _ in range(10):
        step(plain, plain_opt, x)
    with graddebug.watch(watched, optimizer=watched_opt if hand == "optimizer" else tx) as dbg:
        for _ in range(10):
            step(watched, watched_opt, x)
            dbg.step()
    assert set(dbg.adapter.routes) == {route}
    assert len(dbg.frame().query("kind == 'activation'")) == 3 * 10
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(plain, nnx.Param)),
                    jax.tree_util.tree_leaves(nnx.state(watched, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bug_landing_one_parcel_of_a_callback_loses_that_parcels_rows_only(monkeypatch):
    from graddebug.errors import GradDebugWarning
    from graddebug_jax.closing import StepRows

    def broken(self, sites, rows):
        raise ZeroDivisionError("planted in the layer rows")

    monkeypatch.setattr(StepRows, "add_layers", broken)
    with pytest.warns(GradDebugWarning, match="planted in the layer rows"):
        dbg, model, x = _monitored(jit=True, hand="tx")
    assert dict(dbg.adapter.routes) == {Route.TIED: 1}
    frame = dbg.frame()
    assert set(frame["kind"]) == {"parameter"}  # the update's rows landed all the same
    _, params = _references(model, x)
    last = frame.query(f"step == {STEPS - 1}")
    got = {f"{r.layer}.{r.tensor}": r.norm for r in last.itertuples()}
    np.testing.assert_allclose([got[k] for k in params], list(params.values()), rtol=1e-5)
    assert set(dbg.findings()["issue"]) == {"internal_error"}
