"""Tensor parallelism, FSDP2 x TP and HSDP against one process trained on the same global batch.

The model (``tp_models.py``) holds a row-wise and two column-wise layers, a ``SequenceParallel``
LayerNorm behind ``PrepareModuleInput``, a layer written with ``DTensor`` ops, a vanishing layer
and a detached one. Two gloo processes are started once for the module (tensor parallelism in
fp32, with a clip, in bf16, and a placement no rule covers), and four once (FSDP2 x TP and HSDP
on ``(2, 2)`` meshes, fp32 and bf16); each worker leaves its results in files
(``tp_workers.py``). The truth is one process with plain torch hooks and no graddebug, in
float64, itself checked against ``torch.autograd.grad``; for bf16 it is the float64 statistics
of the very gradients each run's plain twin holds, put back together from the ranks' pieces.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import graddebug  # noqa: E402
from test_torch_distributed import launch  # noqa: E402
from tp_models import CLIP, LEAVES, STEPS, global_batch, loss_fn, net, reference_run  # noqa: E402
from tp_workers import four_ranks, two_ranks  # noqa: E402

Key = tuple[int, str, str, str]  # step, layer, tensor, kind
STATS = ("norm", "mean", "std", "absmax")
SHARDINGS = ("tp", "fsdp_tp", "hsdp")


class Spawned:
    """The workers' exit codes and results, and the run directories they wrote."""

    def __init__(self, out: Path, codes: list[int | None]) -> None:
        self.out = out
        self.codes = codes
        self.ranks = [json.loads(path.read_text()) if path.exists() else {}
                      for path in (out / f"rank{rank}.json" for rank in range(len(codes)))]

    def phase(self, name: str) -> list[dict[str, Any]]:
        """Each rank's results of one phase; fails with the worker's traceback if it failed."""
        found = []
        for rank, data in enumerate(self.ranks):
            assert name in data, f"rank {rank} never finished {name!r} (exit codes {self.codes})"
            assert "error" not in data[name], f"rank {rank}, {name}:\n{data[name]['error']}"
            found.append(data[name])
        return found


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Spawned:
    out = tmp_path_factory.mktemp("tp2")
    return Spawned(out, launch(two_ranks, out, world=2, timeout=240))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Spawned:
    out = tmp_path_factory.mktemp("tp4")
    return Spawned(out, launch(four_ranks, out, world=4, timeout=300))


def spawned_for(name: str, two: Spawned | None, four: Spawned | None) -> Spawned:
    spawned = two if name.startswith("tp") else four
    assert spawned is not None
    return spawned


@pytest.fixture(scope="module")
def reference() -> dict[Key, dict[str, Any]]:
    return keyed(reference_run())


