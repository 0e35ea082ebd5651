"""Built-in diagnoses, one plugin module each, and the evidence they share.

Each module implements the ``graddebug_findings`` hook. They read only the record frame and the
structural events, so they serve every framework unchanged. :func:`graddebug.diagnosis.diagnose`
runs every detector plugin (built-in or installed) over a run's frames. :mod:`graddebug.plugins`
loads these modules by name, so nothing here imports the plugin manager.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from graddebug.records import Cause, EventKind, Finding, Issue, Kind, Severity

__all__ = ["Evidence", "as_int", "finding", "fmt"]


@dataclass(frozen=True, eq=False)
class Evidence:
    """What detectors look at.

    Op rows (``kind == "op"``, from op-level capture) are kept apart from the layer-level
    rows: the depth-ordered rules (vanishing, exploding, dead) compare layers with layers, and
    an operation inside a layer is neither upstream nor downstream of it. The ``nonfinite``
    and ``cut_graph`` diagnoses read them, with the op-level events, to name the operation and
    its source line.

    The loss rows (``kind == "loss"``) are no gradients either: they move to :attr:`losses`,
    which the history rules read.

    Attributes:
        records: The record frame (``Watcher.frame()``) without its op and loss rows:
            activation and parameter rows. Op rows passed in here move to :attr:`ops`, loss
            rows to :attr:`losses`.
        events: The structural events (``Watcher.events()``).
        ops: The op rows (empty without op-level capture).
        losses: The loss rows (empty where no loss was recorded).
    """

    records: pd.DataFrame
    events: pd.DataFrame
    ops: pd.DataFrame = field(default_factory=pd.DataFrame)
    losses: pd.DataFrame = field(default_factory=pd.DataFrame)
    _norms: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        records = self.records
        if "kind" not in records:
            return
        kind = records["kind"].to_numpy()
        for name, value in (("ops", Kind.OP.value), ("losses", Kind.LOSS.value)):
            moved = kind == value
            if moved.any():
                object.__setattr__(self, name, records[moved])
                records = records[~moved]
                kind = kind[~moved]
            elif getattr(self, name).empty:
                object.__setattr__(self, name, records.iloc[:0])
        object.__setattr__(self, "records", records)

    @functools.cached_property
    def history_rows(self) -> pd.DataFrame:
        """The gradient rows and the loss rows: what the history rules replay, step by step."""
        if self.losses.empty:
            return self.records
        return pd.concat([self.records, self.losses], ignore_index=True)

    @functools.cached_property
    def nonfinite_steps(self) -> frozenset[int]:
        """Steps where some gradient or some layer output held NaN or Inf.

        Op rows and op-level events do not count: an op may hold -inf by design (an attention
        mask) where every layer stays finite.
        """
        records, events = self.records, self.events
        steps: set[Any] = set()
        if len(records):
            steps |= set(records.loc[records["nan"] | records["inf"], "step"])
        if len(events):
            steps |= set(events.loc[events["event"] == EventKind.FORWARD_NONFINITE.value, "step"])
        return frozenset(int(s) for s in steps)

    @functools.cached_property
    def skipped_steps(self) -> frozenset[int]:
        """Steps a loss scaler skipped because the scaled gradients overflowed (their
        non-finite gradients are the scaler's business, see the ``overflow`` diagnosis)."""
        events = self.events
        if events.empty:
            return frozenset()
        skipped = events.loc[events["event"] == EventKind.SKIPPED_STEP.value, "step"]
        return frozenset(int(s) for s in skipped)

    @functools.cached_property
    def clean(self) -> pd.DataFrame:
        """The records of the steps that stayed finite.

        Once a NaN or Inf appears, every gradient behind it is poisoned or zeroed (a NaN
        compares false with every threshold, and an optimizer step with it ruins the weights):
        the ``nonfinite`` finding names its origin, and the magnitude, depth, growth and dead
        rules read only these rows, so the victims of a NaN are not reported again.
        """
        if not self.nonfinite_steps:
            return self.records
        return self.records[~self.records["step"].isin(self.nonfinite_steps)]

    @functools.cached_property
    def basis(self) -> str:
        """The kind that depth-ordered rules compare: layer outputs when they were captured,
        else parameters."""
        kinds = set(self.records["kind"])
        return Kind.ACTIVATION.value if Kind.ACTIVATION.value in kinds else Kind.PARAMETER.value

    def layer_norms(self, kind: str | None = None) -> pd.DataFrame:
        """Per finite step and layer: the layer's gradient norm, pooled over its tensors of
        ``kind``, and its size-normalised norm.

        ``rms`` is ``norm / sqrt(numel)``, the root mean square of the gradient's entries. Norms
        of tensors of different sizes are not comparable: the norm of a 112x112x32 activation
        gradient and that of a 1000-wide logit gradient differ by the square root of their
        sizes even when every entry has the same magnitude. Rules that compare layers with
        each other compare ``rms``; absolute rules keep the published ``norm``.

        Args:
            kind: ``"activation"`` or ``"parameter"``; None for :attr:`basis`.

        Returns:
            Columns ``step, layer, depth, norm, rms``, sorted by step then depth. Layers whose
            depth is unknown (-1) and steps in :attr:`nonfinite_steps` are left out.
        """
        kind = kind or self.basis
        if kind not in self._norms:
            self._norms[kind] = self._layer_norms(kind)
        return self._norms[kind]

    def _layer_norms(self, kind: str) -> pd.DataFrame:
        records = self.clean
        rows = records[(records["kind"] == kind) & (records["depth"] >= 0)]
        pooled = (
            rows.assign(_sq=rows["norm"].to_numpy(dtype=float) ** 2,
                        _n=rows["numel"].to_numpy(dtype=float))
            .groupby(["step", "layer"], sort=False, observed=True)
            .agg(depth=("depth", "min"), _sq=("_sq", "sum"), _n=("_n", "sum"))
            .reset_index()
        )
        squares, sizes = pooled.pop("_sq").to_numpy(), pooled.pop("_n").to_numpy()
        pooled["norm"] = np.sqrt(squares)
        with np.errstate(divide="ignore", invalid="ignore"):
            pooled["rms"] = np.where(sizes > 0, np.sqrt(squares / np.maximum(sizes, 1)), np.nan)
        return pooled.sort_values(["step", "depth"], kind="stable").reset_index(drop=True)

    def steps(self) -> int:
        """Number of recorded steps."""
        return int(self.records["step"].nunique())

    def clean_steps(self) -> int:
        """Number of recorded steps that stayed finite."""
        return int(self.clean["step"].nunique())


def as_int(value: Any) -> int:
    """Convert a pandas/numpy scalar (a step, a depth) to a Python int."""
    return int(value)


def finding(issue: Issue, severity: Severity, step: Any, layer: Any, message: str, *,
            cause: Cause, tensor: Any = "", value: float = math.nan,
            threshold: float = math.nan, source: Any = "") -> Finding:
    """Build a :class:`Finding` from pandas/numpy values, converting them to plain types.

    Args:
        cause: Where to look first; every built-in diagnosis names one.
    """
    return Finding(as_int(step), str(layer), str(tensor), issue.value, severity.value,
                   float(value), float(threshold), message, 0, str(source), cause.value)


def fmt(value: float) -> str:
    """Format a gradient magnitude for a message: ``3.2e-09``, ``0.41``, ``1.7e+05``."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    if 1e-2 <= abs(value) < 1e3:
        return f"{value:.3g}"
    return f"{value:.1e}"
