"""Host transfers of the JAX adapter: one per recorded step, counted, in each way a loop can
hand graddebug its gradients (eager and jitted, with and without the optax monitor)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import graddebug  # noqa: E402
import graddebug_jax  # noqa: E402
from graddebug.errors import GradDebugWarning  # noqa: E402
from graddebug_jax.transport import Route  # noqa: E402
from jax_models import MLP, batch, square_loss, train_step  # noqa: E402

STEPS = 4


def _monitored(jit: bool):
    """Train an MLP ``STEPS`` steps with the optax monitor; the Watcher, its transfers after
    each step, and the number of traces."""
    model, x = MLP([4, 8, 8, 3], seed=2), batch()
    tx = graddebug_jax.monitor(optax.sgd(0.1, momentum=0.9))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    traces = []

    def step(model, optimizer, x):
        traces.append(1)
        loss, grads = nnx.value_and_grad(square_loss)(model, x)
        optimizer.update(model, grads)
        return loss

    run = nnx.jit(step) if jit else step
    seen = []
    with graddebug.watch(model, optimizer=tx) as dbg:
        for _ in range(STEPS):
            run(model, optimizer, x)
            dbg.step()
            seen.append(dbg.adapter.transfers)
    return dbg, seen, len(traces)


@pytest.mark.parametrize("jit", [True, False], ids=["nnx.jit", "eager"])
def test_the_monitor_and_the_backward_pass_cross_to_the_host_once_a_step(jit):
    dbg, seen, traces = _monitored(jit)
    assert seen == list(range(1, STEPS + 1))
    assert traces == (1 if jit else STEPS)
    kinds = dbg.frame().groupby("step")["kind"].apply(lambda k: sorted(set(k)))
    assert all(k == ["activation", "parameter"] for k in kinds)


def test_eager_and_jitted_steps_record_the_same_numbers():
    jitted, _, _ = _monitored(True)
    eager, _, _ = _monitored(False)
    a, b = jitted.frame(), eager.frame()
    assert list(a["layer"]) == list(b["layer"]) and list(a["tensor"]) == list(b["tensor"])
    np.testing.assert_allclose(a["norm"], b["norm"], rtol=1e-5)
    np.testing.assert_allclose(a["update_norm"], b["update_norm"], rtol=1e-5)


def test_without_a_monitor_the_backward_pass_sends_its_rows_itself_once_a_step():
    model, x = MLP([4, 8, 8, 3], seed=2), batch()
    grad = nnx.jit(nnx.grad(square_loss))
    with graddebug.watch(model) as dbg:
        for i in range(STEPS):
            grad(model, x)
            dbg.step()
            assert dbg.adapter.transfers == i + 1
    # the rows of the layer outputs, against jax.grad of the loss as a function of them
    ref = jax.grad(lambda h: square_loss(lambda _: model.layers[2](
        model.act(h)), x))(model.layers[1](model.act(model.layers[0](x))))
    row = dbg.frame().query("layer == 'layers.1' and step == 0").iloc[0]
    np.testing.assert_allclose(row["norm"], np.linalg.norm(np.asarray(ref)), rtol=1e-5)


def test_eager_gradients_handed_to_step_are_fetched_with_the_layer_rows_in_one_transfer():
    model, x = MLP([4, 8, 3], seed=2), batch()
    with graddebug.watch(model) as dbg:
        for i in range(STEPS):
            grads = nnx.grad(square_loss)(model, x)
            dbg.step(grads)
            assert dbg.adapter.transfers == i + 1
    ref = nnx.grad(square_loss)(model, x)
    rows = dbg.frame().query("kind == 'parameter' and step == 0").set_index("layer")
    np.testing.assert_allclose(rows.query("tensor == 'kernel'").loc["layers.0", "norm"],
                               np.linalg.norm(np.asarray(ref["layers"][0]["kernel"].get_value())),
                               rtol=1e-5)


def test_jitted_gradients_handed_to_step_cost_a_second_transfer():
    # The backward pass's rows leave the compiled step in its callback; the gradients the
    # loop hands over afterwards are reduced and fetched by the close: two crossings, which
    # only an update inside the step (the monitor) can fold into one.
    model, x = MLP([4, 8, 3], seed=2), batch()
    grad = nnx.jit(nnx.grad(square_loss))
    with graddebug.watch(model) as dbg:
        for _ in range(STEPS):
            dbg.step(grad(model, x))
    assert dbg.adapter.transfers == 2 * STEPS
    assert len(dbg.frame().query("kind == 'parameter'")) == 4 * STEPS


def test_a_backward_pass_compiled_apart_from_the_monitor_warns_and_then_sends_its_rows():
    model, x = MLP([4, 8, 3], seed=2), batch()
    tx = graddebug_jax.monitor(optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grad = nnx.jit(nnx.grad(square_loss))
    update = nnx.jit(lambda optimizer, model, grads: optimizer.update(model, grads))
    with pytest.warns(GradDebugWarning, match="compiled apart"), \
            graddebug.watch(model, optimizer=tx) as dbg:
        for _ in range(STEPS):
            update(optimizer, model, grad(model, x))
            dbg.step()
    acts = dbg.frame().query("kind == 'activation'")
    # the first step's layer rows are lost with its compiled function; the retrace sends them
    assert sorted(set(acts["step"])) == list(range(1, STEPS))
    assert len(dbg.frame().query("kind == 'parameter'")) == 4 * STEPS


def test_without_chains_the_rows_leave_the_step_in_the_optimizers_state_once_a_step():
    model, x = MLP([4, 8, 8, 3], seed=2), batch()
    tx = graddebug_jax.monitor(optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    traces = []
    step = train_step(traces)
    with graddebug.watch(model, optimizer=optimizer, outputs=False) as dbg:
        for i in range(STEPS):
            step(model, optimizer, x)
            assert dbg.adapter.has_pending()
            dbg.step()
            assert dbg.adapter.transfers == i + 1 and not dbg.adapter.has_pending()
    assert len(traces) == 1
    assert graddebug_jax.updates.monitor_of(tx).layout is not None  # no callback
    # the state holds the last update's rows: the recorded norms are their square roots
    state = optimizer.opt_state
    assert isinstance(state, graddebug_jax.MonitorState)
    last = dbg.frame().query(f"step == {STEPS - 1}")
    np.testing.assert_allclose(np.sort(last["norm"].to_numpy() ** 2),
                               np.sort(np.asarray(state.rows.get_value())[:, 0]), rtol=1e-6)
    assert len(dbg.frame().query("kind == 'parameter'")) == 6 * STEPS


def test_the_state_path_records_what_the_callback_path_records():
    def run(keeper_named: bool):
        model, x = MLP([4, 8, 8, 3], seed=2), batch()
        tx = graddebug_jax.monitor(optax.sgd(0.1, momentum=0.9))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = train_step()
        with graddebug.watch(model, optimizer=optimizer if keeper_named else tx) as dbg:
            for _ in range(STEPS):
                step(model, optimizer, x)
                dbg.step()
        # sgd's state has no step count to tie a callback to: an effectful one, then
        assert set(dbg.adapter.routes) == {Route.STATE if keeper_named else Route.EFFECT}
        return dbg.frame().reset_index(drop=True)

    stored, sent = run(True), run(False)
    assert list(stored["layer"]) == list(sent["layer"])
    assert list(stored["tensor"]) == list(sent["tensor"])
    np.testing.assert_allclose(stored["norm"], sent["norm"], rtol=1e-6)
    np.testing.assert_allclose(stored["update_norm"], sent["update_norm"], rtol=1e-6)


def test_a_plain_optax_loop_keeps_its_state_and_sends_its_rows_by_callback_once_a_step():
    params = {"w": jax.numpy.ones((4, 3)), "b": jax.numpy.zeros((3,))}
    x = batch()
    tx = graddebug_jax.monitor(optax.adam(1e-2))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: jax.numpy.mean((x @ p["w"] + p["b"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with graddebug.watch(params=params, optimizer=tx) as dbg:
        for i in range(STEPS):
            params, opt_state = step(params, opt_state)
            dbg.step()
            assert dbg.adapter.transfers == i + 1
    assert len(dbg.frame().query("kind == 'parameter'")) == 2 * STEPS


@pytest.mark.parametrize(("value", "word"), [(np.inf, "Inf"), (np.nan, "NaN")])
def test_the_input_check_travels_in_the_optimizers_state_beside_the_rows(value, word):
    model = MLP([4, 8, 8, 1], seed=2)
    tx = graddebug_jax.monitor(optax.sgd(0.0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = train_step()
    with graddebug.watch(model, optimizer=optimizer, outputs=False) as dbg:
        for i in range(3):
            x = jax.random.normal(jax.random.PRNGKey(i), (16, 4))
            step(model, optimizer, x.at[3, 1].set(value) if i == 1 else x)
            dbg.step()
    assert graddebug_jax.updates.monitor_of(tx).layout is not None
    assert dbg.adapter.transfers == 3
    events = dbg.events().query("event == 'input_nonfinite'")
    assert events[["step", "tensor", "detail"]].values.tolist() == [[1, "args.0", word]]


def _full_run(sizes, batches, monkeypatch=None, room=None):
    """Train an MLP under one ``nnx.jit`` step with outputs watched, one step per batch; the
    frame, the transfers, and how many times the step sent parcels by callback when traced."""
    if room is not None:  # the room the optimizer's state gives, fixed when it is built
        monkeypatch.setattr(graddebug_jax.updates, "extra_size", lambda count: room)
    model = MLP(sizes, seed=2)
    tx = graddebug_jax.monitor(optax.sgd(0.05, momentum=0.9))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sends = []
    real_send = graddebug_jax.transport.send

    def counting_send(*args, **kwargs):
        sends.append(1)
        return real_send(*args, **kwargs)

    step = train_step()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graddebug_jax.transport, "send", counting_send)
        with graddebug.watch(model, optimizer=optimizer) as dbg:
            for x in batches:
                step(model, optimizer, x)
                dbg.step()
    return dbg, len(sends)


def _reference_rows(sizes, batches):
    """The layer-output gradient norms of the same training, eager and unwatched: each
    layer's output perturbed by zeros, differentiated with jax.grad."""
    model = MLP(sizes, seed=2)
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    norms = []
    for x in batches:
        def loss_of(zs, model=model, x=x):
            h = x
            for i, layer in enumerate(model.layers):
                h = layer(h) + zs[i]
                if i < len(model.layers) - 1:
                    h = model.act(h)
            return jax.numpy.mean(h ** 2)

        zeros = [jax.numpy.zeros((x.shape[0], b)) for b in sizes[1:]]
        norms.append([float(np.linalg.norm(np.asarray(g))) for g in jax.grad(loss_of)(zeros)])
        optimizer.update(model, nnx.grad(square_loss)(model, x))
    return norms


