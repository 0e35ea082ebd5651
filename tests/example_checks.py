"""What the example tests of every framework share: running an example, the seed values and
finite-difference reference of scenario 2, and the checks of scenario 4.

Scenario-4 checks take the example's namespace and results, and ``ratio(namespace, name)``: the
first/last-layer gradient norm ratio at initialisation, computed without graddebug.
"""

from __future__ import annotations

import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

Ratio = Callable[[dict[str, Any], str], float]
Scenario = tuple[dict[str, Any], dict[str, Any]]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(framework: str, stem: str) -> Scenario:
    """Run ``examples/<framework>/<stem>.py`` in this process: its namespace and ``main()``."""
    namespace = runpy.run_path(str(EXAMPLES / framework / f"{stem}.py"),
                               run_name=f"example_{stem}")
    return namespace, namespace["main"]()


# -- scenario 2: the split chain rule, L = mean((tanh(x @ W + b) - y0) ** 2) -------------------

W_SEED = np.array([[1.0, 2.0], [3.0, 4.0]])
B_SEED = np.array([0.5, 0.5])
X_SEED = np.array([[0.1, 0.2], [0.3, 0.4]])
Y0_SEED = np.array([[0.8, 0.9], [0.7, 0.6]])


def _loss_from_h(h: np.ndarray) -> float:
    return float(np.mean((np.tanh(h) - Y0_SEED) ** 2))


def _finite_difference(f: Callable[[np.ndarray], float], at: np.ndarray) -> np.ndarray:
    eps = 1e-6
    grad = np.zeros_like(at)
    for index in np.ndindex(at.shape):
        step = np.zeros_like(at)
        step[index] = eps
        grad[index] = (f(at + step) - f(at - step)) / (2 * eps)
    return grad


def finite_difference_reference() -> dict[str, np.ndarray]:
    """dL/dW and dL/dh of scenario 2 by central differences in float64, with no framework."""
    h = X_SEED @ W_SEED + B_SEED
    return {
        "dl_dw": _finite_difference(lambda w: _loss_from_h(X_SEED @ w + B_SEED), W_SEED),
        "dl_dh": _finite_difference(_loss_from_h, h),
    }


# -- scenario 4: vanishing and exploding ---------------------------------------------------------


def depth_of(frame: pd.DataFrame) -> dict[str, int]:
    """The forward-order depth of each layer of a record frame."""
    return {
        str(layer): int(depth) for layer, depth in frame.groupby("layer")["depth"].min().items()
    }


def assert_early_layers_only(findings: pd.DataFrame, frame: pd.DataFrame) -> None:
    """The findings name layer_1, never layer_12, and sit below the unflagged layers."""
    depth = depth_of(frame)
    flagged = set(findings["layer"])
    assert "layer_1" in flagged
    assert "layer_12" not in flagged
    unflagged = set(depth) - flagged
    assert max(depth[layer] for layer in flagged) < max(depth[layer] for layer in unflagged)
    assert min(depth[layer] for layer in flagged) < min(depth[layer] for layer in unflagged)


def check_vanishing(namespace: dict[str, Any], result: dict[str, Any], ratio: Ratio) -> None:
    """The default-initialised sigmoid net vanishes at its early layers, and only there."""
    assert ratio(namespace, "sigmoid_default_init") < 1e-6
    findings = result["findings"]["sigmoid_default_init"]
    assert not findings.empty
    assert set(findings["issue"]) == {"vanishing"}
    assert_early_layers_only(findings, result["frames"]["sigmoid_default_init"])
    assert all("layer_12" in m for m in findings["message"] if "times that of" in m)


def check_exploding(namespace: dict[str, Any], result: dict[str, Any], ratio: Ratio,
                    name: str) -> None:
    """A net with too large weights explodes from layer_1, with finite norms."""
    assert ratio(namespace, name) > 1e2
    findings = result["findings"][name]
    assert not findings.empty
    assert set(findings["issue"]) == {"exploding"}
    assert "layer_1" in set(findings["layer"])
    assert np.isfinite(result["frames"][name]["norm"]).all()  # exploding, not yet NaN


def check_healthy(namespace: dict[str, Any], result: dict[str, Any], ratio: Ratio,
                  name: str) -> None:
    """A healthy net: no finding, every step recorded, finite positive norms."""
    findings, frame = result["findings"][name], result["frames"][name]
    assert findings.empty
    assert list(findings.columns) == [  # the documented contract, spelled out
        "step", "layer", "tensor", "issue", "severity", "value", "threshold", "message", "rank",
        "source", "cause",
    ]
    assert set(frame["kind"]) == {"activation", "parameter"}
    assert frame["step"].nunique() == namespace["STEPS"]
    assert np.isfinite(frame["norm"]).all() and (frame["norm"] > 0).all()
    if name == "relu_he_init":
        assert 1e-2 < ratio(namespace, name) < 1e2
