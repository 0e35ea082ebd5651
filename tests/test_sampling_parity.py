"""One sampling plan, three frameworks: the same weights and the same update, loaded as the same
numpy arrays into torch, TF and JAX, give the same ``weight_norm`` and ``update_norm`` in each
framework's frame, and each is the plan's estimate (:func:`graddebug.sampling.plan`) computed
with numpy on the same indices.

The model is two dense layers with ``(in, out)`` kernels in every framework (a small torch
module of its own, since ``nn.Linear`` keeps its weight transposed): the same shapes in the same
memory order, so that the plan reads the same entries. Both kernels are sampled (8,192 and 1,280
entries, each at its stride), the biases taken whole. Training is two steps of plain SGD on
``mean(model(x) ** 2)`` from the same weights on the same batch; the frameworks' float32
gradients differ in rounding only, which is what the tolerance between frameworks allows.

When its row holds what: TF and JAX record the weights a step's gradients were taken at and the
update applied to them; torch, with ``dbg.step()`` after ``opt.step()``, the weights after the
update and that update.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest

import graddebug
from graddebug.sampling import plan

SIZES = (64, 128, 10)
SHAPES = [(64, 128), (128,), (128, 10), (10,)]
KEYS = [(0, "kernel"), (0, "bias"), (1, "kernel"), (1, "bias")]
LR = 0.1
STEPS = 2
ACROSS = 1e-5
"""Between frameworks: float32 gradients that differ in rounding."""
EXACT = 1e-6
"""Against numpy on the framework's own arrays: the estimate's rounding only (torch and JAX sum
the sample's squares in float32, TF in float64)."""

Snapshots = list[dict[tuple[int, str], np.ndarray]]
"""The weights before each step and after the last, by ``(layer, tensor)``."""


def initial() -> dict[tuple[int, str], np.ndarray]:
    rng = np.random.default_rng(0)
    return {key: (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)
            for key, shape in zip(KEYS, SHAPES, strict=True)}


def inputs() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((16, SIZES[0])).astype(np.float32)


def norms(frame: pd.DataFrame) -> dict[tuple[int, tuple[int, str]], tuple[float, float]]:
    """``(weight_norm, update_norm)`` by ``(step, (layer, tensor))``, layers numbered in forward
    order."""
    rows = frame[frame["kind"] == "parameter"]
    order = {name: i for i, name in enumerate(
        rows.sort_values("depth").drop_duplicates("layer")["layer"])}
    return {(int(r.step), (order[r.layer], r.tensor)): (r.weight_norm, r.update_norm)
            for r in rows.itertuples()}


def run_torch() -> tuple[pd.DataFrame, Snapshots]:
    torch = pytest.importorskip("torch")
    from torch import nn

    class Dense(nn.Module):
        def __init__(self, kernel: np.ndarray, bias: np.ndarray) -> None:
            super().__init__()
            self.kernel = nn.Parameter(torch.tensor(kernel))
            self.bias = nn.Parameter(torch.tensor(bias))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.kernel + self.bias

    w = initial()
    model = nn.Sequential(Dense(w[0, "kernel"], w[0, "bias"]), nn.ReLU(),
                          Dense(w[1, "kernel"], w[1, "bias"]))
    dense = [model[0], model[2]]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.tensor(inputs())

    def snapshot() -> dict[tuple[int, str], np.ndarray]:
        return {(i, t): getattr(dense[i], t).detach().numpy().copy() for i, t in KEYS}

    seen = [snapshot()]
    with graddebug.watch(model, strict=True) as dbg:
        for _ in range(STEPS):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            dbg.step()
            seen.append(snapshot())
    return dbg.frame(), seen


def run_tf() -> tuple[pd.DataFrame, Snapshots]:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    w = initial()
    model = keras.Sequential([keras.Input((SIZES[0],)),
                              keras.layers.Dense(SIZES[1], activation="relu"),
                              keras.layers.Dense(SIZES[2])])
    dense = model.layers
    for i in range(2):
        dense[i].set_weights([w[i, "kernel"], w[i, "bias"]])
    opt = keras.optimizers.SGD(LR)
    x = tf.constant(inputs())

    def snapshot() -> dict[tuple[int, str], np.ndarray]:
        return {(i, t): np.asarray(getattr(dense[i], t).numpy()).copy() for i, t in KEYS}

    seen = [snapshot()]
    with graddebug.watch(model, optimizer=opt, strict=True) as dbg:
        for _ in range(STEPS):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            dbg.step()
            seen.append(snapshot())
    return dbg.frame(), seen


def run_jax() -> tuple[pd.DataFrame, Snapshots]:
    pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    import graddebug_jax
    from jax_models import MLP, train_step

    w = initial()
    model = MLP(list(SIZES))
    for i in range(2):
        model.layers[i].kernel.set_value(jnp.asarray(w[i, "kernel"]))
        model.layers[i].bias.set_value(jnp.asarray(w[i, "bias"]))
    tx = graddebug_jax.monitor(optax.sgd(LR))
    x = jnp.asarray(inputs())

    def snapshot() -> dict[tuple[int, str], np.ndarray]:
        return {(i, t): np.array(getattr(model.layers[i], t).get_value()) for i, t in KEYS}

    seen = [snapshot()]
    with graddebug.watch(model, optimizer=tx, strict=True) as dbg:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = train_step()
        for _ in range(STEPS):
            dbg.step(loss=step(model, optimizer, x))
            seen.append(snapshot())
    return dbg.frame(), seen


def estimate(array: np.ndarray, key: tuple[int, str]) -> float:
    """The plan's estimate of ``array``'s norm, computed with numpy in float64."""
    sample = plan(SHAPES)[KEYS.index(key)]
    part = array.astype(np.float64).reshape(-1)[sample.indices()]
    return float(np.sqrt(np.sum(part ** 2) * sample.numel / len(part)))


RUNS: dict[str, Callable[[], tuple[pd.DataFrame, Snapshots]]] = {
    "torch": run_torch, "tensorflow": run_tf, "jax": run_jax}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[pd.DataFrame, Snapshots]]:
    return {name: run() for name, run in RUNS.items()}