def _layer_norms(dbg, count):
    acts = dbg.frame().query("kind == 'activation' and layer.str.startswith('layers.')")
    return [list(acts.query(f"step == {s}").set_index("layer").loc[
        [f"layers.{i}" for i in range(count)], "norm"]) for s in sorted(set(acts["step"]))]


def test_the_layer_rows_leave_the_step_in_the_optimizers_state_with_no_callback():
    sizes, batches = [4, 8, 8, 3], [batch(seed=s) for s in range(STEPS)]
    dbg, sends = _full_run(sizes, batches)
    assert sends == 0  # traced once, and nothing went by callback
    assert dbg.adapter.transfers == STEPS
    np.testing.assert_allclose(_layer_norms(dbg, 3), _reference_rows(sizes, batches),
                               rtol=1e-5)


def test_a_chain_the_state_has_no_room_for_goes_by_callback_with_the_same_rows(monkeypatch):
    sizes, batches = [4, 8, 8, 3], [batch(seed=s) for s in range(STEPS)]
    dbg, sends = _full_run(sizes, batches, monkeypatch, room=16)
    assert sends == 1  # the one trace gathered its parcels into one callback
    assert dbg.adapter.transfers == STEPS
    np.testing.assert_allclose(_layer_norms(dbg, 3), _reference_rows(sizes, batches),
                               rtol=1e-5)
    assert len(dbg.frame().query("kind == 'parameter'")) == 6 * STEPS


