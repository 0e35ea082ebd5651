"""The driver interface the scenarios are written against, and the drivers of torch and of the
toy reference adapter (``examples/adapter/toygrad.py``).

A driver knows one framework in one mode: how to build the suite's MLP (layers ``l1``, ``l2``,
``l3``) from :func:`references.initial_weights`, as is or with a cut or a NaN planted in
``l2``; how to run training steps under a Watcher or without one; where its reference gradients
come from; how to read the weights back; what its adapter installs (so that cleanup can be
checked); and which internal of its adapter to break for the fail-open scenario.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from references import ACTS, LAYERS, LR, Grads, Weights, batch, initial_weights, torch_grads

import graddebug

BUG = "bug planted by the conformance suite"


def broken(*args: Any, **kwargs: Any) -> Any:
    """What the fail-open scenario puts in place of an internal of the adapter."""
    raise ZeroDivisionError(BUG)


def patch_path(patch: pytest.MonkeyPatch, module: str, path: str) -> None:
    """Replace ``module.path`` (``"Class.method"`` or ``"function"``) by :func:`broken`."""
    owner: Any = __import__(module, fromlist=["_"])
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if not hasattr(owner, name):
        raise AssertionError(f"{module}.{path} is gone: point the driver's break_adapter at the "
                             "internal that took its place")
    patch.setattr(owner, name, broken)


class Driver:
    """One framework in one mode. Subclasses fill in every method.

    Attributes:
        mode: The mode's id, as in the test ids.
        weights_read: Which weights a step's ``weight_norm`` is the norm of: ``"before"`` or
            ``"after"`` the optimizer's update of that step.
        keeps_cause: Whether an exception raised in the training step reaches the caller with
            its ``__cause__``.
        bug_empties_step: Whether the internal :meth:`break_adapter` breaks is one the
            adapter's close depends on whole (its step is then recorded empty); otherwise it
            breaks the layer-output rows only, and the parameter rows are still recorded.
    """

    mode = ""
    weights_read = "before"
    keeps_cause = True
    bug_empties_step = False

    def build(self, variant: str = "mlp", plain: bool = False) -> Any:
        """A fresh model (and optimizer) at the initial weights.

        Args:
            variant: ``"mlp"``; ``"cut"``: ``l2``'s input is cut from the graph; ``"nan"``:
                ``l2``'s bias is NaN, so its forward output is; ``"wide"``: the MLP of
                :data:`references.WIDE` sizes.
            plain: For training without graddebug (no graddebug wrapper anywhere).
        """
        raise NotImplementedError

    def watch(self, run: Any, **options: Any) -> contextlib.AbstractContextManager[Any]:
        """``graddebug.watch`` of the run's model, as this mode watches it."""
        return graddebug.watch(run.model, **options)

    def native(self, array: np.ndarray) -> Any:
        """``array`` as this framework's tensor (a mask given to ``intervene=``)."""
        return array

    def train(self, run: Any, dbg: Any, steps: int = 1) -> None:
        """``steps`` optimizer steps on the batch, closing each with ``dbg`` where given."""
        raise NotImplementedError

    def reference(self) -> Grads:
        """The framework's own gradients at the initial weights: ``"l1.w"``, ``"l1"``, ..."""
        raise NotImplementedError

    def weights(self, run: Any) -> Weights:
        """The model's weights now, as numpy copies."""
        raise NotImplementedError

    def rows(self) -> dict[str, tuple[str, str]]:
        """``(layer, tensor)`` of each parameter's row, by the references' key."""
        raise NotImplementedError

    def probe(self, run: Any) -> Any:
        """What the adapter may change on the model and optimizer, as a comparable value."""
        raise NotImplementedError

    def break_adapter(self, patch: pytest.MonkeyPatch) -> None:
        """Make an internal of the adapter, reached inside its hooks, raise :func:`broken`."""
        raise NotImplementedError


# -- the toy reference adapter --------------------------------------------------------------

def toygrad() -> Any:
    """The example adapter's module, imported from ``examples/adapter``."""
    folder = str(Path(__file__).resolve().parents[2] / "examples" / "adapter")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import toygrad as tg

    return tg


