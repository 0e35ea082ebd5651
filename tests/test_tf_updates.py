"""The optimizer's view in Keras (``graddebug_tensorflow.updates``): ``weight_norm`` and
``update_norm`` on parameter rows, and the loss rows of ``model.fit``.

References: exact norms of full numpy copies of every variable taken before and after each
step, and each batch's loss recomputed eagerly with the weights before that batch. Variables
taken whole must match to float64 rounding; sampled ones within the sampling error that
:mod:`graddebug_tensorflow.updates` documents (about ``0.45 / sqrt(k)`` for uniform entries,
k >= 1000 here: a tolerance of 8%, several standard deviations)."""

from __future__ import annotations

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from graddebug import sampling  # noqa: E402
from graddebug_tensorflow.updates import plan_samples  # noqa: E402

SAMPLED_REL = 0.08


def xent():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n: int = 80, features: int = 400, classes: int = 10):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n)


def mlp(name: str = "mlp") -> keras.Model:
    """A kernel large enough for k >= 1000 sampled entries, and small variables taken whole."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((400,)), keras.layers.Dense(256, activation="tanh"),
                             keras.layers.Dense(10)], name=name)


def snapshot(model) -> dict[str, np.ndarray]:
    return {"/".join(v.path.split("/")[-2:]): v.numpy().astype(np.float64)
            for v in model.trainable_variables}


def exact(before: dict[str, np.ndarray], after: dict[str, np.ndarray]):
    return {k: (np.linalg.norm(before[k]), np.linalg.norm(after[k] - before[k]))
            for k in before}


def param_rows(frame, step: int) -> dict[str, tuple[float, float]]:
    rows = frame[(frame["kind"] == "parameter") & (frame["step"] == step)]
    return {f"{r.layer}/{r.tensor}": (r.weight_norm, r.update_norm) for r in rows.itertuples()}


def whole(key: str, model) -> bool:
    """Whether the plan takes this variable whole (then the norms are exact)."""
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    keys = ["/".join(v.path.split("/")[-2:]) for v in model.trainable_variables]
    return {k: s.whole for k, s in zip(keys, plan_samples(shapes), strict=True)}[key]


def check(frame, want: list[dict[str, tuple[float, float]]], model) -> None:
    assert want
    for step, norms in enumerate(want):
        got = param_rows(frame, step)
        assert set(got) == set(norms)
        for key, (weight, update) in norms.items():
            rel = 1e-9 if whole(key, model) else SAMPLED_REL
            assert got[key][0] == pytest.approx(weight, rel=rel, abs=1e-12), (step, key)
            assert got[key][1] == pytest.approx(update, rel=rel, abs=1e-12), (step, key)


def tape_loop(model, opt, steps: int, compiled: bool):
    x, y = data()
    loss_fn = xent()

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    want = []
    with graddebug.watch(model, optimizer=opt) as dbg:
        step = tf.function(train_step) if compiled else train_step
        for _ in range(steps):
            before = snapshot(model)
            step(x, y)
            want.append(exact(before, snapshot(model)))
            dbg.step()
    return dbg.frame(), want


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_weight_and_update_norms_match_full_copies_in_a_tape_loop(optimizer, compiled):
    model = mlp()
    opt = (keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd"
           else keras.optimizers.Adam(1e-2))
    frame, want = tape_loop(model, opt, 3, compiled)
    check(frame, want, model)


def test_weight_and_update_norms_match_full_copies_under_fit():
    model = mlp("fit")
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=xent())
    x, y = data()
    want: list[dict[str, tuple[float, float]]] = []
    before: dict[str, np.ndarray] = {}

    class Reference(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            before.update(snapshot(self.model))

        def on_train_batch_end(self, batch, logs=None):
            want.append(exact(before, snapshot(self.model)))

    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                  callbacks=[Reference(), dbg.callback()])
    assert len(want) == 6
    check(dbg.frame(), want, model)


def test_a_variable_with_zero_gradients_gets_update_norm_zero():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((400,))  # wide enough that each kernel's sample holds 32 entries
    live = keras.layers.Dense(40, name="live")(inputs)
    dead = keras.layers.Dense(40, name="dead")(inputs)
    model = keras.Model(inputs, live + 0.0 * dead)  # dead's gradients are exactly zero
    for opt in (keras.optimizers.SGD(0.1), keras.optimizers.Adam(1e-2)):
        frame, want = tape_loop(model, opt, 2, compiled=True)
        for step in range(2):
            got = param_rows(frame, step)
            assert got["dead/kernel"][1] == 0.0 and got["dead/bias"][1] == 0.0
            assert got["dead/kernel"][0] > 0.0
            assert got["live/kernel"][1] > 0.0
            assert want[step]["dead/kernel"][1] == 0.0  # the reference agrees


def test_without_the_optimizer_the_close_samples_the_weights_and_leaves_the_update_nan():
    model = mlp()
    opt = keras.optimizers.SGD(0.1)
    x, y = data()
    with graddebug.watch(model) as dbg:
        with tf.GradientTape() as tape:
            loss = xent()(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        at_close = snapshot(model)
        dbg.step(grads)
    got = param_rows(dbg.frame(), 0)
    for key, weights in at_close.items():
        rel = 1e-9 if whole(key, model) else SAMPLED_REL
        assert got[key][0] == pytest.approx(np.linalg.norm(weights), rel=rel)
        assert math.isnan(got[key][1])


def test_the_samples_keep_to_the_budget_and_visit_every_column():
    shapes = [(400, 256), (256,), (256, 10), (10,), (3, 3, 64, 128), (128,), (1,)]
    sizes = [int(np.prod(s)) for s in shapes]
    plan = plan_samples(shapes)
    assert sum(s.count for s in plan) <= sampling.BUDGET * sum(sizes) + sampling.FLOOR * 7
    assert plan[3].whole and plan[6].whole  # small ones are taken whole
    assert [s.offset for s in plan] == [sum(s.count for s in plan[:i]) for i in range(7)]
    for shape, sample in zip(shapes, plan, strict=True):
        index = sample.indices()
        assert len(set(index.tolist())) == sample.count  # distinct
        assert index.min() >= 0 and index.max() < sample.numel
        if len(shape) >= 2 and sample.count >= shape[-1] and not sample.whole:
            # a prime stride coprime with the row length reaches every column
            assert len(set((index % shape[-1]).tolist())) == shape[-1]
    # However small the budget, every variable gets the floor or its whole.
    tiny = plan_samples([(50,), (50,), (30,)])
    assert all(s.whole for s in tiny)  # below the floor: whole


def test_fit_with_the_view_gives_bitwise_identical_weights():
    x, y = data()
    results = []
    for watched in (False, True):
        model = mlp("bitwise")
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=xent())
        if watched:
            with graddebug.watch(model) as dbg:
                model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                          callbacks=[dbg.callback()])
            frame = dbg.frame()
            assert frame[frame["kind"] == "parameter"]["update_norm"].notna().all()
        else:
            model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for plain, watched in zip(*results, strict=True):
        np.testing.assert_array_equal(plain, watched)


def test_fit_loss_rows_are_each_batch_loss_not_the_running_mean():
    model = mlp("losses")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=xent())
    x, y = data()  # 80 samples in batches of 32: the last batch of each epoch holds 16
    want: list[float] = []
    running: list[float] = []

    class Reference(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            start = batch * 32
            xb, yb = x[start:start + 32], y[start:start + 32]
            want.append(float(xent()(yb, self.model(xb, training=True))))

        def on_train_batch_end(self, batch, logs=None):
            running.append(float(logs["loss"]))

    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                  validation_data=(x[:16], y[:16]),  # evaluate's losses must not count
                  callbacks=[Reference(), dbg.callback()])
    frame = dbg.frame()
    loss = frame[frame["kind"] == "loss"].sort_values("step")
    assert loss["step"].tolist() == list(range(6))
    np.testing.assert_allclose(loss["mean"].to_numpy(), want, rtol=1e-6)
    # The reference tells the running mean apart from the batch's loss.
    assert not np.allclose(running, want, rtol=1e-4)


def test_sampled_norms_are_the_documented_estimator_on_the_documented_entries():
    model = mlp()
    opt = keras.optimizers.SGD(0.1)
    x, y = data()
    loss_fn = xent()
    plan = plan_samples([tuple(v.shape) for v in model.trainable_variables])
    keys = ["/".join(v.path.split("/")[-2:]) for v in model.trainable_variables]
    assert not plan[0].whole  # the kernel is sampled
    with graddebug.watch(model, optimizer=opt) as dbg:
        before = snapshot(model)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        after = snapshot(model)
        dbg.step()
    got = param_rows(dbg.frame(), 0)
    for key, sample in zip(keys, plan, strict=True):
        index = sample.indices()
        w = before[key].reshape(-1)[index]
        u = after[key].reshape(-1)[index] - w
        scale = math.sqrt(sample.numel / sample.count)
        assert got[key][0] == pytest.approx(np.linalg.norm(w) * scale, rel=1e-9)
        assert got[key][1] == pytest.approx(np.linalg.norm(u) * scale, rel=1e-9)


def test_no_variable_is_left_without_a_sample():
    # 0.5% of 1,520 entries is 7: the floor gives each 500-entry variable up to 256 entries.
    plan = plan_samples([(500,), (500,), (500,), (20,)])
    assert all(sampling.FLOOR // 2 < s.count <= sampling.FLOOR for s in plan[:3])
    assert plan[3].whole
