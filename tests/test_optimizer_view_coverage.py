"""Every parameter in the optimizer's view, in every framework: each parameter row carries a
``weight_norm`` and an ``update_norm`` from the first update on, small tensors (biases,
LayerNorm gains) included, and each equals the norm of the parameter and of its change, read
from the weights themselves (whole where the plan takes a tensor whole, and to the plan's
sampling error where it samples one).

The models are the ones a user meets first: the README's deep sigmoid MLP (26 tensors, most of
them small) in torch and in Flax NNX, a character GPT (GPT-2's architecture, tiny), and a Keras
``Dense(64)-Dense(10)`` under ``fit``.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import graddebug


def _check_every_row(frame: pd.DataFrame, truth: dict[tuple[int, str], tuple[float, float]],
                     names: set[str], steps: int) -> None:
    """Every parameter has a row at every step, with both norms finite and equal to the
    truth (the sampling plan estimates large tensors: 10% relative for those, and updates to
    float32's resolution of the weights)."""
    rows = frame[frame["kind"] == "parameter"]
    got = {(int(r.step), f"{r.layer}.{r.tensor}"): (r.weight_norm, r.update_norm)
           for r in rows.itertuples()}
    assert {name for _, name in got} == names
    assert set(got) == {(s, n) for s in range(steps) for n in names}
    for key, (weight, update) in got.items():
        assert math.isfinite(weight) and math.isfinite(update), key
        true_weight, true_update = truth[key]
        assert weight == pytest.approx(true_weight, rel=0.1), key
        # An update below float32's resolution of the weights (a vanishing layer's) changes
        # only some entries: a sample may see none of them.
        assert update == pytest.approx(true_update, rel=0.1, abs=1e-6 * true_weight), key


def _torch_run(model, batch, loss_fn, optimizer, steps: int = 3):
    """Train ``steps`` steps watched (``dbg.step()`` after ``opt.step()``: each row holds the
    weights after its step's update and that update); the truth, read from the weights."""
    truth: dict[tuple[int, str], tuple[float, float]] = {}
    with graddebug.watch(model) as dbg:
        for step in range(steps):
            before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            optimizer.zero_grad()
            loss_fn(model, batch).backward()
            optimizer.step()
            dbg.step()
            for name, p in model.named_parameters():
                after = p.detach().double()
                truth[(step, name)] = (float(after.norm()), float((after - before[name]).norm()))
    return dbg.frame(), truth


def test_every_tensor_of_the_readme_mlp_is_seen_from_the_first_update() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(64, 64), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    frame, truth = _torch_run(model, (x, y),
                              lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                              torch.optim.SGD(model.parameters(), lr=0.1))
    names = {n for n, _ in model.named_parameters()}
    assert len(names) == 26
    _check_every_row(frame, truth, names, 3)


def test_every_tensor_of_a_char_gpt_is_seen_from_the_first_update() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96,
                                     n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))
    frame, truth = _torch_run(model, tokens, lambda m, b: m(b, labels=b).loss,
                              torch.optim.AdamW(model.parameters(), lr=1e-3))
    # Tied weights: the head's weight is the token embedding, one row under one name.
    names = {f"{r.layer}.{r.tensor}" for r in frame[frame["kind"] == "parameter"].itertuples()}
    assert names == {n for n, _ in model.named_parameters()}
    assert sum(".ln_" in n or n.endswith(".bias") for n in names) >= 12  # the small ones
    _check_every_row(frame, truth, names, 3)


@pytest.mark.slow
def test_every_tensor_of_a_keras_dense_pair_is_seen_under_fit() -> None:
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 32)).astype("float32"), rng.integers(0, 10, 64)
    names = [f"{v.path.split('/')[-2]}.{v.path.split('/')[-1]}"
             for v in model.trainable_variables]
    truth: dict[tuple[int, str], tuple[float, float]] = {}

    class Weights(keras.callbacks.Callback):
        """The weights around each batch: TF rows hold the weights a step's gradient was
        taken at and the update applied to them."""

        def on_train_batch_begin(self, batch, logs=None):
            self.before = [v.numpy().astype(float) for v in model.trainable_variables]

        def on_train_batch_end(self, batch, logs=None):
            for name, b, v in zip(names, self.before, model.trainable_variables, strict=True):
                after = v.numpy().astype(float)
                truth[(batch, name)] = (float(np.linalg.norm(b)),
                                        float(np.linalg.norm(after - b)))

    with graddebug.watch(model) as dbg:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                  callbacks=[Weights(), dbg.callback()])
    _check_every_row(dbg.frame(), truth, set(names), 4)


def test_every_tensor_of_the_readme_mlp_is_seen_in_jax() -> None:
    jax = pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    import graddebug_jax
    from jax_models import MLP

    model = MLP([64] * 13 + [10], seed=0, act=jax.nn.sigmoid)  # the README's MLP, in NNX
    tx = graddebug_jax.monitor(optax.sgd(0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.PRNGKey(0), (256, 64))
    y = jax.random.randint(jax.random.PRNGKey(1), (256,), 0, 10)

    @nnx.jit
    def train_step(model, optimizer):
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    def weights() -> dict[str, np.ndarray]:
        return {f"layers.{i}.{name}": np.asarray(getattr(layer, name)[...], dtype=float)
                for i, layer in enumerate(model.layers) for name in ("kernel", "bias")}

    truth: dict[tuple[int, str], tuple[float, float]] = {}
    with graddebug.watch(model, optimizer=tx) as dbg:
        for step in range(3):
            before = weights()
            dbg.step(loss=train_step(model, optimizer))
            after = weights()
            # JAX rows hold the weights the gradient was taken at, and the update applied.
            truth.update({(step, n): (float(np.linalg.norm(before[n])),
                                      float(np.linalg.norm(after[n] - before[n])))
                          for n in before})
    _check_every_row(dbg.frame(), truth, set(weights()), 3)
