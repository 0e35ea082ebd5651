"""Drivers of Flax NNX models trained by an ``nnx.Optimizer`` whose optax transformation is
wrapped in ``graddebug_jax.monitor``: eagerly, or in one ``nnx.jit`` step."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from drivers import Driver, patch_path
from references import ACTS, LAYERS, LR, Grads, Weights, batch, initial_weights, jax_grads

import graddebug


class _JaxRun:
    """An NNX model, its optax transformation, and the optimizer and step once built."""

    def __init__(self, model: Any, tx: Any, wide: bool) -> None:
        self.model, self.tx, self.wide = model, tx, wide
        self.optimizer: Any = None
        self.step: Any = None


class EagerDriver(Driver):
    """JAX, eager: ``nnx.value_and_grad``, ``optimizer.update``, then ``dbg.step(loss=...)``,
    with ``watch(model, optimizer=nnx_optimizer)`` (the optimizer keeps the monitor's state)."""

    mode = "jax-eager"
    compiled = False
    bug_empties_step = True  # the bug is in landing the step's rows, all of them

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        self.jax, self.jnp, self.nnx, self.optax = jax, jnp, nnx, optax

        class Dense(nnx.Module):  # type: ignore[misc]
            def __init__(self, w: np.ndarray, b: np.ndarray, act: str | None,
                         cut: bool = False) -> None:
                self.kernel = nnx.Param(jnp.asarray(w))
                self.bias = nnx.Param(jnp.asarray(b))
                self.act, self.cut = act, cut

            def __call__(self, x: Any) -> Any:
                z = (jax.lax.stop_gradient(x) if self.cut else x) @ self.kernel + self.bias
                return jnp.tanh(z) if self.act else z

        class Net(nnx.Module):  # type: ignore[misc]
            def __init__(self, variant: str) -> None:
                weights = initial_weights(variant == "wide")
                for name, act in zip(LAYERS, ACTS, strict=True):
                    w, b = weights[name]
                    if variant == "nan" and name == "l2":
                        b = np.full_like(b, np.nan)
                    setattr(self, name, Dense(w, b, act, variant == "cut" and name == "l2"))

            def __call__(self, x: Any) -> Any:
                return self.l3(self.l2(self.l1(x)))

        self.Net = Net

    def build(self, variant: str = "mlp", plain: bool = False) -> Any:
        import graddebug_jax

        tx = self.optax.sgd(LR)
        run = _JaxRun(self.Net(variant), tx if plain else graddebug_jax.monitor(tx),
                      variant == "wide")
        run.optimizer = self.nnx.Optimizer(run.model, run.tx, wrt=self.nnx.Param)
        return run

    def watch(self, run: Any, **options: Any) -> contextlib.AbstractContextManager[Any]:
        return graddebug.watch(run.model, optimizer=run.optimizer, **options)

    def native(self, array: np.ndarray) -> Any:
        return self.jnp.asarray(array)

    def train(self, run: Any, dbg: Any, steps: int = 1) -> None:
        nnx, jnp = self.nnx, self.jnp
        if run.step is None:

            def step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
                loss, grads = nnx.value_and_grad(
                    lambda m: jnp.mean((m(x) - y) ** 2))(model)
                optimizer.update(model, grads)
                return loss

            run.step = nnx.jit(step) if self.compiled else step
        x, y = (jnp.asarray(a) for a in batch(run.wide))
        for _ in range(steps):
            loss = run.step(run.model, run.optimizer, x, y)
            if dbg is not None:
                dbg.step(loss=loss)

    def reference(self) -> Grads:
        return jax_grads(initial_weights(), *batch())

    def weights(self, run: Any) -> Weights:
        return {n: (np.array(getattr(run.model, n).kernel.get_value()),
                    np.array(getattr(run.model, n).bias.get_value())) for n in LAYERS}

    def rows(self) -> dict[str, tuple[str, str]]:
        return {f"{n}.{k}": (n, t) for n in LAYERS for k, t in (("w", "kernel"), ("b", "bias"))}

    def probe(self, run: Any) -> Any:
        modules = [(path, type(m), type(m).__call__,
                    sorted(k for k in vars(m) if "graddebug" in k))
                   for path, m in self.nnx.iter_modules(run.model)]
        return modules

    def break_adapter(self, patch: pytest.MonkeyPatch) -> None:
        patch_path(patch, "graddebug_jax.closing", "StepRows.add_layers")


class JitDriver(EagerDriver):
    """JAX under ``nnx.jit``: the same step as :class:`EagerDriver`, traced once per run."""

    mode = "jax-jit"
    compiled = True
