"""The forms a new user reaches for first: typed errors for the likeliest typos, ``dbg.step(loss)``,
``keep=`` names checked while training runs, a step with no gradient said at that step,
``start()``/``stop()`` without ``with``, and ``raise_on=`` in every framework."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pandas as pd
import pytest

import graddebug
import graddebug.errors as errors
from graddebug.errors import (
    ConfigError,
    FindingError,
    GradDebugError,
    GradDebugWarning,
    UnknownNameError,
    WatcherStateError,
)

torch = pytest.importorskip("torch")


def mlp(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def data(steps: int, seed: int = 1) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
            for _ in range(steps)]


def train(model: Any, dbg: Any, batches: list[tuple[Any, Any]], *, as_kw: bool = False,
          poison: int | None = None) -> list[float]:
    """Plain SGD steps; ``poison`` multiplies that step's input by NaN."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == poison:
            x = x * math.nan
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if as_kw:
            dbg.step(loss=loss)
        else:
            dbg.step(loss)
        opt.step()
        opt.zero_grad()
    return losses


def hooked(model: Any) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# -- typed, early errors -------------------------------------------------------------------------


def test_a_typo_in_a_watch_option_is_a_config_error_that_suggests_the_option() -> None:
    with pytest.raises(ConfigError, match=r"watch\(\) got an unknown option 'evry'\. "
                                          r"Did you mean 'every'"):
        graddebug.watch(mlp(), evry=10)
    with pytest.raises(ConfigError, match="Did you mean 'keep'"):
        graddebug.watch(mlp(), kep=["0"])


def test_check_and_watch_answer_a_typo_with_the_same_message() -> None:
    from graddebug.integrations.stopping import check_watch_options

    with pytest.raises(ConfigError) as by_watch:
        graddebug.watch(mlp(), evry=2)
    with pytest.raises(ConfigError) as by_check:
        check_watch_options({"evry": 2}, "check()", ("steps",))
    assert "Did you mean 'every'" in str(by_watch.value)
    assert "Did you mean 'every'" in str(by_check.value)


def test_a_scalar_loss_given_positionally_is_the_loss_as_with_the_keyword() -> None:
    batches = data(4)
    model = mlp()
    with graddebug.watch(model) as dbg:
        losses = train(model, dbg, batches)
    model_kw = mlp()
    with graddebug.watch(model_kw) as dbg_kw:
        train(model_kw, dbg_kw, batches, as_kw=True)
    rows = dbg.frame().query("kind == 'loss'")
    np.testing.assert_allclose(rows["mean"].to_numpy(), losses, rtol=1e-6)
    pd.testing.assert_frame_equal(dbg.frame(), dbg_kw.frame())


@pytest.mark.parametrize("make", [float, np.float64, np.float32, lambda v: np.array(v)],
                         ids=["python", "np.float64", "np.float32", "0-d array"])
def test_python_and_numpy_scalars_are_losses_too(make: Any) -> None:
    model = mlp()
    (x, y), = data(1)
    with graddebug.watch(model) as dbg:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        dbg.step(make(loss.item()))
    row = dbg.frame().query("kind == 'loss'")
    assert row["mean"].tolist() == pytest.approx([loss.item()], rel=1e-6)


class CountedLoss:
    """A loss that counts how often it is read (``float()``: a host transfer on a device)."""

    reads = 0

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        CountedLoss.reads += 1
        return self.value


