"""The gradient of a network's output with respect to one hidden layer.

A common debugging question is "what gradient does ``layer_2`` actually receive?". This example
builds a 5-layer MLP (``layer_1`` ... ``layer_5``, tanh between them), asks graddebug to keep the
full gradient at ``layer_2``'s output with ``keep=["layer_2"]``, and checks it three ways:

1. against ``torch.autograd.grad(output.sum(), layer_2_output)``, computed on a separate forward
   pass without graddebug (``layer_2``'s output is grabbed with a plain forward hook);
2. against the chain rule written out by hand in numpy: starting from d(sum)/d(output) = 1, the
   gradient is pulled back through ``layer_5``, ``tanh``, ``layer_4``, ``tanh``, ``layer_3`` and
   ``tanh`` as a product of transposed Jacobians (``g @ W`` for a Linear layer, ``g * (1 - a**2)``
   for ``a = tanh(z)``);
3. by confirming that watching does not change the parameter gradients at all.

Run it with ``python examples/torch/scenario1_layer_gradient.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import graddebug

SEED = 0
BATCH = 8
SIZES = (6, 16, 12, 10, 8, 3)


class FiveLayerMLP(nn.Module):
    """Five Linear layers with tanh between them; the output is the last layer's raw output."""

    def __init__(self, sizes: tuple[int, ...] = SIZES) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(sizes[0], sizes[1])
        self.layer_2 = nn.Linear(sizes[1], sizes[2])
        self.layer_3 = nn.Linear(sizes[2], sizes[3])
        self.layer_4 = nn.Linear(sizes[3], sizes[4])
        self.layer_5 = nn.Linear(sizes[4], sizes[5])

    def forward(self, x: Tensor) -> Tensor:
        """Apply ``layer_1`` ... ``layer_5`` with tanh between consecutive layers."""
        h = torch.tanh(self.layer_1(x))
        h = torch.tanh(self.layer_2(h))
        h = torch.tanh(self.layer_3(h))
        h = torch.tanh(self.layer_4(h))
        return self.layer_5(h)


def build(seed: int = SEED) -> tuple[FiveLayerMLP, Tensor]:
    """Return the model and a batch of inputs, both seeded."""
    torch.manual_seed(seed)
    model = FiveLayerMLP()
    x = torch.randn(BATCH, SIZES[0])
    return model, x


def autograd_reference(model: FiveLayerMLP, x: Tensor) -> np.ndarray:
    """Compute d(output.sum())/d(layer_2 output) with ``torch.autograd.grad`` alone.

    Args:
        model: The MLP.
        x: Its input batch.

    Returns:
        The gradient, with the shape of ``layer_2``'s output.
    """
    seen: dict[str, Tensor] = {}

    def grab(module: nn.Module, args: Any, output: Tensor) -> None:
        seen["layer_2"] = output

    handle = model.layer_2.register_forward_hook(grab)
    try:
        out = model(x)
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(out.sum(), seen["layer_2"])
    return grad.detach().numpy()


def chain_rule_reference(model: FiveLayerMLP, x: Tensor) -> np.ndarray:
    """Pull d(output.sum())/d(output) back to ``layer_2``'s output by hand, in numpy.

    For ``z = a @ W.T + b`` the transposed Jacobian maps ``g`` to ``g @ W``; for ``a = tanh(z)``
    it maps ``g`` to ``g * (1 - a**2)``. The arithmetic runs in float64, so it agrees with the
    float32 model to float32 rounding.

    Args:
        model: The MLP.
        x: Its input batch.

    Returns:
        The gradient at ``layer_2``'s output (before its tanh).
    """
    weights = [
        (layer.weight.detach().double().numpy(), layer.bias.detach().double().numpy())
        for layer in (model.layer_1, model.layer_2, model.layer_3, model.layer_4, model.layer_5)
    ]
    activations = []  # tanh outputs a_1 .. a_4
    a = x.double().numpy()
    for w, b in weights[:4]:
        a = np.tanh(a @ w.T + b)
        activations.append(a)
    out = activations[-1] @ weights[4][0].T + weights[4][1]
    g = np.ones_like(out)  # d(out.sum()) / d(out)
    g = g @ weights[4][0]  # through layer_5
    for index in (3, 2):  # through tanh_4, layer_4, then tanh_3, layer_3
        g = g * (1.0 - activations[index] ** 2)
        g = g @ weights[index][0]
    return g * (1.0 - activations[1] ** 2)  # through tanh_2: now at layer_2's output


def parameter_grads(model: nn.Module) -> list[Tensor]:
    """Return a copy of every parameter's gradient, in ``parameters()`` order.

    Raises:
        RuntimeError: A parameter received no gradient.
    """
    grads = []
    for name, param in model.named_parameters():
        if param.grad is None:
            raise RuntimeError(f"parameter {name!r} received no gradient")
        grads.append(param.grad.clone())
    return grads


def main() -> dict[str, Any]:
    """Capture the gradient at ``layer_2`` with graddebug and compare it with the references.

    Returns:
        ``kept``: the gradient graddebug kept; ``autograd``: the ``torch.autograd.grad``
        reference; ``chain_rule``: the hand-written numpy reference; ``max_abs_diff``: the
        largest difference between ``kept`` and ``autograd``; ``weight_grads_equal``: whether
        the parameter gradients with and without graddebug are identical; ``frame``: the
        record frame.
    """
    model, x = build()
    reference = autograd_reference(model, x)
    chain = chain_rule_reference(model, x)

    model.zero_grad()
    model(x).sum().backward()
    plain_grads = parameter_grads(model)
    model.zero_grad()

    with graddebug.watch(model, keep=["layer_2"]) as dbg:
        model(x).sum().backward()
        dbg.step()
    kept = dbg.tensors(0)["layer_2"]
    watched_grads = parameter_grads(model)
    same = all(torch.equal(a, b) for a, b in zip(plain_grads, watched_grads, strict=True))
    diff = float(np.abs(kept - reference).max())

    frame = dbg.frame()
    print("Gradient of output.sum() with respect to layer_2's output, first two rows:")
    print(np.array2string(kept[:2], precision=5, suppress_small=True))
    print(f"graddebug keep=['layer_2'] vs torch.autograd.grad: max |diff| = {diff:.2e}")
    chain_diff = float(np.abs(kept - chain).max())
    print(f"hand-written chain rule through layer_3..layer_5: max |diff| = {chain_diff:.2e}")
    print(f"parameter gradients unchanged by watching: {same}")
    activations = frame.loc[frame["kind"] == "activation", ["layer", "shape", "norm", "absmax"]]
    print(activations.to_string(index=False))
    return {
        "kept": kept,
        "autograd": reference,
        "chain_rule": chain,
        "max_abs_diff": diff,
        "weight_grads_equal": same,
        "frame": frame,
    }


if __name__ == "__main__":
    main()
