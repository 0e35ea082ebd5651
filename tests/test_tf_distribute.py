"""tf.distribute.MirroredStrategy on two logical CPUs: ``fit`` with ``dbg.callback()`` and
custom loops with ``strategy.run``, checked against one replica's ``tape.gradient``.

TensorFlow can split the CPU into devices only before it initialises them, so every
scenario runs in one child process (``tests/tf_distribute_scenarios.py``), once per module.

How the replicas' rows relate to one replica's, on the same global batch of B examples
split over R replicas: Keras divides each replica's mean loss by R (and
``tf.nn.compute_average_loss`` divides each replica's summed loss by B), so each replica's
loss is its examples' loss over B, and the optimizer sums the replicas' gradients. The
gradient at an example's activation is then the same as one replica's on the whole batch:
replica r's activation rows are the norms of its slice of that gradient, and their
combination (``combine_ranks``, the norm of the concatenation) is one replica's norm,
factor 1. With a loss that is each replica's own mean (as under DDP), every gradient is R
times larger: the combination is R times one replica's, as ``combine_ranks`` documents,
and so are the parameter rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

pytestmark = pytest.mark.slow  # one child process that runs a dozen scenarios: about 20 s

SCRIPT = Path(__file__).with_name("tf_distribute_scenarios.py")
LOOPS = ("loop", "loop_eager")
RUNS = ("mirrored_fit", *LOOPS)
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tf_distribute") / "results.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return loaded


def select(rows: list[dict[str, Any]], kind: str, step: int | None = None
           ) -> dict[tuple[int, str, str, int], dict[str, Any]]:
    return {(r["step"], r["layer"], r["tensor"], r["rank"]): r for r in rows
            if r["kind"] == kind and (step is None or r["step"] == step)}


def norms(rows: list[dict[str, Any]], kind: str, *, factor: float = 1.0
          ) -> dict[tuple[int, str, str], float]:
    """``(step, layer, tensor) -> norm * factor``; the rows must have one rank each."""
    out: dict[tuple[int, str, str], float] = {}
    for (step, layer, tensor, _), r in select(rows, kind).items():
        assert (step, layer, tensor) not in out, f"two ranks of {layer}.{tensor}"
        out[(step, layer, tensor)] = r["norm"] * factor
    return out


@pytest.mark.parametrize("run", RUNS)
def test_parameter_rows_equal_one_replica_on_the_global_batch(results, run):
    got = norms(results[run]["frame"], "parameter")
    single = norms(results["single_fit"]["frame"], "parameter")
    assert len(got) == len(single) == 8  # 2 steps x (kernel, bias) x 2 layers
    assert got == pytest.approx(single, rel=1e-5)
    # Step 0 against tape.gradient of one replica, independently of graddebug.
    for path, want in results["reference"]["parameter"].items():
        layer, name = path.split("/")
        assert got[(0, layer, name)] == pytest.approx(want, rel=1e-5)
    assert {r["rank"] for r in results[run]["frame"] if r["kind"] == "parameter"} == {0}


@pytest.mark.parametrize("run", RUNS)
def test_layer_output_rows_are_per_replica(results, run):
    acts = select(results[run]["frame"], "activation")
    assert {rank for *_, rank in acts} == {0, 1}
    assert len(acts) == 2 * 2 * WORLD  # 2 steps x 2 layers x 2 replicas
    for layer, (_, first, second) in results["reference"]["activation"].items():
        # Replica 0 took the first half of the global batch, replica 1 the second.
        assert acts[(0, layer, "output", 0)]["norm"] == pytest.approx(first, rel=1e-5)
        assert acts[(0, layer, "output", 1)]["norm"] == pytest.approx(second, rel=1e-5)
        assert acts[(0, layer, "output", 0)]["numel"] == acts[(0, layer, "output", 1)]["numel"]


@pytest.mark.parametrize("run", RUNS)
def test_replicas_combined_equal_one_replica_under_the_global_mean_loss(results, run):
    combined = results[run]["combined"]
    got = norms(combined, "activation")
    single = norms(results["single_fit"]["frame"], "activation")
    assert len(got) == 4
    assert got == pytest.approx(single, rel=1e-5)  # factor 1: see the module docstring
    for layer, (whole, _, _) in results["reference"]["activation"].items():
        assert got[(0, layer, "output")] == pytest.approx(whole, rel=1e-5)
    assert {r["rank"] for r in combined} == {-1}  # ALL_RANKS
    single_numel = {(r["step"], r["layer"]): r["numel"]
                    for r in results["single_fit"]["frame"] if r["kind"] == "activation"}
    assert {(r["step"], r["layer"]): r["numel"] for r in combined
            if r["kind"] == "activation"} == single_numel


def test_a_local_mean_loss_multiplies_every_row_by_the_world_size(results):
    run = results["loop_local_mean"]
    single = [r for r in results["single_fit"]["frame"] if r["step"] == 0]
    for kind in ("activation", "parameter"):
        rows = [r for r in (run["combined"] if kind == "activation" else run["frame"])
                if r["step"] == 0 and r["kind"] == kind]  # step 1 starts further moved
        assert len(rows) == (2 if kind == "activation" else 4)
        assert norms(rows, kind) == pytest.approx(norms(single, kind, factor=WORLD), rel=1e-5)


def test_the_summary_and_findings_are_those_of_the_combined_run(results):
    fit = results["mirrored_fit"]
    summary = {(r["layer"], r["tensor"]): r for r in fit["summary"]}
    assert len(summary) == 6  # one row per tensor, not per replica
    single = norms(results["single_fit"]["frame"], "activation")
    assert summary[("d1", "output")]["norm_last"] == pytest.approx(
        single[(1, "d1", "output")], rel=1e-5)
    assert fit["findings"] == 0  # a healthy model, on two replicas too


def test_every_and_keep_inside_the_scope(results):
    run = results["mirrored_every"]
    assert {r["step"] for r in run["frame"]} == {0}
    assert norms(run["frame"], "parameter") == pytest.approx(
        {k: v for k, v in norms(results["single_fit"]["frame"], "parameter").items()
         if k[0] == 0}, rel=1e-5)
    acts = select(run["frame"], "activation")
    assert {rank for *_, rank in acts} == {0, 1}
    # keep= holds replica 0's output gradient (the first half of the global batch), and the
    # all-reduced parameter gradients.
    assert run["kept"] == {"d1": [16, 6], "d1.kernel": [8, 6], "d1.bias": [6]}
    reference = results["reference"]
    assert run["kept_norms"] == pytest.approx({
        "d1": reference["activation"]["d1"][1], "d1.kernel": reference["parameter"]["d1/kernel"],
        "d1.bias": reference["parameter"]["d1/bias"]}, rel=1e-5)


@pytest.mark.parametrize("run", ["taps_in_scope", "taps_lazy"])
def test_taps_are_per_replica(results, run):
    run = results[run]
    got = {r["rank"]: r["norm"] for r in run["frame"]}
    first, second = run["reference"]
    assert got == pytest.approx({0: first, 1: second}, rel=1e-5)
    assert run["warnings"] == []


def test_a_strategy_seen_only_while_tracing_records_replica_0_and_says_so(results):
    run = results["taps_unseen"]
    assert [(r["rank"], r["norm"]) for r in run["frame"]] == [
        (0, pytest.approx(run["reference"][0], rel=1e-5))]
    unseen = [w for w in run["warnings"] if "did not see on entering watch()" in w]
    assert len(unseen) == 1
    assert "MirroredStrategy of 2 replicas" in unseen[0]
    assert "only replica 0 is recorded" in unseen[0]


def test_per_replica_gradients_handed_to_step_are_refused(results):
    error = results["per_replica_grads"]
    assert error.startswith("GradientCountError: step() gradient #0")
    assert "PerReplica" in error and "optimizer=opt" in error


def test_mixed_precision_under_the_strategy(results):
    run = results["mirrored_amp"]
    assert run["optimizer"] == "LossScaleOptimizer"
    step0 = [r for r in run["frame"] if r["step"] == 0]
    single = [r for r in results["single_fit"]["frame"] if r["step"] == 0]
    # Unscaled: one float32 replica's gradients, to half precision (the scale is 2**15).
    assert norms(step0, "parameter") == pytest.approx(norms(single, "parameter"), rel=2e-2)
    for layer, (_, first, second) in results["reference"]["activation"].items():
        acts = select(step0, "activation")
        assert acts[(0, layer, "output", 0)]["norm"] == pytest.approx(first, rel=2e-2)
        assert acts[(0, layer, "output", 1)]["norm"] == pytest.approx(second, rel=2e-2)
    assert run["events"] == [[1, "skipped_step", f"scale={2.0**40!r}"]]
    assert {r["step"] for r in run["frame"]} == {0, 1}


def test_the_distribution_is_the_strategy_and_its_replicas(results):
    assert results["mirrored_fit"]["distribution"] == {
        "rank": 0, "world_size": WORLD, "backend": "MirroredStrategy", "processes": 1}


def test_watching_changes_no_weight_under_the_strategy(results):
    assert results["mirrored_fit"]["weights"] == results["unwatched_weights"]


def test_a_run_streamed_to_log_dir_is_complete(results):
    # two steps (64 examples, batch 32), each: two layer outputs per replica, four parameters
    rows = 2 * (2 * WORLD + 4 + 1)  # and one loss row a step
    assert results["log_dir"] == {"status": "complete", "rows": rows, "same_as_live": True}
