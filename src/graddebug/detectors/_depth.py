"""What the vanishing and exploding detectors share: the depth-ratio rule, evaluated for all
steps at once, and the search for the layer where the gradient jumps or collapses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

__all__ = ["DepthTrend", "Jump", "depth_trend", "find_jump", "profile"]


@dataclass(frozen=True)
class Jump:
    """Where one layer's backward changed the gradient most.

    Attributes:
        layer: The layer across whose backward the change happened (the deeper of the pair).
        below: The layer just upstream of it in forward order: its input's producer.
        gain: ``rms(below) / rms(layer)``: above 1 the gradient grew, below 1 it shrank.
    """

    layer: str
    below: str
    gain: float


@dataclass
class DepthTrend:
    """The layers a depth-ratio rule flagged over a run, and what explains them.

    Attributes:
        victims: Flagged layer -> its worst ratio to the last layer, in depth order.
        steps: Number of steps in which the rule fired.
        first_step: The first of those steps.
        last_layer: The deepest layer, the one every ratio compares with.
        jump: The single layer that accounts for most of the change, if one does.
    """

    victims: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    first_step: int = -1
    last_layer: str = ""
    jump: Jump | None = None

    @property
    def named(self) -> str:
        """The layer the finding names: the jump's source, else the farthest victim."""
        return self.jump.layer if self.jump is not None else next(iter(self.victims))


def profile(norms: pd.DataFrame) -> pd.DataFrame:
    """Usable rows of ``Evidence.layer_norms()`` (finite, positive ``rms``) with, per step,
    each layer's position, the step's layer count and its ratio to the last layer.

    The ratio's ``gain`` is its geometric mean per layer in between:
    ``(rms / rms_last) ** (1 / layers_between)``. Exploding and vanishing gradients compound
    layer by layer, so a real trend shows up as a per-layer factor away from 1, while a
    healthy deep network's head, pooling and normalisation change the scale once, by a factor
    that, spread over its depth, stays close to 1.
    """
    rms = norms["rms"].to_numpy(dtype=float)
    rows = norms[np.isfinite(rms) & (rms > 0)].copy()
    by_step = rows.groupby("step", sort=False)
    rows["pos"] = by_step.cumcount()
    rows["count"] = by_step["rms"].transform("size")
    rows["ratio"] = rows["rms"] / by_step["rms"].transform("last")
    between = (rows["count"] - 1 - rows["pos"]).to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rows["gain"] = np.where(between > 0, rows["ratio"] ** (1.0 / np.maximum(between, 1)),
                                1.0)
    usable: pd.DataFrame = rows[rows["count"] >= 2]
    return usable


def depth_trend(flags: pd.Series, rows: pd.DataFrame, grow: bool, share: float) -> DepthTrend:
    """Collect what a depth-ratio rule found.

    A step shows the problem when its first layer is flagged; the layers flagged in those
    steps take part in it.

    Args:
        flags: Per row of ``rows``: the layer's ratio and gain cross the rule's thresholds.
        rows: :func:`profile` of the run.
        grow: True for exploding (larger ratios are worse), False for vanishing.
        share: The part of the change one layer must account for to be named its source.

    Returns:
        The trend; empty ``victims`` when the rule never fired.
    """
    fired_steps = rows.loc[flags & (rows["pos"] == 0), "step"]
    if fired_steps.empty:
        return DepthTrend()
    fired = rows["step"].isin(set(fired_steps))
    hits = rows[fired & flags & (rows["pos"] < rows["count"] - 1)]
    if hits.empty:
        return DepthTrend()
    worst = hits.groupby("layer", sort=False).agg(
        depth=("depth", "min"), worst=("ratio", "max" if grow else "min")
    ).sort_values("depth", kind="stable")
    first = int(fired_steps.min())
    step_rows = rows[rows["step"] == first]
    return DepthTrend(
        victims={str(k): float(v) for k, v in worst["worst"].items()},
        steps=int(fired_steps.nunique()),
        first_step=first,
        last_layer=str(step_rows["layer"].iloc[-1]),
        jump=find_jump(step_rows, grow, share),
    )


def find_jump(step_rows: pd.DataFrame, grow: bool, share: float) -> Jump | None:
    """The layer whose backward accounts for at least ``share`` of the change (in log scale)
    between the last layer and the most extreme one, in one step's depth-ordered rows.

    A weight a million times too large multiplies the gradient by about a million in its own
    backward: the layers below it are victims, and it is the source. A deep sigmoid stack
    shrinks the gradient by a similar factor at every layer: no layer is the source.
    """
    rms = step_rows["rms"].to_numpy(dtype=float)
    if rms.size < 2:
        return None
    steps = np.log(rms[:-1]) - np.log(rms[1:])  # log gain across the backward of layer i+1
    extreme = np.log(rms.max() if grow else rms.min()) - np.log(rms[-1])
    at = int(np.argmax(steps) if grow else np.argmin(steps))
    if extreme == 0 or not math.isfinite(extreme) or steps[at] / extreme < share:
        return None
    layers = step_rows["layer"].to_numpy()
    return Jump(str(layers[at + 1]), str(layers[at]), float(math.exp(steps[at])))