def test_steps_compiled_for_two_batch_shapes_in_turn_land_each_with_its_own_layout():
    sizes = [4, 8, 8, 3]
    batches = [batch(n=6 if s % 2 else 11, seed=s) for s in range(2 * STEPS)]
    dbg, sends = _full_run(sizes, batches)
    assert sends == 0
    np.testing.assert_allclose(_layer_norms(dbg, 3), _reference_rows(sizes, batches),
                               rtol=1e-5)
    shapes = dbg.frame().query("layer == 'layers.0' and kind == 'activation'")["shape"]
    assert list(shapes) == ["(11, 8)", "(6, 8)"] * STEPS


@pytest.mark.parametrize(("handed", "sends"), [("optimizer", 0), ("tx", 1)])
def test_the_nnx_optimizer_handed_to_watch_keeps_the_rows_and_tx_alone_sends_them(
        handed, sends):
    # Nothing but the user says which object keeps a transformation's state: given tx, the
    # same rows go by one callback a step (traced once, so one send).
    model, x = MLP([4, 8, 8, 3], seed=2), batch()
    tx = graddebug_jax.monitor(optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sent = []
    real_send = graddebug_jax.transport.send
    step = train_step()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graddebug_jax.transport, "send", lambda *a, **k: sent.append(1) or
                      real_send(*a, **k))
        with graddebug.watch(model, optimizer=optimizer if handed == "optimizer" else tx
                             ) as dbg:
            for i in range(STEPS):
                step(model, optimizer, x)
                dbg.step()
                assert dbg.adapter.transfers == i + 1
    assert len(sent) == sends
    assert len(dbg.frame().query("kind == 'parameter'")) == 6 * STEPS
    assert len(dbg.frame().query("kind == 'activation'")) == 3 * STEPS  # layers.0-2


