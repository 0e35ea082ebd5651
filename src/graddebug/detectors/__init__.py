"""Built-in diagnoses, one plugin module each, and the evidence they share.

Each module implements the ``graddebug_findings`` hook. They read only the record frame and the
structural events, so they serve every framework unchanged.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from graddebug.records import Finding, Issue, Severity

__all__ = ["Evidence", "as_int", "finding", "fmt"]


@dataclass(frozen=True, eq=False)
class Evidence:
    """What detectors look at.

    Attributes:
        records: The record frame (``Watcher.frame()``).
        events: The structural events (``Watcher.events()``).
    """

    records: pd.DataFrame
    events: pd.DataFrame
    _norms: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def basis(self) -> str:
        """The kind that depth-ordered rules compare: layer outputs when they were captured,
        else parameters."""
        kinds = set(self.records["kind"])
        return "activation" if "activation" in kinds else "parameter"

    def layer_norms(self, kind: str | None = None) -> pd.DataFrame:
        """Per (step, layer): the layer's gradient norm, pooled over its tensors of ``kind``.

        Args:
            kind: ``"activation"`` or ``"parameter"``; None for :attr:`basis`.

        Returns:
            Columns ``step, layer, depth, norm``, sorted by step then depth. Layers whose
            depth is unknown (-1) are left out.
        """
        kind = kind or self.basis
        if kind not in self._norms:
            self._norms[kind] = self._layer_norms(kind)
        return self._norms[kind]

    def _layer_norms(self, kind: str) -> pd.DataFrame:
        rows = self.records[(self.records["kind"] == kind) & (self.records["depth"] >= 0)]
        pooled = (
            rows.assign(_sq=rows["norm"] ** 2)
            .groupby(["step", "layer"], sort=False)
            .agg(depth=("depth", "min"), _sq=("_sq", "sum"))
            .reset_index()
        )
        pooled["norm"] = np.sqrt(pooled.pop("_sq"))
        return pooled.sort_values(["step", "depth"], kind="stable").reset_index(drop=True)

    def steps(self) -> int:
        """Number of recorded steps."""
        return int(self.records["step"].nunique())


def as_int(value: Any) -> int:
    """Convert a pandas/numpy scalar (a step, a depth) to a Python int."""
    return int(value)


def finding(issue: Issue, severity: Severity, step: Any, layer: Any, message: str, *,
            tensor: Any = "", value: float = math.nan,
            threshold: float = math.nan) -> Finding:
    """Build a :class:`Finding` from pandas/numpy values, converting them to plain types."""
    return Finding(as_int(step), str(layer), str(tensor), issue.value, severity.value,
                   float(value), float(threshold), message)


def fmt(value: float) -> str:
    """Format a gradient magnitude for a message: ``3.2e-09``, ``0.41``, ``1.7e+05``."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    if 1e-2 <= abs(value) < 1e3:
        return f"{value:.3g}"
    return f"{value:.1e}"