def test_the_loss_is_read_on_recorded_steps_only() -> None:
    model = mlp()
    CountedLoss.reads = 0
    with graddebug.watch(model, every=5) as dbg:
        for step, (x, y) in enumerate(data(12)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            dbg.step(loss=CountedLoss(float(step)))
            model.zero_grad()
    assert CountedLoss.reads == 3  # steps 0, 5 and 10: a skipped step waits for no device
    losses = dbg.frame().query("kind == 'loss'")
    assert losses["step"].tolist() == [0, 5, 10]
    assert losses["mean"].tolist() == [0.0, 5.0, 10.0]


def test_a_loss_given_twice_is_refused() -> None:
    model = mlp()
    (x, y), = data(1)
    with pytest.raises(ConfigError, match="two losses"), graddebug.watch(model) as dbg:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        dbg.step(loss, loss=loss)


def test_a_keep_name_that_matches_nothing_raises_at_the_first_step_with_a_suggestion() -> None:
    model = mlp()
    batches = data(5)
    reached = []
    with (pytest.raises(UnknownNameError, match=r"'O' Did you mean '0'\?") as caught,
          graddebug.watch(model, keep=["O"]) as dbg):
        for x, y in batches:
            torch.nn.functional.mse_loss(model(x), y).backward()
            dbg.step()
            reached.append(dbg.step_index)
    assert reached == []  # raised at the first dbg.step(), not after the run
    assert "by step 0" in str(caught.value)
    assert not hooked(model)


def test_an_intervene_name_that_matches_nothing_raises_at_the_first_step() -> None:
    model = mlp()
    after_step = []
    with pytest.raises(UnknownNameError, match="'fc9'"), \
            graddebug.watch(model, intervene={"fc9": {"clip_norm": 1.0}}) as dbg:
        for x, y in data(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            dbg.step()
            after_step.append(dbg.step_index)
    assert after_step == []  # at the step, not when the block ends


def test_a_tap_named_in_keep_is_matched_once_it_runs() -> None:
    model = mlp()
    batches = data(3)
    with graddebug.watch(model, keep=["h"]) as dbg:
        for x, y in batches:
            h = dbg.tap(model[0](x), "h")
            torch.nn.functional.mse_loss(model[2](model[1](h)), y).backward()
            dbg.step()
    assert "h" in dbg.tensors(2)


def test_a_step_before_backward_says_so_at_that_step_with_the_fix() -> None:
    model = mlp()
    batches = data(3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with graddebug.watch(model) as dbg:
            dbg.step()
            at_step = [str(w.message) for w in seen if issubclass(w.category, GradDebugWarning)]
            for x, y in batches:
                torch.nn.functional.mse_loss(model(x), y).backward()
                dbg.step()
    assert len(at_step) == 1
    assert "no gradient since the last step" in at_step[0]
    assert "after loss.backward()" in at_step[0]
    later = [str(w.message) for w in seen if issubclass(w.category, GradDebugWarning)]
    assert later == at_step  # once, and the healthy steps after it warn of nothing


def test_a_step_called_between_forward_and_backward_is_named_at_the_exit_too() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with graddebug.watch(model) as dbg:
            for x, y in data(3):
                loss = torch.nn.functional.mse_loss(model(x), y)
                dbg.step()
                loss.backward()
                opt.step()
                opt.zero_grad()
    texts = [str(w.message) for w in seen if issubclass(w.category, GradDebugWarning)]
    assert any("no gradient since the last step" in t for t in texts)
    assert any("between the forward pass and backward()" in t for t in texts)


def test_the_run_file_errors_are_exported() -> None:
    for name in ("NotARunError", "CorruptRunError", "RunFileError", "FindingError"):
        assert name in graddebug.__all__
        assert getattr(graddebug, name) is getattr(errors, name)
    assert issubclass(graddebug.NotARunError, graddebug.RunFileError)
    assert issubclass(graddebug.FindingError, graddebug.GradDebugError)


# -- start() / stop() ----------------------------------------------------------------------------


def test_start_and_stop_do_what_the_with_block_does() -> None:
    batches = data(4)
    model = mlp()
    with graddebug.watch(model) as in_block:
        train(model, in_block, batches)
    model2 = mlp()
    watcher = graddebug.watch(model2)
    dbg = watcher.start()
    assert dbg is watcher and dbg.active and hooked(model2)
    train(model2, dbg, batches)
    dbg.stop()
    assert not dbg.active and not hooked(model2)
    pd.testing.assert_frame_equal(dbg.frame(), in_block.frame())
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_start_and_stop_misused_are_typed_state_errors() -> None:
    dbg = graddebug.watch(mlp())
    with pytest.raises(WatcherStateError, match="not running"):
        dbg.stop()
    with pytest.raises(WatcherStateError, match=r"before dbg\.start"):
        dbg.step()
    dbg.start()
    with pytest.raises(WatcherStateError, match="already active"):
        dbg.start()
    dbg.stop()
    with pytest.raises(WatcherStateError, match="not running"):
        dbg.stop()


def test_stop_checks_the_names_as_leaving_the_block_does() -> None:
    model = mlp()
    dbg = graddebug.watch(model, keep=["nowhere"]).start()
    with pytest.raises(UnknownNameError, match="'nowhere'"):
        dbg.stop()
    assert not hooked(model)


# -- raise_on -------------------------------------------------------------------------------------


def test_raise_on_stops_a_torch_loop_at_the_nan_step_with_the_rows() -> None:
    model = mlp()
    batches = data(6)
    with pytest.raises(FindingError) as caught, \
            graddebug.watch(model, raise_on=("nonfinite",)) as dbg:
        train(model, dbg, batches, poison=3)
    error = caught.value
    assert isinstance(error, GradDebugError)
    assert dbg.step_index == 4  # the NaN step (3) closed, nothing after it
    found = error.findings
    assert isinstance(found, pd.DataFrame)
    assert set(found["issue"]) == {"nonfinite"} and set(found["step"]) == {3}
    assert "step 3: nonfinite" in str(error)
    assert not hooked(model)


def test_raise_on_through_the_optimizer_given_to_watch() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(FindingError, match="nonfinite"), \
            graddebug.watch(model, optimizer=opt, raise_on="nonfinite"):
        for i, (x, y) in enumerate(data(5)):
            x = x * math.nan if i == 2 else x
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert not hooked(model)


def test_a_healthy_run_with_raise_on_every_issue_runs_to_the_end() -> None:
    model = mlp()
    every_issue = tuple(i.value for i in graddebug.Issue)
    with graddebug.watch(model, raise_on=every_issue) as dbg:
        train(model, dbg, data(12))
    assert dbg.step_index == 12


def test_raise_on_an_unknown_issue_is_a_config_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"raise_on='nonfinit' .*Did you mean 'nonfinite'"):
        graddebug.watch(mlp(), raise_on=("nonfinit",))
    with pytest.raises(ConfigError, match="raise_on="):
        graddebug.watch(mlp(), raise_on=3)


def test_tensorflow_takes_the_loss_positionally_and_raises_on_a_nan() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05)
    x = tf.random.stateless_normal((16, 4), seed=(1, 2))
    losses, first_kernel = [], []
    with pytest.raises(FindingError) as caught, \
            graddebug.watch(model, optimizer=opt, raise_on=("nonfinite",)) as dbg:
        for i in range(5):
            xi = x * float("nan") if i == 3 else x
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(xi) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            first_kernel.append(np.linalg.norm(grads[0].numpy()))
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            losses.append(float(loss))
            dbg.step(loss)  # a 0-d tf tensor: the loss; the gradients come from opt
    assert set(caught.value.findings["step"]) == {3}
    assert len(losses) == 4  # stopped at the NaN step
    frame = dbg.frame()
    recorded = frame.query("kind == 'loss'")["mean"].to_numpy()
    np.testing.assert_allclose(recorded[:3], losses[:3], rtol=1e-6)
    kernel = frame.query("kind == 'parameter' and tensor == 'kernel' and depth == 0")
    np.testing.assert_allclose(kernel["norm"].to_numpy()[:3], first_kernel[:3], rtol=1e-5)


def test_jax_raises_on_a_nan_at_its_step() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    w = jnp.ones((4, 3)) * 0.1
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)

    def loss_fn(w: Any, x: Any) -> Any:
        return jnp.mean((x @ w) ** 2)

    grad = jax.grad(loss_fn)
    steps = 0
    with pytest.raises(FindingError) as caught, \
            graddebug.watch(params={"w": w}, raise_on=("nonfinite",)) as dbg:
        for i in range(4):
            steps += 1
            dbg.step([grad(w, x * jnp.nan if i == 2 else x)])
    assert steps == 3 and set(caught.value.findings["step"]) == {2}
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = np.linalg.norm(2 * xs.T @ (xs @ ws) / (xs.shape[0] * ws.shape[1]))
    norms = dbg.frame().query("kind == 'parameter' and step < 2")["norm"].to_numpy()
    np.testing.assert_allclose(norms, [want, want], rtol=1e-5)


