"""Where healthy and broken networks sit relative to each diagnosis threshold.

Trains every network of ``examples/torch/scenario4_vanishing_exploding.py`` (He-initialised
ReLU MLP, small residual CNN, deep sigmoid MLP, networks with weights that are too large) under
``graddebug.watch`` and prints, for each, the statistic each rule compares with its threshold:

- the smallest and largest first/last-layer gradient norm ratio over steps (vanishing fires
  below ``vanishing_ratio``, exploding above ``exploding_ratio``);
- the largest gradient norm (exploding above ``exploding_norm``);
- the growth of the smoothed total norm (exploding above ``growth_factor``);
- the worst layer's median dead-unit fraction (dead at or above ``dead_fraction``).

The margins between the healthy rows and the thresholds are what the README's defaults rest on.
Run by hand: ``python benchmarks/calibrate_thresholds.py [--steps 50] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from graddebug import Thresholds
from graddebug.detectors import Evidence
from graddebug.detectors.exploding import _smoothed_growth

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "torch" / "scenario4_vanishing_exploding.py"
HEALTHY = ("relu_he_init", "small_resnet")
"""The scenario's networks that must give no finding."""


def load_scenario() -> ModuleType:
    """Import the scenario-4 example as a module."""
    spec = importlib.util.spec_from_file_location("scenario4", SCENARIO)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(SCENARIO)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scenario4"] = module
    spec.loader.exec_module(module)
    return module


def margins(evidence: Evidence, window: int) -> dict[str, float]:
    """The statistic behind each rule, for one run."""
    norms = evidence.layer_norms()
    ratios = []
    for _, rows in norms.groupby("step"):
        values = rows["norm"].to_numpy()
        values = values[np.isfinite(values) & (values > 0)]
        if len(values) >= 2:
            ratios.append(values[0] / values[-1])
    finite = norms[np.isfinite(norms["norm"])]
    total = np.sqrt((finite["norm"] ** 2).groupby(finite["step"]).sum())
    growth = _smoothed_growth(total, window)[0] if len(total) >= 2 * window else math.nan
    acts = evidence.records[evidence.records["kind"] == "activation"]
    dead = acts.groupby("layer")["zero_frac"].median().max() if len(acts) else math.nan
    return {
        "min_ratio": float(min(ratios)) if ratios else math.nan,
        "max_ratio": float(max(ratios)) if ratios else math.nan,
        "max_norm": float(evidence.records["norm"].max()),
        "growth": float(growth),
        "worst_dead": float(dead),
    }


def calibrate(steps: int) -> pd.DataFrame:
    """Train each scenario-4 network and measure its margins.

    Healthy networks train for ``steps`` steps; broken ones for the example's own count, as
    they head for NaN soon after.
    """
    scenario = load_scenario()
    window = Thresholds().growth_window
    rows: list[dict[str, Any]] = []
    for name in scenario.MODELS:
        healthy = name in HEALTHY
        dbg = scenario.train(name, steps if healthy else scenario.STEPS)
        evidence = Evidence(records=dbg.frame(), events=dbg.events())
        found = dbg.findings()
        rows.append({"model": name, "healthy": healthy,
                     "steps": int(dbg.frame()["step"].nunique()),
                     **margins(evidence, window),
                     "findings": ", ".join(sorted(set(found["issue"]))) or "none"})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    """Print the margins table and write it as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps per network")
    parser.add_argument("--json", type=Path,
                        default=ROOT / "benchmarks" / "results" / "calibration.json")
    args = parser.parse_args(argv)
    frame = calibrate(args.steps)
    t = Thresholds()
    table = Table(title=(
        f"statistic vs threshold: vanishing ratio < {t.vanishing_ratio:g}, exploding ratio > "
        f"{t.exploding_ratio:g}, norm > {t.exploding_norm:g}, growth > {t.growth_factor:g}, "
        f"dead >= {t.dead_fraction:g}"))
    for column in frame.columns:
        table.add_column(column, justify="left" if column in ("model", "findings") else "right")
    for row in frame.itertuples(index=False):
        table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row))
    Console(width=160).print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"thresholds": t.as_dict(),
                                     "rows": frame.to_dict(orient="records")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
