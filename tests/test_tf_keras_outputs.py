"""Watching a Keras model leaves its loss and weights unchanged, softmax heads included, and
parameter-free first layers traced by ``fit`` are not reported as cut off."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402


def softmax_head(seed: int = 0) -> keras.Sequential:
    """A classifier whose last Dense applies softmax: Keras losses read its ``_keras_logits``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", name="hidden"),
        keras.layers.Dense(10, activation="softmax", name="predictions"),
    ])


def padded_cnn(seed: int = 0) -> keras.Sequential:
    """ZeroPadding2D first, as ResNet50's ``conv1_pad`` and EfficientNet's stem padding."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.ZeroPadding2D(1, name="pad"),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.GlobalAveragePooling2D(name="gap"),
        keras.layers.Dense(10, activation="softmax", name="predictions"),
    ])


def bn_cnn(seed: int = 0) -> keras.Sequential:
    """Conv, BatchNormalization, ReLU twice, as in ResNet50: in a graph TF fuses a batch norm's
    backward with its neighbours unless something else reads its tensors."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((8, 8, 3))]
    for i, width in enumerate((8, 16)):
        layers += [keras.layers.Conv2D(width, 3, padding="same", name=f"conv{i}"),
                   keras.layers.BatchNormalization(name=f"bn{i}"),
                   keras.layers.Activation("relu", name=f"relu{i}")]
    return keras.Sequential([*layers, keras.layers.GlobalAveragePooling2D(name="gap"),
                             keras.layers.Dense(10, activation="softmax", name="predictions")])


def data(shape: tuple[int, ...] = (8,), n: int = 32, scale: float = 30.0):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, *shape)) * scale).astype(np.float32)
    return x, rng.integers(0, 10, n)


def loss_and_grad_norm(model, x, y):
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy()(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), [g.numpy() for g in grads]


def test_softmax_head_loss_is_computed_from_the_logits_as_unwatched():
    x, y = data()  # inputs x30 saturate the softmax: log(clip(p)) and the logits rule differ
    plain_loss, plain_grads = loss_and_grad_norm(softmax_head(), x, y)
    model = softmax_head()
    with graddebug.watch(model) as dbg:
        loss, grads = loss_and_grad_norm(model, x, y)
        dbg.step([tf.constant(g) for g in grads])
    # The logits rule, written out in numpy: mean(logsumexp(z) - z[y]).
    z = model.get_layer("hidden")(x).numpy() @ model.get_layer("predictions").kernel.numpy()
    z += model.get_layer("predictions").bias.numpy()
    top = z.max(axis=1)
    reference = np.mean(top + np.log(np.exp(z - top[:, None]).sum(1)) - z[np.arange(len(y)), y])
    assert plain_loss == pytest.approx(reference, rel=1e-4)
    assert loss == plain_loss
    for got, want in zip(grads, plain_grads, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_head_records_the_gradient_its_loss_sends_to_the_logits():
    x, y = data(scale=1.0)
    model = softmax_head()
    with graddebug.watch(model) as dbg:
        with tf.GradientTape() as tape:
            loss = keras.losses.SparseCategoricalCrossentropy()(y, model(x, training=True))
        dbg.step(tape.gradient(loss, model.trainable_variables))
    # d loss / d logits of mean cross-entropy is (softmax(z) - onehot(y)) / n.
    z = model.get_layer("hidden")(x).numpy() @ model.get_layer("predictions").kernel.numpy()
    z += model.get_layer("predictions").bias.numpy()
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    frame = dbg.frame()
    row = frame[(frame["layer"] == "predictions") & (frame["kind"] == "activation")]
    assert row["norm"].iloc[0] == pytest.approx(np.linalg.norm(p / len(y)), rel=1e-4)
    assert float(loss) > 0


def test_keras_mask_survives_the_watch():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,), dtype="int32"),
                              keras.layers.Embedding(20, 4, mask_zero=True, name="emb"),
                              keras.layers.Dense(3, name="dense")])
    tokens = np.array([[3, 4, 0, 0, 0], [5, 0, 0, 0, 0]], dtype=np.int32)
    plain = model(tokens)._keras_mask.numpy()
    with graddebug.watch(model), tf.GradientTape():
        watched = model(tokens)
    np.testing.assert_array_equal(watched._keras_mask.numpy(), plain)


