"""Eager capture's cheaper paths: the sentinel rows measured by single ops (``EagerRows``), the
row writers called through their traces' flat entry points (``FlatWriter``), and the recording
identity recorded on the tape directly."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
import graddebug_tensorflow.watching as tf_watching  # noqa: E402
from graddebug_tensorflow.eagerrows import EagerRows  # noqa: E402
from graddebug_tensorflow.stats import (  # noqa: E402
    ACT_WIDTH,
    Col,
    FlatWriter,
    compiled,
    write_activation,
    write_forward,
)
from tf_models import relu_mlp  # noqa: E402

_ACTIVATION = compiled(write_activation)
_FORWARD = compiled(write_forward)


def _rows() -> tuple[tf.Variable, tf.Variable]:
    return (tf.Variable(tf.zeros([8, ACT_WIDTH], tf.float64)),
            tf.Variable(tf.zeros([8, ACT_WIDTH], tf.float64)))


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize(("shape", "axis"), [((16, 24), 1), ((4, 5, 6), 2), ((30,), None)])
def test_a_flat_call_writes_the_row_the_function_writes(full, shape, axis):
    writer = FlatWriter(_ACTIVATION)
    forward = FlatWriter(_FORWARD)
    flat, reference = _rows()
    grad = tf.random.stateless_normal(shape, seed=[1, len(shape)])
    for row in (0, 5):  # the same trace serves every row
        writer(flat, tf.constant(row), grad * (row + 1), None, axis, None, full)
        _ACTIVATION(reference, tf.constant(row), grad * (row + 1), None, axis, None, full)
        forward(flat, tf.constant(row), grad, row == 0)
        _FORWARD(reference, tf.constant(row), grad, row == 0)
    np.testing.assert_array_equal(flat.numpy(), reference.numpy())
    # The statistics themselves, against numpy.
    g = grad.numpy().astype(np.float64) * 6
    np.testing.assert_allclose(flat.numpy()[5, Col.SQ], np.sum(g * g), rtol=1e-5)
    np.testing.assert_allclose(flat.numpy()[5, Col.SUM], np.sum(g), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(flat.numpy()[0, Col.FWD_SUM], np.sum(grad.numpy()), rtol=1e-4,
                               atol=1e-4)


def test_a_flat_call_traces_once_per_shape_and_flags():
    writer = FlatWriter(compiled(write_activation))  # a function of its own, to count traces
    var, _ = _rows()
    grad = tf.ones((3, 7))
    for row in range(4):
        writer(var, tf.constant(row), grad, None, 1, None, False)
    writer(var, tf.constant(0), grad, None, 1, None, True)
    assert writer.function.experimental_get_tracing_count() == 2
    writer(var, tf.constant(1), grad * 2, None, 1, None, True)
    assert writer.function.experimental_get_tracing_count() == 2


def test_a_tensor_among_the_arguments_goes_through_the_function():
    writer = FlatWriter(_ACTIVATION)
    flat, reference = _rows()
    grad = tf.fill((4, 3), 2.0)
    pre = tf.fill((4, 3), 4.0)
    scale = tf.constant(2.0, tf.float64)
    writer(flat, tf.constant(2), grad, pre, 1, scale, True)
    _ACTIVATION(reference, tf.constant(2), grad, pre, 1, scale, True)
    np.testing.assert_array_equal(flat.numpy(), reference.numpy())
    # Unscaled by 2: each of the 12 entries is 1, their pre-intervention values 2.
    assert flat.numpy()[2, Col.SQ] == pytest.approx(12.0)
    assert flat.numpy()[2, Col.PRE_SQ] == pytest.approx(48.0)


def test_inside_a_tf_function_it_writes_as_the_function_does():
    writer = FlatWriter(_FORWARD)
    flat, reference = _rows()

    @tf.function
    def both(x):
        writer(flat, tf.constant(3), x, True)
        _FORWARD(reference, tf.constant(3), x, True)

    both(tf.fill((2, 2), 1.5))
    np.testing.assert_array_equal(flat.numpy(), reference.numpy())
    assert flat.numpy()[3, Col.FWD_SUM] == pytest.approx(6.0)


def test_the_eager_identity_passes_the_gradient_on_and_hands_it_to_its_hook():
    x = tf.Variable([[1.0, -2.0], [3.0, 0.5]])
    seen = []

    def hook(dy):
        seen.append(dy.numpy())
        return dy * 3.0

    with tf.GradientTape() as tape:
        h = x * 2.0
        out = tf_watching._eager_identity(h, hook)
        loss = tf.reduce_sum(tf.square(out))
    grad = tape.gradient(loss, x)
    # d loss / d out = 2 * out = 4x; the hook triples it; d h / d x = 2.
    np.testing.assert_allclose(seen[0], 4 * x.numpy())
    np.testing.assert_allclose(grad.numpy(), 2 * 3 * 4 * x.numpy())
    np.testing.assert_array_equal(out.numpy(), h.numpy())


@pytest.mark.parametrize("compiled_step", [False, True])
def test_watched_outputs_match_tape_gradient_eager_and_compiled(compiled_step):
    keras.utils.set_random_seed(3)
    model = relu_mlp(depth=3, width=12, inputs=9, classes=4)
    probe = keras.Model(model.inputs, [layer.output for layer in model.layers[1:]])
    x = tf.random.stateless_normal((5, 9), seed=[4, 2])
    with tf.GradientTape() as tape:
        outs = probe(x, training=True)
        loss = tf.reduce_mean(tf.square(outs[-1]))
    want = tape.gradient(loss, [*outs, *model.trainable_variables])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    with graddebug.watch(model) as dbg:
        grads = (tf.function(step) if compiled_step else step)()
        dbg.step(grads)
    for got, ref in zip(grads, want[len(outs):], strict=True):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5, atol=1e-7)
    frame = dbg.frame()
    acts = frame[frame["kind"] == "activation"].set_index("layer")
    names = [layer.name for layer in model.layers[1:]]
    for name, ref in zip(names, want[: len(outs)], strict=True):
        assert acts.loc[name, "norm"] == pytest.approx(np.linalg.norm(ref.numpy()), rel=1e-5)


def _cut_after_relu() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    relu = keras.layers.ReLU(name="r1")(keras.layers.Dense(8, name="d1")(inputs))
    cut = keras.layers.Lambda(tf.stop_gradient, name="cut")(relu)
    side = keras.layers.Dense(8, name="d2")(inputs)
    out = keras.layers.Dense(3, name="head")(keras.layers.Add(name="add")([cut, side]))
    return keras.Model(inputs, out)


@pytest.mark.parametrize("compiled_step", [False, True])
def test_a_layer_with_no_forward_check_that_ran_but_got_no_gradient_is_unreached(compiled_step):
    # ReLU has no finiteness check: eagerly, its forward flag is noted by EagerRows and written
    # into the buffers when the step is read.
    model = _cut_after_relu()
    x = tf.ones((4, 6))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    with graddebug.watch(model) as dbg:
        for _ in range(2):
            dbg.step((tf.function(step) if compiled_step else step)())
    events = dbg.events()
    unreached = events[events["event"] == "unreached"]
    assert sorted(unreached["layer"]) == ["d1", "d1", "r1", "r1"]
    assert sorted(unreached["step"]) == [0, 0, 1, 1]
    assert not {"r1", "d1"} & set(dbg.frame()["layer"])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(16, 24), (4, 5, 6), (30,), (), (2, 1, 3, 1, 2, 1, 4)])
def test_eager_rows_write_what_the_writers_write_on_a_sentinel_step(dtype, shape):
    rows = EagerRows()
    fast, reference = _rows()
    grad = tf.cast(tf.random.stateless_normal(shape, seed=[2, len(shape)]) * 3.0, dtype)
    out = tf.cast(tf.random.stateless_normal(shape, seed=[5, len(shape)]), dtype)
    for row in (1, 6):
        assert rows.forward(fast, row, out * row, True)
        assert rows.backward(fast, row, grad * row)
        _FORWARD(reference, tf.constant(row), out * row, True)
        _ACTIVATION(reference, tf.constant(row), grad * row, None, None, None, False)
    assert rows.forward(fast, 3, out, False)  # a layer with no forward check: the flag alone
    _FORWARD(reference, tf.constant(3), out, False)
    assert not fast.numpy().any()  # nothing is written before the flush
    rows.flush()
    np.testing.assert_array_equal(fast.numpy(), reference.numpy())  # NaN where the writer's
    assert not rows  # flushed rows are forgotten
    # The values themselves, against numpy on the same (rounded) entries.
    g = (grad * 6).numpy().astype(np.float64)
    written = fast.numpy()[6]
    assert written[Col.SQ] == pytest.approx(np.sum(g * g), rel=1e-5)
    assert written[Col.SUM] == pytest.approx(np.sum(g), rel=1e-4, abs=1e-4 * np.abs(g).sum())
    assert written[Col.FWD_SUM] == pytest.approx(
        np.sum((out * 6).numpy().astype(np.float64)), rel=1e-4, abs=1e-3 * len(g.flat))
    assert written[Col.NUMEL] == g.size and written[Col.RANK] == len(shape)
    assert list(written[Col.DIMS:]) == [*shape[:6], *[0] * (6 - min(len(shape), 6))]
    assert list(fast.numpy()[3, : Col.BWD]) == [1.0, 0.0]


def test_eager_rows_leave_other_dtypes_and_graphs_to_the_writers():
    rows = EagerRows()
    var, _ = _rows()
    assert not rows.backward(var, 0, tf.ones((2, 3), tf.float64))
    assert not rows.forward(var, 0, tf.ones((2, 3), tf.float64), True)
    answers = []

    @tf.function
    def traced(x):
        answers.append((rows.backward(var, 1, x), rows.forward(var, 1, x, True)))
        return x

    traced(tf.ones((2, 3)))
    assert answers == [(False, False)]
    assert not rows
    rows.flush()
    assert not var.numpy().any()


def test_eager_rows_keep_the_later_write_of_a_cell_and_forget_on_clear():
    rows = EagerRows()
    var, _ = _rows()
    rows.backward(var, 2, tf.fill((2, 2), 1.0))
    rows.backward(var, 2, tf.fill((2, 2), 3.0))  # a second backward pass through the call
    rows.flush()
    assert var.numpy()[2, Col.SQ] == 36.0 and var.numpy()[2, Col.SUM] == 12.0
    rows.backward(var, 4, tf.fill((2, 2), 1.0))
    rows.clear()
    rows.flush()
    assert not var.numpy()[4].any()


def test_eager_sentinel_steps_call_no_writer(monkeypatch):
    calls = {"forward": 0, "activation": 0}

    def counting(name, writer):
        def call(*args):
            calls[name] += 1
            return writer(*args)
        return call

    monkeypatch.setattr(tf_watching, "_write_forward",
                        counting("forward", tf_watching._write_forward))
    monkeypatch.setattr(tf_watching, "_write_activation",
                        counting("activation", tf_watching._write_activation))
    keras.utils.set_random_seed(1)
    model = relu_mlp(depth=2, width=8, inputs=5, classes=3)
    x = tf.random.stateless_normal((4, 5), seed=[1, 1])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    with graddebug.watch(model) as dbg:
        dbg.step(step())  # step 0 measures everything: through the writer
        full = calls["activation"]
        dbg.step(step())
        dbg.step(step())
    assert full == len({r for r in dbg.frame().query("kind == 'activation'")["layer"]})
    assert calls == {"forward": 0, "activation": full}


def test_an_eager_sentinel_step_left_open_is_kept_when_the_watcher_exits():
    keras.utils.set_random_seed(2)
    model = relu_mlp(depth=2, width=8, inputs=5, classes=3)
    probe = keras.Model(model.inputs, [layer.output for layer in model.layers])
    x = tf.random.stateless_normal((4, 5), seed=[3, 1])
    with tf.GradientTape() as tape:
        outs = probe(x, training=True)
        loss = tf.reduce_mean(tf.square(outs[-1]))
    want = dict(zip([layer.name for layer in model.layers], tape.gradient(loss, outs),
                    strict=True))
    # The exit closes step 1 without parameter gradients, and says so.
    with pytest.warns(graddebug.GradDebugWarning, match="no parameter gradients"), \
            graddebug.watch(model) as dbg:
        for closed in (True, False):  # step 1, a sentinel step, is never closed by dbg.step
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            if closed:
                dbg.step(grads)
    acts = dbg.frame().query("kind == 'activation' and step == 1").set_index("layer")
    assert set(acts.index) == set(want)
    for name, ref in want.items():
        assert acts.loc[name, "norm"] == pytest.approx(np.linalg.norm(ref.numpy()), rel=1e-5)
        assert np.isnan(acts.loc[name, "absmax"])  # a sentinel step


def test_fit_run_eagerly_records_sentinel_steps_as_tape_gradient_gives_them():
    keras.utils.set_random_seed(4)
    model = relu_mlp(depth=2, width=8, inputs=5, classes=3)
    loss_fn = keras.losses.MeanSquaredError()
    # A learning rate of 0 keeps the weights, so that one reference serves every step.
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss_fn, run_eagerly=True)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((12, 5)).astype(np.float32)
    y = rng.standard_normal((12, 3)).astype(np.float32)
    probe = keras.Model(model.inputs, [layer.output for layer in model.layers])
    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[dbg.callback()])
    acts = dbg.frame().query("kind == 'activation'")
    assert sorted(set(acts["step"])) == [0, 1, 2]
    for step in range(3):
        with tf.GradientTape() as tape:
            outs = probe([x[4 * step: 4 * step + 4]], training=True)
            loss = loss_fn(y[4 * step: 4 * step + 4], outs[-1])
        want = tape.gradient(loss, outs)
        rows = acts[acts["step"] == step].set_index("layer")
        for layer, ref in zip(model.layers, want, strict=True):
            g = ref.numpy().astype(np.float64)
            assert rows.loc[layer.name, "norm"] == pytest.approx(np.linalg.norm(g), rel=1e-5)
            assert rows.loc[layer.name, "mean"] == pytest.approx(
                g.mean(), rel=1e-4, abs=1e-6 * np.abs(g).max())
            assert np.isnan(rows.loc[layer.name, "absmax"]) == (step > 0)  # sentinel steps
