"""Captured cotangents and parameter gradients against jax.vjp / jax.grad, under jit."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import graddebug  # noqa: E402
import graddebug_jax  # noqa: E402
from graddebug.errors import ConfigError, GradientCountError, UnknownNameError  # noqa: E402
from jax_models import MLP, batch, linear_outputs, square_loss, train_step  # noqa: E402


def reference_cotangents(model, x):
    """dL/d(output) of every Linear, by jax.vjp of the loss as a function of that output."""
    refs = {}
    outs = linear_outputs(model, x)
    for k in range(len(model.layers)):
        def rest(h, k=k):
            for i in range(k + 1, len(model.layers)):
                h = model.layers[i](model.act(h))
            return jnp.mean(h ** 2)
        _, vjp = jax.vjp(rest, outs[k])
        refs[f"layers.{k}"] = np.asarray(vjp(jnp.float32(1.0))[0])
    return refs


def train(model, tx, x, steps, dbg=None):
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    traces = []
    step = train_step(traces)
    for _ in range(steps):
        loss = step(model, optimizer, x)
        if dbg is not None:
            dbg.step(loss=loss)
    return traces


def test_layer_rows_equal_jax_vjp_under_jit():
    model, x = MLP([4, 16, 16, 3]), batch()
    refs = reference_cotangents(model, x)
    tx = graddebug_jax.monitor(optax.sgd(0.0))
    with graddebug.watch(model, optimizer=tx) as dbg:
        train(model, tx, x, 1, dbg)
    acts = dbg.frame().query("kind == 'activation'").set_index("layer")
    assert list(acts.index) == ["layers.0", "layers.1", "layers.2"]
    for name, ref in refs.items():
        row = acts.loc[name]
        np.testing.assert_allclose(row["norm"], np.linalg.norm(ref), rtol=1e-5)
        np.testing.assert_allclose(row["mean"], ref.mean(), rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(row["absmax"], np.abs(ref).max(), rtol=1e-6)
        assert row["shape"] == str(ref.shape) and row["numel"] == ref.size
    assert list(acts["depth"]) == [0, 1, 2]


def test_parameter_rows_equal_jax_grad_with_weight_and_update_norms():
    model, x = MLP([4, 8, 3]), batch()
    params = nnx.state(model, nnx.Param)
    weights = {".".join(map(str, p)): np.asarray(v.get_value())
               for p, v in nnx.to_flat_state(params)}
    grads = nnx.grad(square_loss)(model, x)
    ref = {".".join(map(str, p)): np.asarray(v.get_value())
           for p, v in nnx.to_flat_state(grads)}
    tx = graddebug_jax.monitor(optax.sgd(0.1))
    with graddebug.watch(model, optimizer=tx, param_stats="full") as dbg:
        train(model, tx, x, 1, dbg)
    rows = dbg.frame().query("kind == 'parameter'")
    assert len(rows) == 4
    for row in rows.itertuples():
        key = f"{row.layer}.{row.tensor}"
        np.testing.assert_allclose(row.norm, np.linalg.norm(ref[key]), rtol=1e-5)
        np.testing.assert_allclose(row.mean, ref[key].mean(), rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(row.weight_norm, np.linalg.norm(weights[key]), rtol=1e-5)
        np.testing.assert_allclose(row.update_norm, 0.1 * np.linalg.norm(ref[key]), rtol=1e-5)


def test_large_weights_and_updates_are_measured_through_a_strided_sample():
    # A 64 x 64 kernel (4096 entries) is read at every stride-th entry of the plan every
    # adapter shares; the estimate is the sample's sum of squares times numel / taken. Its
    # gradient stays exact.
    from graddebug.sampling import plan

    model, x = MLP([4, 64, 64, 3]), batch()
    kernel = np.asarray(model.layers[1].kernel.get_value())
    grad = np.asarray(nnx.grad(square_loss)(model, x)["layers"][1]["kernel"].get_value())
    tx = graddebug_jax.monitor(optax.sgd(0.1))
    with graddebug.watch(model, optimizer=tx) as dbg:
        train(model, tx, x, 1, dbg)
    row = dbg.frame().query("kind == 'parameter' and layer == 'layers.1' "
                            "and tensor == 'kernel'").iloc[0]
    shapes = [np.shape(leaf) for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))]
    stride = plan(shapes)[shapes.index(kernel.shape)].stride
    assert stride > 1

    def estimate(a):
        part = a.ravel()[::stride].astype(np.float64)
        return np.sqrt((part ** 2).sum() * a.size / part.size)

    np.testing.assert_allclose(row.weight_norm, estimate(kernel), rtol=1e-5)
    np.testing.assert_allclose(row.update_norm, estimate(0.1 * grad), rtol=1e-5)
    # near the exact norms: within three times 1 / sqrt(taken), the estimate's relative error
    rtol = 3 / np.sqrt(len(range(0, kernel.size, stride)))
    np.testing.assert_allclose(row.weight_norm, np.linalg.norm(kernel), rtol=rtol)
    np.testing.assert_allclose(row.update_norm, 0.1 * np.linalg.norm(grad), rtol=rtol)
    np.testing.assert_allclose(row.norm, np.linalg.norm(grad), rtol=1e-5)


def test_no_observer_effect_weights_bitwise_identical_after_10_steps():
    x = batch()
    plain, watched = MLP([4, 32, 32, 3], seed=1), MLP([4, 32, 32, 3], seed=1)
    train(plain, optax.adam(1e-2), x, 10)
    tx = graddebug_jax.monitor(optax.adam(1e-2))
    with graddebug.watch(watched, optimizer=tx) as dbg:
        train(watched, tx, x, 10, dbg)
    assert len(dbg.frame()) > 0
    for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(plain, nnx.Param)),
                              nnx.to_flat_state(nnx.state(watched, nnx.Param)), strict=True):
        assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))


def test_jit_traces_once_and_one_transfer_per_step():
    model, x = MLP([4, 8, 8, 3]), batch()
    tx = graddebug_jax.monitor(optax.adam(1e-3))
    with graddebug.watch(model, optimizer=tx) as dbg:
        traces = train(model, tx, x, 5, dbg)
        transfers = dbg.adapter.transfers
    assert len(traces) == 1
    # The optimizer update carries the backward pass's layer rows with its own.
    assert transfers == 5
    frame = dbg.frame()
    assert frame["step"].nunique() == 5
    assert (frame.groupby("step")["kind"].apply(set) == {"activation", "parameter", "loss"}).all()


def test_taps_alone_cost_one_transfer_per_step_under_jit():
    w = jnp.ones((3, 4))
    x = batch(features=3)

    with graddebug.watch() as dbg:
        def loss(w):
            h = dbg.tap(x @ w, "h")
            g = dbg.tap(jnp.tanh(h), "g")
            return jnp.sum(g ** 2)

        step = jax.jit(jax.grad(loss))
        for _ in range(4):
            step(w)
            dbg.step()
        assert dbg.adapter.transfers == 4
    _, vjp = jax.vjp(lambda h: jnp.sum(jnp.tanh(h) ** 2), x @ w)
    ref = np.asarray(vjp(jnp.float32(1.0))[0])
    rows = dbg.frame().query("layer == 'h'")
    assert len(rows) == 4
    np.testing.assert_allclose(rows["norm"], np.linalg.norm(ref), rtol=1e-5)


def test_step_with_a_pytree_of_grads_names_them_by_path():
    w = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
    x = batch(features=3)
    grads = jax.grad(lambda p: jnp.sum((x @ p["dense"]["kernel"] + p["dense"]["bias"]) ** 2))(w)
    with graddebug.watch(params={"dense.kernel": w["dense"]["kernel"]}) as dbg:
        dbg.step(grads)
    rows = dbg.frame().set_index("tensor")  # a params= key names its row; others by path
    assert rows.loc["dense.kernel", "layer"] == "dense.kernel"
    np.testing.assert_allclose(rows.loc["dense.kernel", "norm"],
                               np.linalg.norm(np.asarray(grads["dense"]["kernel"])), rtol=1e-6)
    assert rows.loc["bias", "layer"] == "dense"


def test_params_list_of_the_wrong_length_raises_a_typed_error():
    w, b = jnp.ones((3, 2)), jnp.zeros(2)
    with pytest.raises(GradientCountError, match=r"2 params="), \
            graddebug.watch(params={"W": w, "b": b}) as dbg:
        dbg.step([w])


def test_unknown_layer_name_raises_and_names_close_matches():
    with pytest.raises(UnknownNameError, match=r"layers\.0"), \
            graddebug.watch(MLP([4, 8, 3]), layers=["layers.O"]):
        pass


def test_optimizer_without_monitor_is_refused():
    with pytest.raises(ConfigError, match=r"graddebug_jax\.monitor"), \
            graddebug.watch(MLP([4, 8, 3]), optimizer=optax.adam(1e-3)):
        pass


def test_a_tap_on_a_3d_array_gets_its_absmax_and_dead_units_against_numpy():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 5)), jnp.float32)
    w = jnp.ones((5,)).at[1].set(0.0).at[4].set(0.0)  # units 1 and 4 get no gradient

    with graddebug.watch() as dbg:
        def loss(x):
            h = dbg.tap(x * 2.0, "h")
            return jnp.sum(jnp.sin(h) * w)

        jax.jit(jax.grad(loss))(x)
        dbg.step()
    ref = np.asarray(jnp.cos(x * 2.0) * w)  # dL/dh
    row = dbg.frame().iloc[0]
    np.testing.assert_allclose(row["absmax"], np.abs(ref).max(), rtol=1e-6)
    assert np.mean(np.all(ref == 0, axis=(0, 1))) == 0.4
    assert row["zero_frac"] == pytest.approx(0.4, rel=1e-6)  # float32 on the device
    np.testing.assert_allclose(row["norm"], np.linalg.norm(ref), rtol=1e-5)
