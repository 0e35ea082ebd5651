"""How far a healthy run's gradient statistics stray from their own recent history.

Trains every healthy reference of ``tests/midtraining.py`` (torch; Keras under ``fit`` and under
a ``tf.GradientTape`` loop: a character-level GPT on standard-library source text, a BatchNorm
CNN and a tanh MLP on ``load_digits``; AdamW, warmup then cosine decay to 0, clipping at global
norm 1, dropout) under ``graddebug.watch`` with its defaults, and measures, for every series:

- the gradient ``norm`` of every activation and parameter row (``grad``);
- the parameter rows' ``weight_norm`` and ``update_norm`` and their update/weight ratio
  (``weight``, ``update``, ``ratio``), where the frame has them; ``ratio*`` is the same ratio
  measured exactly by the training loop itself (float64, every entry), for comparison;
- the batch loss (``loss``, its value, not its log).

At each step t >= ``--start``, over the previous W recorded steps (W in ``--windows``, fewer at
the start), ``d_t = log10(x_t) - median(log10 x)`` and ``MAD = median(|log10 x - median|)``;
the table gives the largest ``|d_t|`` as a factor ``10**|d|`` and the largest robust score
``|d_t| / (1.4826 * MAD)``, per reference, by tensor kind and size (numel < 32, < 1024,
>= 1024). For the loss, ``d_t`` is ``loss_t - median`` (no log) and the factor column is the
largest ``loss_t / median``. Zero values (an update of exactly 0, at lr 0) are not in any
window; ``zeros`` counts them at t >= ``--start``, and ``inf z`` the steps whose window had a
MAD of 0 and a nonzero deviation. The robust scores with a MAD floor are in the JSON.

The largest values over every reference are what the history rules' default thresholds rest
on: a rule must stay above each of them on a healthy run. Run by hand::

    python benchmarks/calibrate_history.py                      # everything, 2 seeds
    python benchmarks/calibrate_history.py --frameworks torch --seeds 0 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the references live with the tests that use them

import midtraining  # noqa: E402
from graddebug import Thresholds  # noqa: E402

FRAMEWORKS = ("torch", "keras-fit", "keras-tape")
SIZES = ((32, "<32"), (1024, "<1024"), (math.inf, ">=1024"))
MAD_SCALE = 1.4826
"""MAD times this estimates the standard deviation of a normal sample."""
MAD_FLOOR = 0.01
"""A floor on the MAD (in log10 units, a factor 1.023) for the floored score of the JSON: a
series that stays constant would otherwise score infinity on its first change."""


@dataclass(frozen=True)
class Series:
    """Values of one tensor over the recorded steps.

    Attributes:
        quantity: ``grad``, ``weight``, ``update``, ``ratio``, ``ratio*`` or ``loss``.
        kind: ``activation``, ``parameter`` or ``loss``.
        name: ``layer/tensor``.
        numel: Entries of the tensor (1 for the loss).
        steps: The recorded steps, ascending.
        values: The value at each step (NaN where missing).
    """

    quantity: str
    kind: str
    name: str
    numel: int
    steps: np.ndarray
    values: np.ndarray


def _matrix(frame: pd.DataFrame, column: str, kind: str, quantity: str) -> list[Series]:
    """One Series per (layer, tensor) of ``frame``'s ``kind`` rows, from ``column``."""
    rows = frame[frame["kind"] == kind].drop_duplicates(["layer", "tensor", "step"])
    if rows.empty or column not in rows or not np.isfinite(rows[column]).any():
        return []
    wide = rows.pivot(index=["layer", "tensor"], columns="step", values=column)
    numel = rows.groupby(["layer", "tensor"])["numel"].first()
    steps = wide.columns.to_numpy()
    return [Series(quantity, kind, f"{layer}/{tensor}", int(numel[(layer, tensor)]), steps,
                   wide.loc[(layer, tensor)].to_numpy(np.float64))
            for layer, tensor in wide.index]