def test_after_the_with_block_the_step_traced_again_measures_nothing_and_sends_nothing():
    model, x = MLP([4, 8, 8, 3], seed=2), batch()
    twin = MLP([4, 8, 8, 3], seed=2)
    tx = graddebug_jax.monitor(optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    plain = nnx.Optimizer(twin, optax.adam(1e-3), wrt=nnx.Param)
    traces = []
    step = train_step(traces)
    with graddebug.watch(model, optimizer=tx) as dbg:
        for _ in range(2):
            step(model, optimizer, x)
            dbg.step()
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax.debug, "callback", lambda *a, **k: calls.append(1))
        patch.setattr(jax, "pure_callback", lambda *a, **k: calls.append(1))
        for _ in range(3):
            step(model, optimizer, x)
    assert len(traces) == 2 and calls == []  # traced again without the patches, no callback
    for _ in range(5):
        step(twin, plain, x)
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)),
                    jax.tree_util.tree_leaves(nnx.state(twin, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_step_compiled_before_a_watch_without_model_warns_that_it_measures_nothing():
    model, x = MLP([4, 8, 3], seed=2), batch()
    tx = graddebug_jax.monitor(optax.sgd(0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = train_step()
    step(model, optimizer, x)
    with pytest.warns(GradDebugWarning, match="compiled before watch"), \
            graddebug.watch(params={"w": jax.numpy.ones(3)}, optimizer=optimizer):
        pass


def test_a_bug_in_landing_the_stored_rows_is_an_internal_error_and_training_goes_on(
        monkeypatch):
    model, x = MLP([4, 8, 8, 3], seed=2), batch()
    tx = graddebug_jax.monitor(optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = train_step()

    def broken(layouts, values):
        raise RuntimeError("boom in landing")

    with pytest.warns(GradDebugWarning, match="boom in landing"), \
            graddebug.watch(model, optimizer=optimizer) as dbg:
        step(model, optimizer, x)
        dbg.step()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(graddebug_jax.updates, "_unstore", broken)
            step(model, optimizer, x)
            assert dbg.step().records == []  # the step's rows are lost, not the run
        step(model, optimizer, x)
        dbg.step()
    assert sorted(set(dbg.frame()["step"])) == [0, 2]
    assert list(dbg.findings()["issue"]) == ["internal_error"]