def test_the_kernels_are_sampled_and_the_biases_taken_whole() -> None:
    samples = plan(SHAPES)
    assert [s.whole for s in samples] == [False, True, False, True]
    assert 1 < samples[0].count < 8192 and 1 < samples[2].count < 1280


@pytest.mark.parametrize("framework", list(RUNS))
def test_each_frame_holds_the_plans_estimate_on_the_same_indices(
        runs: dict[str, tuple[pd.DataFrame, Snapshots]], framework: str) -> None:
    frame, seen = runs[framework]
    got = norms(frame)
    after = framework == "torch"  # torch's row: the weights after the step's update
    assert {key for _, key in got} == set(KEYS)
    for step in range(STEPS):
        for key in KEYS:
            weights = seen[step + 1 if after else step][key]
            update = seen[step + 1][key] - seen[step][key]
            weight_norm, update_norm = got[step, key]
            assert weight_norm == pytest.approx(estimate(weights, key), rel=EXACT)
            assert update_norm == pytest.approx(estimate(update, key), rel=EXACT)
    # the kernel's estimate is an estimate: close to the exact norm, not equal to it
    kernel = seen[0][0, "kernel"]
    assert estimate(kernel, (0, "kernel")) != pytest.approx(np.linalg.norm(kernel), rel=1e-6)
    assert estimate(kernel, (0, "kernel")) == pytest.approx(np.linalg.norm(kernel), rel=0.1)


def test_the_same_weights_and_update_give_the_same_norms_in_every_framework(
        runs: dict[str, tuple[pd.DataFrame, Snapshots]]) -> None:
    got = {name: norms(frame) for name, (frame, _) in runs.items()}
    for key in KEYS:
        # the update of step 0, and the weights after it: torch's step 0, TF's and JAX's step 1
        torch_weight, torch_update = got["torch"][0, key]
        for name in ("tensorflow", "jax"):
            assert got[name][0, key][1] == pytest.approx(torch_update, rel=ACROSS), (name, key)
            assert got[name][1, key][0] == pytest.approx(torch_weight, rel=ACROSS), (name, key)
        # the weights before any update: the same arrays were loaded into TF and JAX
        assert got["tensorflow"][0, key][0] == pytest.approx(got["jax"][0, key][0], rel=ACROSS)
        assert got["tensorflow"][0, key][0] == pytest.approx(estimate(initial()[key], key),
                                                             rel=ACROSS)
