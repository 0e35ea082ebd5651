"""Units that die mid-run are reported ``dead`` within 3 recorded steps of their death, whatever
``full_stats_every`` is, in torch, TF and JAX; and a 1-D parameter row's ``zero_frac`` (the
share of its gradient's entries that are exactly 0) matches the framework's own gradient.

A weightless layer adds an offset to a wide ReLU layer's input; at step ``death`` the test sets
it to -100 on 83% of the units, which then get no gradient from any sample. No weight is edited
(an edited weight is reported at once, as the cause), and the layer is wide enough that its
output's per-unit statistics are measured on full steps only.
"""

from __future__ import annotations

import numpy as np
import pytest

WIDTH, DEAD, BATCH, STEPS = 2048, 1700, 256, 40


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(512, 16)).astype("float32"), rng.integers(0, 4, 512), rng


def check_dead(found, death: int) -> None:
    dead = found[found["issue"] == "dead"]
    assert len(dead), found
    assert death <= dead["step"].min() <= death + 2, found  # within 3 recorded steps
    assert set(found["step"]) and found["step"].min() >= death, found  # nothing before


@pytest.mark.parametrize(("death", "full_every"), [(23, 10), (13, 10), (9, 4), (31, 7)])
def test_torch_units_that_die_between_full_steps_are_dead_within_3_steps(
        death: int, full_every: int) -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    import graddebug

    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("offset", torch.zeros(WIDTH))

        def forward(self, x):
            return x + self.offset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, WIDTH), Shift(), nn.ReLU(), nn.Linear(WIDTH, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x_all, y_all, rng = data()
    x_all, y_all = torch.tensor(x_all), torch.tensor(y_all)
    with graddebug.watch(model, full_stats_every=full_every) as dbg:
        for step in range(STEPS):
            if step == death:
                model[1].offset[:DEAD] = -100.0
            i = torch.tensor(rng.integers(0, 512, BATCH))
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x_all[i]), y_all[i])
            loss.backward()
            opt.step()
            dbg.step(loss=loss)
    check_dead(dbg.findings(), death)
    frame = dbg.frame()
    # the bias's zero fraction, measured on every step, against the gradient itself
    last = frame[(frame["step"] == STEPS - 1) & (frame["layer"] == "0")].set_index("tensor")
    reference = float((model[0].bias.grad == 0).double().mean())
    assert reference == pytest.approx(DEAD / WIDTH, abs=0.02)
    assert last.loc["bias", "zero_frac"] == pytest.approx(reference)
    assert np.isnan(last.loc["weight", "zero_frac"])  # 2-D: not measured
    before = frame[(frame["step"] < death) & (frame["tensor"] == "bias")]
    assert before["zero_frac"].notna().all()


def test_tf_units_that_die_between_full_steps_are_dead_within_3_steps() -> None:
    tf = pytest.importorskip("tensorflow")
    import keras

    import graddebug

    class Shift(keras.layers.Layer):
        def build(self, shape):
            self.offset = self.add_weight(shape=(shape[-1],), initializer="zeros",
                                          trainable=False)

        def call(self, x):
            return x + self.offset

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(WIDTH, name="fc"),
                              Shift(name="shift"), keras.layers.ReLU(), keras.layers.Dense(4)])
    opt = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x_all, y_all, rng = data()
    death = 23
    with graddebug.watch(model) as dbg:
        for step in range(STEPS):
            if step == death:
                offset = np.zeros(WIDTH, "float32")
                offset[:DEAD] = -100.0
                model.get_layer("shift").offset.assign(offset)
            i = rng.integers(0, 512, BATCH)
            with tf.GradientTape() as tape:
                loss = loss_fn(y_all[i], model(x_all[i], training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            dbg.step(grads, loss=loss)
    check_dead(dbg.findings(), death)
    frame = dbg.frame()
    last = frame[(frame["step"] == STEPS - 1) & (frame["layer"] == "fc")].set_index("tensor")
    bias_grad = grads[[id(v) for v in model.trainable_variables].index(
        id(model.get_layer("fc").bias))]
    reference = float(np.mean(bias_grad.numpy() == 0))
    assert reference == pytest.approx(DEAD / WIDTH, abs=0.02)
    assert last.loc["bias", "zero_frac"] == pytest.approx(reference)
    assert np.isnan(last.loc["kernel", "zero_frac"])


def test_jax_units_that_die_mid_run_are_dead_within_3_steps() -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    nnx = pytest.importorskip("flax.nnx")
    import jax.numpy as jnp

    import graddebug
    import graddebug_jax

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.fc = nnx.Linear(16, WIDTH, rngs=rngs)
            self.out = nnx.Linear(WIDTH, 4, rngs=rngs)
            self.offset = nnx.Variable(jnp.zeros(WIDTH))

        def __call__(self, x):
            return self.out(jax.nn.relu(self.fc(x) + self.offset[...]))

    def loss_of(model: Model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, graddebug_jax.monitor(optax.sgd(0.01)), wrt=nnx.Param)

    @nnx.jit
    def train(model: Model, opt: nnx.Optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_of)(model, x, y)
        opt.update(model, grads)
        return loss, grads

    x_all, y_all, rng = data()
    death = 23
    with graddebug.watch(model, optimizer=opt) as dbg:
        for step in range(STEPS):
            if step == death:
                model.offset[...] = model.offset[...].at[:DEAD].set(-100.0)
            i = rng.integers(0, 512, BATCH)
            loss, grads = train(model, opt, x_all[i], y_all[i])
            dbg.step(loss=loss)
    check_dead(dbg.findings(), death)
    frame = dbg.frame()
    last = frame[(frame["step"] == STEPS - 1) & (frame["layer"] == "fc")].set_index("tensor")
    reference = float(np.mean(np.asarray(grads["fc"]["bias"][...]) == 0))
    assert reference == pytest.approx(DEAD / WIDTH, abs=0.02)
    assert last.loc["bias", "zero_frac"] == pytest.approx(reference)
    assert np.isnan(last.loc["kernel", "zero_frac"])


def test_torch_counts_the_non_zero_entries_of_every_dtype_exactly() -> None:
    torch = pytest.importorskip("torch")
    from graddebug_torch.stats import nonzero_counts

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=5000) * (rng.random(5000) < 0.3), np.zeros(3000),
              np.array([0.0, np.nan, np.inf, -1e-30])]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        vectors = [torch.tensor(a).to(dtype) for a in arrays]
        counts = nonzero_counts(vectors).tolist()
        assert counts == [int(np.count_nonzero(v.double().numpy())) for v in vectors], dtype