class ToyDriver(Driver):
    """toygrad: ``dbg.step(loss=...)`` after ``backward``, then the SGD step."""

    mode = "toy"

    def __init__(self) -> None:
        self.tg = tg = toygrad()
        self.pm = graddebug.plugins.new_plugin_manager(entry_points=False)
        self.pm.register(tg)

        class Dense(tg.Module):  # type: ignore[misc, name-defined]
            def __init__(self, w: np.ndarray, b: np.ndarray, act: str | None,
                         cut: bool = False) -> None:
                super().__init__()
                self.weight = tg.Var(w, requires_grad=True)
                self.bias = tg.Var(b, requires_grad=True)
                self.act, self.cut = act, cut

            def forward(self, x: Any) -> Any:
                if self.cut:  # a numpy round trip
                    x = tg.Var(np.array(x.value))
                z = x @ self.weight + self.bias
                return getattr(z, self.act)() if self.act else z

        class Net(tg.Module):  # type: ignore[misc, name-defined]
            def __init__(self, variant: str) -> None:
                super().__init__()
                weights = initial_weights(variant == "wide")
                for name, act in zip(LAYERS, ACTS, strict=True):
                    w, b = weights[name]
                    if variant == "nan" and name == "l2":
                        b = np.full_like(b, np.nan)
                    setattr(self, name, Dense(w, b, act, variant == "cut" and name == "l2"))

            def forward(self, x: Any) -> Any:
                return self.l3(self.l2(self.l1(x)))

        self.Net = Net

    def build(self, variant: str = "mlp", plain: bool = False) -> Any:
        model = self.Net(variant)
        return _Run(model, self.tg.SGD(model.parameters(), lr=LR), variant == "wide")

    def watch(self, run: Any, **options: Any) -> contextlib.AbstractContextManager[Any]:
        return graddebug.watch(run.model, plugin_manager=self.pm, **options)

    def train(self, run: Any, dbg: Any, steps: int = 1) -> None:
        x, y = batch(run.wide)
        for _ in range(steps):
            run.optimizer.zero_grad()
            loss = self.tg.mse(run.model(self.tg.Var(x)), y)
            loss.backward()
            if dbg is not None:
                dbg.step(loss=float(loss.value))
            run.optimizer.step()

    def reference(self) -> Grads:
        """toygrad's own backward, with a hook on each layer output to read its gradient."""
        model, (x, y) = self.Net("mlp"), batch()
        outs: Grads = {}
        h = self.tg.Var(x)
        for name in LAYERS:
            h = getattr(model, name)(h)
            h.register_hook(lambda g, name=name: outs.__setitem__(name, g.copy()))
        self.tg.mse(h, y).backward()
        grads = {f"{n}.{k[0]}": getattr(getattr(model, n), k).grad
                 for n in LAYERS for k in ("weight", "bias")}
        return {**grads, **outs}

    def weights(self, run: Any) -> Weights:
        layers = {n: getattr(run.model, n) for n in LAYERS}
        return {n: (m.weight.value.copy(), m.bias.value.copy()) for n, m in layers.items()}

    def rows(self) -> dict[str, tuple[str, str]]:
        return {f"{n}.{t[0]}": (n, t) for n in LAYERS for t in ("weight", "bias")}

    def probe(self, run: Any) -> Any:
        modules = [(n, m.training, len(m._forward_hooks)) for n, m in run.model.named_modules()]
        params = [len(p._hooks) for p in run.model.parameters()]
        return modules, params, len(run.optimizer._post_hooks)

    def break_adapter(self, patch: pytest.MonkeyPatch) -> None:
        patch_path(patch, "toygrad", "_Capture.add")


class _Run:
    """A model, its optimizer, and whether it is the wide MLP."""

    def __init__(self, model: Any, optimizer: Any, wide: bool = False) -> None:
        self.model, self.optimizer, self.wide = model, optimizer, wide


# -- torch ----------------------------------------------------------------------------------

class TorchDriver(Driver):
    """torch: ``backward``, ``optimizer.step()``, then ``dbg.step(loss=...)``."""

    mode = "torch"
    weights_read = "after"  # the weights at the close, which comes after the update

    def __init__(self) -> None:
        import torch

        self.torch = torch

        class Dense(torch.nn.Module):
            def __init__(self, w: np.ndarray, b: np.ndarray, act: str | None,
                         cut: bool = False) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.tensor(w))
                self.bias = torch.nn.Parameter(torch.tensor(b))
                self.act, self.cut = act, cut

            def forward(self, x: Any) -> Any:
                z = (x.detach() if self.cut else x) @ self.weight + self.bias
                return torch.tanh(z) if self.act else z

        class Net(torch.nn.Module):
            def __init__(self, variant: str) -> None:
                super().__init__()
                weights = initial_weights(variant == "wide")
                for name, act in zip(LAYERS, ACTS, strict=True):
                    w, b = weights[name]
                    if variant == "nan" and name == "l2":
                        b = np.full_like(b, np.nan)
                    setattr(self, name, Dense(w, b, act, variant == "cut" and name == "l2"))

            def forward(self, x: Any) -> Any:
                return self.l3(self.l2(self.l1(x)))

        self.Net = Net

    def build(self, variant: str = "mlp", plain: bool = False) -> Any:
        model = self.Net(variant)
        return _Run(model, self.torch.optim.SGD(model.parameters(), lr=LR), variant == "wide")

    def train(self, run: Any, dbg: Any, steps: int = 1) -> None:
        torch = self.torch
        x, y = (torch.tensor(a) for a in batch(run.wide))
        for _ in range(steps):
            run.optimizer.zero_grad()
            loss = torch.mean((run.model(x) - y) ** 2)
            loss.backward()
            run.optimizer.step()
            if dbg is not None:
                dbg.step(loss=loss.detach())

    def native(self, array: np.ndarray) -> Any:
        return self.torch.as_tensor(array)

    def reference(self) -> Grads:
        return torch_grads(initial_weights(), *batch())

    def weights(self, run: Any) -> Weights:
        return {n: (getattr(run.model, n).weight.detach().numpy().copy(),
                    getattr(run.model, n).bias.detach().numpy().copy()) for n in LAYERS}

    def rows(self) -> dict[str, tuple[str, str]]:
        return {f"{n}.{t[0]}": (n, t) for n in LAYERS for t in ("weight", "bias")}

    def probe(self, run: Any) -> Any:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks")
        modules = [(n, m.training, type(m).forward, [len(getattr(m, h)) for h in hooks])
                   for n, m in run.model.named_modules()]
        params = [(len(p._backward_hooks or {}), len(p._post_accumulate_grad_hooks or {}))
                  for p in run.model.parameters()]
        opt = run.optimizer
        optimizer = (sorted(k for k in vars(opt) if "step" in k or "graddebug" in k),
                     len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
        shared = (len(nn_module._global_forward_hooks), len(nn_module._global_forward_pre_hooks),
                  len(optim._global_optimizer_pre_hooks),
                  len(optim._global_optimizer_post_hooks))
        return modules, params, optimizer, shared

    def break_adapter(self, patch: pytest.MonkeyPatch) -> None:
        patch_path(patch, "graddebug_torch.watching", "_unit_dim")