def keyed(run: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    """The reference's statistics under the frame's keys."""
    out: dict[Key, dict[str, Any]] = {}
    for (step, layer, tensor), value in run["params"].items():
        out[(step, layer, tensor, "parameter")] = value
    for (step, layer), value in run["outputs"].items():
        out[(step, layer, "output", "activation")] = value
    return out


def twin_truth(rank: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    """A worker's plain twin's whole gradients under the frame's keys."""
    params, outputs = {}, {}
    for step, found in enumerate(rank["truth"]):
        for pname, value in found["params"].items():
            layer, _, tensor = pname.rpartition(".")
            params[(step, layer, tensor)] = value
        outputs.update({(step, name): value for name, value in found["outputs"].items()})
    return keyed({"params": params, "outputs": outputs})


def frame_of(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows)


def key_of(row: Any) -> Key:
    return (int(row.step), str(row.layer), str(row.tensor), str(row.kind))


def check_rows(frame: pd.DataFrame, truth: dict[Key, dict[str, Any]], rel: float,
               where: str) -> None:
    """Every row is there once and equals the truth: norm, mean, std and absmax, numel and the
    logical shape."""
    keys = [key_of(row) for row in frame.itertuples()]
    assert len(keys) == len(set(keys)), f"{where}: a row is there twice"
    missing, extra = sorted(set(truth) - set(keys)), sorted(set(keys) - set(truth))
    assert not missing and not extra, f"{where}: {len(missing)} rows missing " \
        f"({missing[:4]}...), {len(extra)} rows not in one process ({extra[:4]}...)"
    for row in frame.itertuples():
        ref, at = truth[key_of(row)], f"{where}: {key_of(row)}"
        assert row.numel == ref["numel"] and row.shape == ref["shape"], at
        assert row.norm == pytest.approx(ref["norm"], rel=rel), at
        assert not row.nan and not row.inf, at
        rms = ref["norm"] / math.sqrt(ref["numel"])
        assert row.mean == pytest.approx(ref["mean"], rel=rel, abs=10 * rel * rms), at
        assert row.absmax == pytest.approx(ref["absmax"], rel=rel), at
        # std comes from the norm and the mean, and cancels where |mean| is near the rms.
        assert row.std == pytest.approx(ref["std"], rel=10 * rel, abs=100 * rel * rms), at


def issues(rows: list[dict[str, Any]] | pd.DataFrame) -> set[tuple[int, str, str, str, str]]:
    found = pd.DataFrame(rows)
    if found.empty:
        return set()
    return {(int(s), str(la), str(t), str(i), str(sev)) for s, la, t, i, sev in zip(
        found["step"], found["layer"], found["tensor"], found["issue"], found["severity"],
        strict=True)}


# -- the references, checked against each other (one process, fast) ----------------------------


@pytest.fixture(scope="module")
def single() -> graddebug.Watcher:
    """graddebug in one process on the unsharded model and the global batches."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddebug.watch(model, param_stats="full") as dbg:
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = global_batch(step)
            loss_fn(model(x), y).backward()
            dbg.step()
            optimizer.step()
    return dbg


def test_the_reference_is_torch_autograd_grad() -> None:
    model = net(torch.float64)
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name in LEAVES:
        modules[name].register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(name, out))
    x, y = global_batch(0, torch.float64)
    loss = loss_fn(model(x), y)
    reached = {n: o for n, o in outputs.items() if o.requires_grad and n not in ("side.0",)}
    names = [n for n, p in model.named_parameters() if not n.startswith("side.0")]
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, [params[n] for n in names] + list(reached.values()))
    ref = keyed(reference_run(steps=1))
    expected = {(0, *n.rsplit(".", 1), "parameter"): g for n, g in zip(names, grads, strict=False)}
    expected.update({(0, n, "output", "activation"): g
                     for n, g in zip(reached, grads[len(names):], strict=True)})
    assert set(expected) == set(ref)
    for key, grad in expected.items():
        assert ref[key]["norm"] == pytest.approx(float(grad.norm()), rel=1e-12), key
        assert ref[key]["shape"] == str(tuple(grad.shape)), key


def test_one_process_graddebug_matches_the_reference_and_finds_both_faults(
        single: graddebug.Watcher, reference: dict[Key, dict[str, Any]]) -> None:
    check_rows(single.frame(), reference, 1e-5, "one process")
    found = issues(single.findings())
    assert {i for _, _, _, i, _ in found} == {"vanishing", "cut_graph"}, found
    assert (0, "side.1", "output", "cut_graph", "error") in found


# -- every sharding: rows, findings, run files, weights, the collective --------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDINGS)
def test_the_plain_twins_whole_gradients_are_the_single_process_ones(
        name: str, two: Spawned, four: Spawned, reference: dict[Key, dict[str, Any]]) -> None:
    # The harness, without graddebug: the pieces put back together give the truth.
    for rank in spawned_for(name, two, four).phase(name):
        truth = twin_truth(rank)
        assert set(truth) == set(reference)
        for key, value in truth.items():
            assert value["shape"] == reference[key]["shape"], key
            assert value["norm"] == pytest.approx(reference[key]["norm"], rel=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDINGS)
def test_every_ranks_rows_are_the_single_process_rows(
        name: str, two: Spawned, four: Spawned, reference: dict[Key, dict[str, Any]],
        single: graddebug.Watcher) -> None:
    ranks = spawned_for(name, two, four).phase(name)
    for number, rank in enumerate(ranks):
        check_rows(frame_of(rank["rows"]), reference, 1e-5, f"{name}, rank {number}")
    first = frame_of(ranks[0]["rows"])
    for rank in ranks[1:]:  # one collective gave every rank the same rows
        pd.testing.assert_frame_equal(frame_of(rank["rows"]).drop(columns="rank"),
                                      first.drop(columns="rank"), rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDINGS)
def test_weight_norms_are_those_of_the_whole_parameters(name: str, two: Spawned, four: Spawned,
                                                        single: graddebug.Watcher) -> None:
    ours = single.frame().set_index(["step", "layer", "tensor", "kind"])
    params = ours[ours.index.get_level_values("kind") == "parameter"]
    assert params["weight_norm"].notna().all()  # one process knows every one
    for rank in spawned_for(name, two, four).phase(name):
        frame = frame_of(rank["rows"])
        for row in frame[frame["kind"] == "parameter"].itertuples():
            expected = ours.loc[key_of(row), "weight_norm"]
            assert row.weight_norm == pytest.approx(expected, rel=1e-5), key_of(row)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDINGS)
def test_every_rank_finds_what_one_process_finds(name: str, two: Spawned, four: Spawned,
                                                 single: graddebug.Watcher) -> None:
    expected = issues(single.findings())
    for rank in spawned_for(name, two, four).phase(name):
        assert issues(rank["findings"]) == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDINGS)
def test_the_run_files_hold_each_row_once(name: str, two: Spawned, four: Spawned,
                                          reference: dict[Key, dict[str, Any]],
                                          single: graddebug.Watcher) -> None:
    spawned = spawned_for(name, two, four)
    spawned.phase(name)
    report = graddebug.load(spawned.out / name)
    check_rows(report.frame(), reference, 1e-5, f"{name}, run files")
    assert issues(report.findings()) == issues(single.findings())


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDINGS)
def test_watching_leaves_the_weights_bitwise_identical(name: str, two: Spawned,
                                                       four: Spawned) -> None:
    for rank in spawned_for(name, two, four).phase(name):
        assert rank["moved"], "the weights did not change: the comparison would prove nothing"
        assert rank["bitwise"]
        assert not rank["warnings"], rank["warnings"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDINGS)
def test_one_collective_per_recorded_step_whatever_the_mesh(name: str, two: Spawned,
                                                            four: Spawned) -> None:
    for rank in spawned_for(name, two, four).phase(name):
        calls = rank["collectives"]
        assert len(calls) == STEPS and calls[0], calls  # the first step may exchange the layout
        assert [len(made) for made in calls[1:]] == [1] * (STEPS - 1), calls


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDINGS)
def test_bf16_rows_equal_the_float64_truth(name: str, two: Spawned, four: Spawned,
                                           reference: dict[Key, dict[str, Any]]) -> None:
    for number, rank in enumerate(spawned_for(name, two, four).phase(f"{name}_bf16")):
        truth = twin_truth(rank)
        for key, value in truth.items():  # the harness: bf16 gradients, near fp32's
            assert value["norm"] == pytest.approx(reference[key]["norm"], rel=0.1), key
        check_rows(frame_of(rank["rows"]), truth, 1e-3, f"{name} bf16, rank {number}")
        assert rank["bitwise"] and rank["moved"]


# -- an intervention on a split output acts on the whole tensor --------------------------------


@pytest.mark.slow
def test_clip_norm_on_split_outputs_uses_the_global_norm(two: Spawned) -> None:
    clipped = reference_run(clip=CLIP)
    truth = keyed(clipped)
    plain = keyed(reference_run())
    assert all(truth[(s, n, "output", "activation")]["norm"] > c
               for s in range(STEPS) for n, c in CLIP.items()), "the clip would not act"
    assert truth[(1, "first", "weight", "parameter")]["norm"] != pytest.approx(
        plain[(1, "first", "weight", "parameter")]["norm"], rel=1e-3)
    for number, rank in enumerate(two.phase("clip")):
        frame = frame_of(rank["rows"])
        for row in frame.itertuples():
            ref, at = truth[key_of(row)], f"rank {number}: {key_of(row)}"
            if row.layer in CLIP and row.kind == "activation":
                assert row.pre_norm == pytest.approx(ref["norm"], rel=1e-5), at
                assert row.norm == pytest.approx(CLIP[row.layer], rel=1e-5), at
            else:
                assert row.norm == pytest.approx(ref["norm"], rel=1e-5), at
        assert {key_of(r) for r in frame.itertuples()} == set(truth)
        for pname, value in rank["weights"].items():
            np.testing.assert_allclose(np.asarray(value), clipped["weights"][pname],
                                       rtol=1e-5, atol=1e-7, err_msg=pname)


# -- what no rule covers is refused, once -------------------------------------------------------


@pytest.mark.slow
def test_a_placement_no_rule_covers_is_refused_naming_the_tensor(two: Spawned) -> None:
    for rank in two.phase("refuse"):
        names_w = re.compile(r"\bW\b")
        internal = [f for f in rank["findings"] if f["issue"] == "internal_error"]
        assert not rank["internal"] and not internal, (rank["raised"], internal)
        if rank["raised"]:  # a typed error at watch or at the first step
            assert names_w.search(rank["raised"]), rank["raised"]
            continue
        # else one warning naming the tensor, and no number for it
        assert len(rank["warnings"]) == 1, rank["warnings"]
        assert names_w.search(rank["warnings"][0]), rank["warnings"]
        rows = [r for r in rank["rows"] if r["tensor"] == "W" or r["layer"] == "W"]
        assert all(r["norm"] is None or not math.isfinite(r["norm"]) for r in rows), rows
