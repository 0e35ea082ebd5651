"""Built-in diagnoses, one plugin module each, the evidence they share, and :func:`diagnose`.

Each module implements the ``graddebug_findings`` hook. They read only the record frame and the
structural events, so they serve every framework unchanged. :func:`diagnose` runs every detector
plugin (built-in or installed) over a run's frames; the live Watcher and a loaded Report both
call it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from graddebug.frames import combine_ranks, finding_frame
from graddebug.plugins import get_plugin_manager
from graddebug.records import ALL_RANKS, EventKind, Finding, Issue, Kind, Severity

if TYPE_CHECKING:
    import pluggy

    from graddebug.config import Thresholds

__all__ = ["Evidence", "as_int", "diagnose", "finding", "fmt"]


def diagnose(
    records: pd.DataFrame,
    events: pd.DataFrame,
    thresholds: Thresholds,
    *,
    extra: Iterable[Finding] = (),
    plugin_manager: pluggy.PluginManager | None = None,
) -> pd.DataFrame:
    """Run every detector plugin over recorded frames.

    Args:
        records: A record frame (``Watcher.frame()``).
        events: An event frame (``Watcher.events()``).
        thresholds: The thresholds the detectors apply.
        extra: Findings that come from elsewhere (internal errors) and join the result.
        plugin_manager: The manager whose detectors run; the process-wide one by default.

    Returns:
        The findings frame, ordered by step and severity. The rows of a multi-rank run are
        diagnosed combined (:func:`graddebug.frames.combine_ranks`), and each finding says
        which rank shows it.
    """
    pm = plugin_manager or get_plugin_manager()
    evidence = Evidence(records=combine_ranks(records), events=events)
    combined = evidence.records
    found: list[Finding] = []
    for batch in pm.hook.graddebug_findings(evidence=evidence, thresholds=thresholds):
        found.extend(batch)
    return finding_frame([*extra, *_with_ranks(found, combined, events)])


def _with_ranks(found: list[Finding], records: pd.DataFrame, events: pd.DataFrame
                ) -> list[Finding]:
    """Findings with the rank whose rows show them.

    In one rank's rows that rank. In a multi-rank run's combined rows (see
    :func:`graddebug.frames.combine_ranks`), a ``nonfinite`` finding names the lowest rank
    where its tensor was not finite, in the backward rows or a forward event; other findings
    concern every rank (:data:`~graddebug.records.ALL_RANKS`).
    """
    ranks = set(records["rank"].unique()) | set(events["rank"].unique())
    if not found or ranks <= {0}:
        return found
    if len(ranks) == 1:
        only = int(ranks.pop())
        return [f._replace(rank=only) for f in found]
    birth: dict[tuple[int, str, str], int] = {}
    marked = records[records["rank"] != ALL_RANKS]
    nonfinite = events[events["event"] == EventKind.FORWARD_NONFINITE.value]
    for frame in (marked, nonfinite):
        for step, layer, tensor, rank in zip(frame["step"], frame["layer"], frame["tensor"],
                                             frame["rank"], strict=True):
            key = (int(step), str(layer), str(tensor))
            birth[key] = min(int(rank), birth.get(key, int(rank)))
    out = []
    for f in found:
        rank = birth.get((f.step, f.layer, f.tensor), ALL_RANKS) \
            if f.issue == Issue.NONFINITE.value else ALL_RANKS
        if rank != ALL_RANKS:
            f = f._replace(message=f"{f.message} It appeared on rank {rank}.")
        out.append(f._replace(rank=rank))
    return out


@dataclass(frozen=True, eq=False)
class Evidence:
    """What detectors look at.

    Op rows (``kind == "op"``, from op-level capture) are kept apart from the layer-level
    rows: the depth-ordered rules (vanishing, exploding, dead) compare layers with layers, and
    an operation inside a layer is neither upstream nor downstream of it. The ``nonfinite``
    and ``cut_graph`` diagnoses read them, with the op-level events, to name the operation and
    its source line.

    Attributes:
        records: The record frame (``Watcher.frame()``) without its op rows: activation and
            parameter rows. Op rows passed in here move to :attr:`ops`.
        events: The structural events (``Watcher.events()``).
        ops: The op rows (empty without op-level capture).
    """

    records: pd.DataFrame
    events: pd.DataFrame
    ops: pd.DataFrame = field(default_factory=pd.DataFrame)
    _norms: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        records = self.records
        if "kind" not in records:
            return
        is_op = (records["kind"] == Kind.OP.value).to_numpy()
        if is_op.any():
            object.__setattr__(self, "ops", records[is_op])
            object.__setattr__(self, "records", records[~is_op])
        elif self.ops.empty:
            object.__setattr__(self, "ops", records.iloc[:0])

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
            tensor: Any = "", value: float = math.nan,
            threshold: float = math.nan, source: Any = "") -> Finding:
    """Build a :class:`Finding` from pandas/numpy values, converting them to plain types."""
    return Finding(as_int(step), str(layer), str(tensor), issue.value, severity.value,
                   float(value), float(threshold), message, 0, str(source))


def fmt(value: float) -> str:
    """Format a gradient magnitude for a message: ``3.2e-09``, ``0.41``, ``1.7e+05``."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    if 1e-2 <= abs(value) < 1e3:
        return f"{value:.3g}"
    return f"{value:.1e}"
