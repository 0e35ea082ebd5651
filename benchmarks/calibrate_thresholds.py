"""Where healthy and broken networks sit relative to each diagnosis threshold.

Trains every network of ``examples/torch/scenario4_vanishing_exploding.py`` (He-initialised
ReLU MLP, small residual CNN, deep sigmoid MLP, networks with weights that are too large) under
``graddebug.watch`` and prints, for each, the statistic each rule compares with its threshold:

- the smallest and largest first/last-layer ratio of gradient RMS (root mean square per entry)
  over steps (vanishing fires below ``vanishing_ratio``, exploding above ``exploding_ratio``),
  and the same ratio as a factor per layer in between (``vanishing_gain``/``exploding_gain``);
- the largest gradient norm (exploding above ``exploding_norm``);
- the growth of the smoothed total norm (exploding above ``growth_factor``);
- the worst layer's median dead-unit fraction (dead at or above ``dead_fraction``).

The margins between the healthy rows and the thresholds are what the README's defaults rest on.
``--zoo`` adds real architectures at initialisation (2 steps, random inputs), where their
packages are installed: Keras applications (ResNet50, MobileNetV2, EfficientNetB0, 64x64 inputs)
and ``transformers`` models from tiny configs (GPT-2, Llama, BERT, ResNet, ConvNeXt, ViT).
Run by hand: ``python benchmarks/calibrate_thresholds.py [--steps 50] [--zoo] [--json PATH]``.
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
from graddebug.detectors._depth import profile
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
    first = profile(norms)
    first = first[first["pos"] == 0]  # the first layer of each step, against the last
    finite = norms[np.isfinite(norms["norm"])]
    total = np.sqrt((finite["norm"] ** 2).groupby(finite["step"]).sum())
    growth = _smoothed_growth(total, window)[0] if len(total) >= 2 * window else math.nan
    acts = evidence.records[evidence.records["kind"] == "activation"]
    dead = acts.groupby("layer")["zero_frac"].median().max() if len(acts) else math.nan

    def extreme(column: str, pick: Any) -> float:
        return float(pick(first[column])) if len(first) else math.nan

    return {
        "layers": float(first["count"].max()) if len(first) else math.nan,
        "min_ratio": extreme("ratio", np.min),
        "max_ratio": extreme("ratio", np.max),
        "min_gain": extreme("gain", np.min),
        "max_gain": extreme("gain", np.max),
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
    rows: list[dict[str, Any]] = []
    for name in scenario.MODELS:
        healthy = name in HEALTHY
        dbg = scenario.train(name, steps if healthy else scenario.STEPS)
        rows.append(_row(name, healthy, dbg))
    return pd.DataFrame(rows)


def _row(name: str, healthy: bool, dbg: Any) -> dict[str, Any]:
    evidence = Evidence(records=dbg.frame(), events=dbg.events())
    found = dbg.findings()
    return {"model": name, "healthy": healthy,
            "steps": int(dbg.frame()["step"].nunique()),
            **margins(evidence, Thresholds().growth_window),
            "findings": ", ".join(sorted(set(found["issue"]))) or "none"}


def zoo() -> pd.DataFrame:
    """Real architectures at initialisation, 2 steps each, where their packages import."""
    rows: list[dict[str, Any]] = []
    for name, dbg in (*_keras_zoo(), *_transformers_zoo()):
        rows.append(_row(name, True, dbg))
    return pd.DataFrame(rows)


def _keras_zoo() -> list[tuple[str, Any]]:
    try:
        import keras
        import tensorflow as tf
    except ImportError:
        return []
    import graddebug

    out = []
    for app in (keras.applications.ResNet50, keras.applications.MobileNetV2,
                keras.applications.EfficientNetB0):
        keras.utils.set_random_seed(0)
        model = app(weights=None, input_shape=(64, 64, 3))
        x = np.random.default_rng(0).standard_normal((2, 64, 64, 3)).astype(np.float32)
        y = np.array([3, 7])
        with graddebug.watch(model) as dbg:
            for _ in range(2):
                with tf.GradientTape() as tape:
                    loss = keras.losses.SparseCategoricalCrossentropy()(y, model(x, training=True))
                dbg.step(tape.gradient(loss, model.trainable_variables))
        out.append((f"keras {app.__name__}", dbg))
    return out


def _transformers_zoo() -> list[tuple[str, Any]]:
    try:
        import torch
        import transformers as hf
    except ImportError:
        return []
    import graddebug

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 16))
    labels = torch.tensor([0, 1])
    pixels = torch.randn(2, 3, 64, 64)
    text = {"vocab_size": 100, "num_hidden_layers": 2, "num_attention_heads": 2}
    models = {
        "gpt2": (hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2,
                                                  n_head=2)),
                 {"input_ids": ids, "labels": ids}),
        "llama": (hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=32, intermediate_size=64,
                                                     num_key_value_heads=2, **text)),
                  {"input_ids": ids, "labels": ids}),
        "bert": (hf.BertForSequenceClassification(hf.BertConfig(hidden_size=32,
                                                                intermediate_size=64, **text)),
                 {"input_ids": ids, "labels": labels}),
        "resnet": (hf.ResNetForImageClassification(hf.ResNetConfig(num_labels=1000)),
                   {"pixel_values": pixels, "labels": labels}),
        "convnext": (hf.ConvNextForImageClassification(hf.ConvNextConfig(num_labels=1000)),
                     {"pixel_values": pixels, "labels": labels}),
    }
    out = []
    for name, (model, inputs) in models.items():
        with graddebug.watch(model) as dbg:
            for _ in range(2):
                model.zero_grad()
                model(**inputs).loss.backward()
                dbg.step()
        out.append((f"transformers {name}", dbg))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the margins table and write it as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps per network")
    parser.add_argument("--zoo", action="store_true",
                        help="also measure real architectures at initialisation")
    parser.add_argument("--json", type=Path,
                        default=ROOT / "benchmarks" / "results" / "calibration.json")
    args = parser.parse_args(argv)
    frame = calibrate(args.steps)
    if args.zoo:
        frame = pd.concat([frame, zoo()], ignore_index=True)
    t = Thresholds()
    table = Table(title=(
        f"statistic vs threshold: vanishing ratio < {t.vanishing_ratio:g} at < "
        f"{t.vanishing_gain:g}/layer, exploding ratio > {t.exploding_ratio:g} at > "
        f"{t.exploding_gain:g}/layer, norm > {t.exploding_norm:g}, growth > "
        f"{t.growth_factor:g}, dead >= {t.dead_fraction:g}"))
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