def series_of(run: midtraining.Run) -> list[Series]:
    """Every series the calibration measures in one run."""
    frame = run.frame()
    out = [*_matrix(frame, "norm", "activation", "grad"),
           *_matrix(frame, "norm", "parameter", "grad")]
    params = frame[frame["kind"] == "parameter"]
    if {"weight_norm", "update_norm"} <= set(params.columns):
        out += _matrix(params, "weight_norm", "parameter", "weight")
        out += _matrix(params, "update_norm", "parameter", "update")
        out += _matrix(params.assign(ratio=params["update_norm"] / params["weight_norm"]),
                       "ratio", "parameter", "ratio")
    if run.updates is not None:
        own = run.updates.assign(kind="parameter",
                                 ratio=run.updates["update_norm"] / run.updates["weight_norm"])
        out += _matrix(own, "ratio", "parameter", "ratio*")
    out.append(Series("loss", "loss", "loss", 1, np.arange(len(run.losses)),
                      np.asarray(run.losses, np.float64)))
    return out


def deviations(values: np.ndarray, window: int, start: int, log: bool = True
               ) -> dict[str, np.ndarray]:
    """``d_t`` and ``MAD_t`` of one series against its previous ``window`` values.

    Args:
        values: The series.
        window: How many previous values make the history.
        start: The first step judged.
        log: Take log10 first (every quantity but the loss). Values <= 0 or non-finite are
            left out of the windows.

    Returns:
        ``d``, ``mad`` and ``zero`` (the value was exactly 0) for each step from ``start``,
        NaN where the window held fewer than 3 usable values.
    """
    x = np.asarray(values, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where((x > 0) & np.isfinite(x), np.log10(x), np.nan) if log else \
            np.where(np.isfinite(x), x, np.nan)
    padded = np.concatenate([np.full(window, np.nan), v])
    hist = np.lib.stride_tricks.sliding_window_view(padded, window)[: len(v)]  # t-W .. t-1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        med = np.nanmedian(hist, axis=1)
        mad = np.nanmedian(np.abs(hist - med[:, None]), axis=1)
    enough = np.sum(np.isfinite(hist), axis=1) >= 3
    d = np.where(enough, v - med, np.nan)
    return {"d": d[start:], "mad": np.where(enough, mad, np.nan)[start:],
            "med": med[start:], "zero": (x == 0)[start:] & enough[start:]}


def size_bucket(numel: int) -> str:
    """``<32``, ``<1024`` or ``>=1024``."""
    return next(label for limit, label in SIZES if numel < limit)


def phases(steps: np.ndarray, total: int) -> dict[str, np.ndarray]:
    """Which steps lie in each phase of the schedule: ``warmup`` (the learning rate rising
    from 0), ``decay`` (the cosine, down to 2.9% of the peak at 90% of the run) and ``tail``
    (the last 10%, down to 0)."""
    tail = int(0.9 * total)
    return {"warmup": steps < midtraining.WARMUP,
            "decay": (steps >= midtraining.WARMUP) & (steps < tail), "tail": steps >= tail}


def extremes(series: list[Series], windows: list[int], start: int, total: int
             ) -> list[dict[str, Any]]:
    """The largest deviation and robust score of each (quantity, kind, size, phase, window)
    group."""
    best: dict[tuple[str, str, str, str, int], dict[str, Any]] = {}
    for s in series:
        size = "all" if s.kind == "loss" else size_bucket(s.numel)
        for w in windows:
            dev = deviations(s.values, w, start, log=s.kind != "loss")
            for phase, where in phases(s.steps[start:], total).items():
                if where.any():
                    _extreme(best, s, size, phase, w,
                             {k: v[where] for k, v in dev.items()}, s.steps[start:][where])
    return list(best.values())


def _extreme(best: dict[tuple[str, str, str, str, int], dict[str, Any]], s: Series,
             size: str, phase: str, w: int, dev: dict[str, np.ndarray], steps: np.ndarray
             ) -> None:
    """Fold one series' deviations in one phase into its group's maxima."""
    cell = best.setdefault((s.quantity, s.kind, size, phase, w), {
        "quantity": s.quantity, "kind": s.kind, "size": size, "phase": phase, "window": w,
        "series": 0, "factor": 0.0, "factor_at": "", "z": 0.0, "z_at": "", "z_floor": 0.0,
        "z_floor_at": "", "up": 0.0, "down": 0.0, "zeros": 0, "inf_z": 0})
    cell["series"] += 1
    d, mad = dev["d"], dev["mad"]
    cell["zeros"] += int(dev["zero"].sum())
    ok = np.isfinite(d)
    if not ok.any():
        return
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.abs(d) / (MAD_SCALE * mad)
        z_floor = np.abs(d) / (MAD_SCALE * np.maximum(mad, MAD_FLOOR))
        # the loss is judged as a value: its factor is loss_t / median, the others 10**|d|
        factor = (d + dev["med"]) / dev["med"] if s.kind == "loss" else 10 ** np.abs(d)
        up, down = (d, -d) if s.kind == "loss" else (10 ** d, 10 ** -d)
    cell["inf_z"] += int(np.sum(ok & (mad == 0) & (d != 0)))
    _keep(cell, "factor", np.where(ok, factor, np.nan), steps, s.name)
    cell["up"] = max(cell["up"], float(np.nanmax(np.where(ok, up, np.nan))))
    cell["down"] = max(cell["down"], float(np.nanmax(np.where(ok, down, np.nan))))
    _keep(cell, "z", np.where(ok & np.isfinite(z), z, np.nan), steps, s.name)
    _keep(cell, "z_floor", np.where(ok, z_floor, np.nan), steps, s.name)


def _keep(cell: dict[str, Any], column: str, values: np.ndarray, steps: np.ndarray,
          name: str) -> None:
    """Keep the largest of ``values`` in ``cell[column]``, and where it was."""
    if not np.isfinite(values).any():
        return
    i = int(np.nanargmax(values))
    if values[i] > cell[column]:
        cell[column], cell[f"{column}_at"] = float(values[i]), f"{name}@{int(steps[i])}"


def sustained(frame: pd.DataFrame, t: Any, start: int) -> dict[str, tuple[float, str]]:
    """The largest sustained move of each family (``grad``, ``ratio``) in one run: over
    ``streak`` steps in a row, net of each step's common move, against the median of the
    ``history_window`` steps before the streak (frozen), in one direction and beyond
    ``history_sigma`` robust deviations of that window (1.4826 MAD, or the mean absolute
    deviation where larger), on tensors of ``history_numel`` entries or more, as the
    sustained rule judges it (``t``: a :class:`graddebug.Thresholds`). An upper bound: the
    rule also ends a streak at an abrupt excursion.

    The common move is the rule's: for gradients, the move of the deepest layer output; for
    update/weight ratios, the median move of every ratio.

    Returns:
        Per family, the factor ``10**move`` and ``layer/tensor@first step`` where it was.
    """
    window, streak = t.history_window, t.history_sustain_steps
    rows = frame[(frame["kind"] != "op") & (frame["numel"] >= t.history_numel)]
    rows = rows.drop_duplicates(["layer", "tensor", "step"])
    out: dict[str, tuple[float, str]] = {}
    for family in ("grad", "ratio"):
        if family == "grad":
            values = rows.assign(x=rows["norm"])
        elif {"weight_norm", "update_norm"} <= set(rows.columns):
            params = rows[rows["kind"] == "parameter"]
            values = params.assign(x=params["update_norm"] / params["weight_norm"])
        else:
            continue
        wide = values.pivot(index="step", columns=["layer", "tensor"], values="x")
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.where(wide.to_numpy() > 0, np.log10(wide.to_numpy()), np.nan)
        if not np.isfinite(logs).any():
            continue
        padded = np.vstack([np.full((window, logs.shape[1]), np.nan), logs])
        hist = np.lib.stride_tricks.sliding_window_view(padded, window, axis=0)[: len(logs)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            med = np.nanmedian(hist, axis=2)
            d = np.where(np.sum(np.isfinite(hist), axis=2) >= 3, logs - med, np.nan)
            dev = np.abs(hist - med[..., None])
            spread = np.maximum(MAD_SCALE * np.nanmedian(dev, axis=2), np.nanmean(dev, axis=2))
            if family == "grad":
                depth = values.groupby(["layer", "tensor"])["depth"].first()[wide.columns]
                kinds = values.groupby(["layer", "tensor"])["kind"].first()[wide.columns]
                deepest = int(np.argmax(np.where(kinds.to_numpy() == "activation",
                                                 depth.to_numpy(), -1)))
                common = np.nan_to_num(d[:, deepest])
            else:
                common = np.nan_to_num(np.nanmedian(d, axis=1))
        best, where = 0.0, ""
        for i in range(start, len(logs) - streak + 1):
            moves = logs[i:i + streak] - med[i] - common[i:i + streak, None]
            size = np.min(np.sign(moves[0]) * moves, axis=0)  # the smallest, same direction
            size = np.where(size >= t.history_sigma * spread[i], size, np.nan)
            if np.isfinite(size).any() and np.nanmax(size) > best:
                j = int(np.nanargmax(size))
                best = float(size[j])
                where = f"{'/'.join(wide.columns[j])}@{int(wide.index[i])}"
        out[family] = (10 ** best, where)
    return out


def run_one(name: str, framework: str, steps: int, seed: int) -> midtraining.Run:
    """Train one healthy reference, measuring its updates in the loop too."""
    if framework == "torch":
        return midtraining.run_torch(name, steps, seed=seed, measure_updates=True)
    return midtraining.run_keras(name, steps, seed=seed, mode=framework.split("-")[1],
                                 measure_updates=True)


def calibrate(references: list[str], frameworks: list[str], steps: int, seeds: list[int],
              windows: list[int], start: int, console: Console
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and measure every run.

    Returns:
        One row per run (times, losses, findings) and one row per run and group.
    """
    runs, groups = [], []
    for framework in frameworks:
        for name in references:
            for seed in seeds:
                began = time.perf_counter()
                run = run_one(name, framework, steps, seed)
                found = run.findings()
                shifts = sustained(run.frame(), Thresholds(), start)
                runs.append({
                    "sustained": {k: {"factor": v[0], "at": v[1]} for k, v in shifts.items()},
                    "reference": name, "framework": framework, "seed": seed,
                    "seconds": round(run.seconds, 1),
                    "total_seconds": round(time.perf_counter() - began, 1),
                    "loss_first": run.losses[0], "loss_last20": float(np.mean(run.losses[-20:])),
                    "graddebug_updates": bool(
                        "update_norm" in run.frame()
                        and np.isfinite(run.frame()["update_norm"]).any()),
                    "findings": [f"{r.issue}:{r.layer}@{r.step}" for r in found.itertuples()],
                    "messages": [str(m) for m in found["message"]]})
                console.print(f"{framework} {name} seed {seed}: {run.seconds:.1f} s, "
                              f"loss {run.losses[0]:.3f} -> {runs[-1]['loss_last20']:.3f}, "
                              f"{len(found)} findings")
                for row in extremes(series_of(run), windows, start, steps):
                    groups.append({"reference": name, "framework": framework, "seed": seed,
                                   **row})
    return runs, groups


def _sustained_table(runs: list[dict[str, Any]]) -> Table:
    """The largest sustained move per family over every run, beside its threshold."""
    t = Thresholds()
    table = Table(title=f"largest sustained move ({t.history_sustain_steps}-step streak, net "
                        f"of the common move, frozen median of {t.history_window} steps)")
    for column in ("family", "largest x", "at", "threshold x"):
        table.add_column(column)
    limits = {"grad": t.history_sustain_grad_factor, "ratio": t.history_sustain_factor}
    for family, limit in limits.items():
        cells = [(r["sustained"][family]["factor"], r) for r in runs if family in r["sustained"]]
        if not cells:
            continue
        factor, r = max(cells, key=lambda c: c[0])
        table.add_row(family, f"{factor:.3g}", f"{r['sustained'][family]['at']} "
                      f"({r['framework']}/{r['reference']}/s{r['seed']})", f"{limit:g}")
    return table


def _fmt(value: float) -> str:
    return "-" if not value else f"{value:.3g}"


def _table(frame: pd.DataFrame, windows: list[int], by: list[str], title: str,
           where_window: int) -> Table:
    """Maxima over seeds (and over whatever ``by`` leaves out), one column pair per window."""
    table = Table(title=title)
    for column in by:
        table.add_column(column)
    for w in windows:
        table.add_column(f"W{w} x", justify="right")
        table.add_column(f"W{w} z", justify="right")
    table.add_column("zeros", justify="right")
    table.add_column("inf z", justify="right")
    table.add_column(f"largest x (W{where_window}) at")
    table.add_column(f"largest z (W{where_window}) at")
    for key, group in frame.groupby(by, sort=False):
        cells = list(key) if isinstance(key, tuple) else [key]
        for w in windows:
            g = group[group["window"] == w]
            cells += [_fmt(g["factor"].max()), _fmt(g["z"].max())]
        g = group[group["window"] == where_window]
        per_run = g.groupby(["framework", "reference", "seed"])
        cells += [str(int(per_run["zeros"].sum().max())), str(int(per_run["inf_z"].sum().max())),
                  _where(g, "factor"), _where(g, "z")]
        table.add_row(*cells)
    return table


def _where(group: pd.DataFrame, column: str) -> str:
    """``tensor@step (framework/reference/seed)`` of the largest ``column`` in ``group``."""
    if not len(group) or not group[column].max() > 0:
        return ""
    top = group.loc[group[column].idxmax()]
    return f"{top[column + '_at']} ({top['framework']}/{top['reference']}/s{top['seed']})"


def main(argv: list[str] | None = None) -> int:
    """Train, measure, print the tables and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=midtraining.STEPS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--references", default="gpt,cnn,tanh_mlp")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--windows", type=int, nargs="+", default=[10, 20, 50])
    parser.add_argument("--start", type=int, default=8, help="first step judged")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", type=Path,
                        default=ROOT / "benchmarks" / "results" / "calibrate_history.json")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    console = Console(width=200)
    runs, groups = calibrate(args.references.split(","), args.frameworks.split(","),
                             args.steps, args.seeds, args.windows, args.start, console)
    runs_table = Table(title="runs (seconds: the training loop under graddebug.watch)")
    for column in ("framework", "reference", "seed", "seconds", "loss_first", "loss_last20",
                   "graddebug_updates", "findings"):
        runs_table.add_column(column)
    for r in runs:
        runs_table.add_row(r["framework"], r["reference"], str(r["seed"]), f"{r['seconds']:.1f}",
                           f"{r['loss_first']:.3f}", f"{r['loss_last20']:.3f}",
                           str(r["graddebug_updates"]), ", ".join(r["findings"]) or "none")
    console.print(runs_table)
    console.print(_sustained_table(runs))
    frame = pd.DataFrame(groups)
    where = 20 if 20 in args.windows else args.windows[0]
    console.print(_table(frame, args.windows, ["quantity", "kind", "size", "phase"],
                         "every reference: largest factor 10**|d| (x) and robust score "
                         "|d|/(1.4826 MAD) (z)", where))
    console.print(_table(frame, args.windows, ["framework", "reference", "quantity", "kind",
                                               "size"],
                         "per reference (maxima over seeds)", where))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "threads": args.threads or None},
        "settings": {"steps": args.steps, "seeds": args.seeds, "windows": args.windows,
                     "start": args.start, "mad_scale": MAD_SCALE, "mad_floor": MAD_FLOOR},
        "runs": runs, "groups": groups}, indent=2, default=float))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