def test_jax_optax_loop_takes_a_0d_loss_positionally() -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    nnx = pytest.importorskip("flax.nnx")
    import graddebug_jax
    from jax_models import MLP, batch, square_loss

    model, x = MLP([4, 8, 2]), batch()
    tx = graddebug_jax.monitor(optax.sgd(0.05))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model: Any, optimizer: Any, x: Any) -> Any:
        loss, grads = nnx.value_and_grad(square_loss)(model, x)
        optimizer.update(model, grads)
        return loss

    losses = []
    with graddebug.watch(model, optimizer=tx) as dbg:
        for _ in range(3):
            loss = step(model, optimizer, x)
            assert loss.ndim == 0
            losses.append(float(loss))
            dbg.step(loss)
    recorded = dbg.frame().query("kind == 'loss'")["mean"].to_numpy()
    np.testing.assert_allclose(recorded, losses, rtol=1e-6)
    assert not jax.numpy.isnan(loss)


def test_a_keras_keep_name_that_matches_nothing_raises_at_the_first_step() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="hidden"),
                              keras.layers.Dense(1, name="head")])
    x = tf.random.stateless_normal((16, 4), seed=(1, 2))
    steps = []
    with (pytest.raises(UnknownNameError, match=r"'hiden' Did you mean 'hidden'") as caught,
          graddebug.watch(model, keep=["hiden"]) as dbg):
        for i in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            dbg.step(tape.gradient(loss, model.trainable_variables), loss=loss)
            steps.append(i)
    assert steps == [] and "by step 0" in str(caught.value)
