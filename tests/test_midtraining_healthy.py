"""Healthy mid-training references give no finding: 500 steps of each model of
``tests/midtraining.py`` (a character-level GPT, a BatchNorm CNN and a tanh MLP on real data,
AdamW with warmup and cosine decay, clipping, dropout) under ``graddebug.watch`` with its
defaults, in torch and in Keras (``fit`` and a ``tf.GradientTape`` loop).

A false finding on a healthy run is as serious as a missed fault: these runs are the
references the history rules' thresholds are chosen on (``benchmarks/calibrate_history.py``).
"""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

import midtraining

pytestmark = pytest.mark.slow

REFERENCES = sorted(midtraining.REFERENCES)


def _table(findings: pd.DataFrame) -> str:
    """The findings as a table, one line each, for the failure message."""
    columns = ["step", "layer", "tensor", "issue", "severity", "value", "threshold", "cause",
               "message"]
    with pd.option_context("display.width", 250, "display.max_colwidth", 200):
        return findings[[c for c in columns if c in findings]].to_string(index=False)


def _assert_no_finding(run: midtraining.Run) -> None:
    findings = run.findings()
    assert findings.empty, (
        f"{run.framework} {run.name} (seed {run.seed}, {len(run.losses)} steps, final loss "
        f"{run.losses[-1]:.4g}) gave {len(findings)} findings on a healthy run:\n"
        f"{_table(findings)}")


@pytest.mark.parametrize("name", REFERENCES)
def test_a_healthy_torch_reference_gives_no_finding(name: str) -> None:
    run = midtraining.run_torch(name, midtraining.STEPS)
    assert run.losses[-1] < run.losses[0]  # it learned: the reference is a real training run
    _assert_no_finding(run)


@pytest.mark.parametrize("mode", ["fit", "tape"])
@pytest.mark.parametrize("name", REFERENCES)
def test_a_healthy_keras_reference_gives_no_finding(name: str, mode: str) -> None:
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    run = midtraining.run_keras(name, midtraining.STEPS, mode=mode)
    assert run.losses[-1] < run.losses[0]
    _assert_no_finding(run)
