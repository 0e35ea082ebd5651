"""Checks of seed scenario 4 (vanishing and exploding) that hold for every framework's example.

Each framework's test passes its example's namespace and results, and ``ratio(namespace, name)``:
the first/last-layer gradient norm ratio at initialisation, computed without graddebug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

Ratio = Callable[[dict[str, Any], str], float]


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
        "step", "layer", "tensor", "issue", "severity", "value", "threshold", "message",
    ]
    assert set(frame["kind"]) == {"activation", "parameter"}
    assert frame["step"].nunique() == namespace["STEPS"]
    assert np.isfinite(frame["norm"]).all() and (frame["norm"] > 0).all()
    if name == "relu_he_init":
        assert 1e-2 < ratio(namespace, name) < 1e2