def fit_weights(model_fn, x, y, watch: bool, steps: int = 4):
    model = model_fn()
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy())
    kwargs = dict(batch_size=8, epochs=1, shuffle=False, verbose=0, steps_per_epoch=steps)
    if watch:
        with graddebug.watch(model) as dbg:
            model.fit(x, y, callbacks=[dbg.callback()], **kwargs)
        return [w.copy() for w in model.get_weights()], dbg
    model.fit(x, y, **kwargs)
    return [w.copy() for w in model.get_weights()], None


@pytest.mark.slow
@pytest.mark.parametrize("model_fn, shape", [(softmax_head, (8,)), (padded_cnn, (8, 8, 3)),
                                             (bn_cnn, (8, 8, 3))])
def test_fit_on_a_softmax_head_is_bitwise_unchanged_by_watching(model_fn, shape):
    x, y = data(shape, scale=30.0)
    first, _ = fit_weights(model_fn, x, y, watch=False)
    second, _ = fit_weights(model_fn, x, y, watch=False)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)  # fit itself is deterministic here
    watched, dbg = fit_weights(model_fn, x, y, watch=True)
    assert not np.array_equal(first[0], model_fn().get_weights()[0])  # training moved them
    for a, b in zip(first, watched, strict=True):
        np.testing.assert_array_equal(a, b)
    assert dbg.findings().empty


def test_tape_loop_on_a_softmax_head_is_bitwise_unchanged_by_watching():
    x, y = data(scale=30.0)

    def train(model, dbg=None):
        optimizer = keras.optimizers.SGD(0.01)
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = keras.losses.SparseCategoricalCrossentropy()(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            if dbg is not None:
                dbg.step(grads)
        return [w.copy() for w in model.get_weights()]

    plain = train(softmax_head())
    model = softmax_head()
    with graddebug.watch(model) as dbg:
        watched = train(model, dbg)
    for a, b in zip(plain, watched, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_huge_softmax_kernel_explodes_rather_than_dies():
    x, y = data(scale=1.0)
    model = softmax_head()
    head = model.get_layer("predictions")
    head.kernel.assign(head.kernel * 1e6)
    _, plain_grads = loss_and_grad_norm(model, x, y)
    assert np.linalg.norm(plain_grads[0]) > 1e4  # the logits rule keeps the gradient alive
    with graddebug.watch(model) as dbg:
        _, grads = loss_and_grad_norm(model, x, y)
        dbg.step([tf.constant(g) for g in grads])
    issues = set(dbg.findings()["issue"])
    assert "exploding" in issues
    assert "dead" not in issues


@pytest.mark.parametrize("compiled", [False, True])
def test_a_parameter_free_first_layer_is_not_a_cut(compiled):
    x, y = data((8, 8, 3), n=8, scale=1.0)
    model = padded_cnn()
    optimizer = keras.optimizers.SGD(0.01)

    def step():
        with tf.GradientTape() as tape:
            loss = keras.losses.SparseCategoricalCrossentropy()(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return grads

    run = tf.function(step) if compiled else step
    with graddebug.watch(model) as dbg:
        for _ in range(2):
            dbg.step(run())
    assert dbg.findings().empty
    frame = dbg.frame()
    assert "conv" in set(frame.loc[frame["kind"] == "activation", "layer"])


@pytest.mark.slow
def test_fit_with_a_parameter_free_first_layer_finds_nothing():
    x, y = data((8, 8, 3), n=16, scale=1.0)
    _, dbg = fit_weights(padded_cnn, x, y, watch=True, steps=2)
    assert dbg.findings().empty


def test_in_a_graph_batch_norms_are_left_unread_and_eager_steps_record_them():
    """What keeps fit bitwise (above) costs the batch norms' output rows in graphs only: eager
    steps record them; a compiled step does not, and says nothing of them (no cut). Gradients
    handed to dbg.step() are measured outside the graph, so gamma and beta keep their rows."""
    x, y = data((8, 8, 3), n=8, scale=1.0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    for compiled in (False, True):
        model = bn_cnn()

        def step(model=model):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            return tape.gradient(loss, model.trainable_variables)

        run = tf.function(step) if compiled else step
        with graddebug.watch(model) as dbg:
            dbg.step(run())
        frame = dbg.frame()
        bn = frame[frame["layer"].str.startswith("bn")]
        tensors = ("gamma", "beta") if compiled else ("output", "gamma", "beta")
        assert set(zip(bn["layer"], bn["tensor"], strict=True)) == {
            (f"bn{i}", t) for i in (0, 1) for t in tensors}
        assert dbg.findings().empty and dbg.events().empty
        assert {"conv0", "relu0", "conv1", "relu1", "predictions"} <= set(frame["layer"])
