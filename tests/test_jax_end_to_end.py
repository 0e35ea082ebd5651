"""The JAX user story end to end: watch an NNX model, train it under nnx.jit with optax, read
the frames and findings, stream the run to disk, load it, render the HTML report, run
``graddebug report``, and use the pytest fixture and ``check``."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import graddebug  # noqa: E402
import graddebug_jax  # noqa: E402
from graddebug.cli import main as cli  # noqa: E402
from jax_models import MLP  # noqa: E402


def test_watch_train_under_jit_save_load_report_and_cli(tmp_path, capsys):
    model = MLP([8, 64, 64, 1], seed=4)
    tx = graddebug_jax.monitor(optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 8))
    y = jnp.sin(x[:, :1])

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    run = tmp_path / "run"
    with graddebug.watch(model, optimizer=tx, log_dir=run) as dbg:
        for _ in range(6):
            dbg.step(loss=train_step(model, optimizer))

    frame = dbg.frame()
    assert set(frame["kind"]) == {"activation", "parameter", "loss"}
    assert frame["step"].nunique() == 6
    params = frame.query("kind == 'parameter'")
    assert (params["update_norm"] > 0).all()
    assert (params.query("tensor == 'kernel'")["weight_norm"] > 0).all()  # biases start at 0
    assert dbg.findings().empty

    report = graddebug.load(run)
    loaded = report.frame()
    assert len(loaded) == len(frame)
    np.testing.assert_allclose(loaded["norm"].to_numpy(), frame["norm"].to_numpy())

    page = tmp_path / "report.html"
    report.to_html(page)
    assert "layers.1" in page.read_text(encoding="utf-8")

    assert cli(["report", str(run)]) == 0
    assert "layers.0" in capsys.readouterr().out


def test_the_pytest_fixture_and_check_work_for_nnx_models(graddebug):
    model = MLP([8, 32, 1], seed=5)
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 8))
    y = jnp.cos(x[:, :1])
    report = graddebug.check(model, (x, y), lambda out, t: jnp.mean((out - t) ** 2), steps=2)
    report.assert_healthy()
    assert set(report.frame()["layer"]) >= {"layers.0", "layers.1"}

    dbg = graddebug(model)
    dbg.step(nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))
    assert len(dbg.frame().query("kind == 'activation'")) == 2
