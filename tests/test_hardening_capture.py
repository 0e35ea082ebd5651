"""Hardening of capture in torch: faults, unusual tensors and misuse neither stop training nor
record wrong numbers silently. One test (or a few) per defect, each reproducing it first."""

from __future__ import annotations

import copy
import dataclasses
import errno
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
import graddebug.runs.layout as layout  # noqa: E402
import graddebug.runs.writer as writer  # noqa: E402
from graddebug import (  # noqa: E402
    ConfigError,
    GradDebugWarning,
    GradientCountError,
    WatcherStateError,
)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _backward(model: nn.Module, seed: int = 0) -> None:
    torch.manual_seed(100 + seed)
    model(torch.randn(5, 3)).pow(2).sum().backward()


def _disk_full(path: Path, write: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


# -- 1: a full disk before the first part is written --------------------------------------


def test_full_disk_from_the_start_never_escapes_entering_or_step(tmp_path, monkeypatch):
    model = _mlp()
    monkeypatch.setattr(layout, "atomic_write", _disk_full)  # the JSON file
    monkeypatch.setattr(writer, "atomic_write", _disk_full)  # the Parquet parts
    with (
        pytest.warns(GradDebugWarning, match="No space left") as caught,
        graddebug.watch(model, log_dir=tmp_path / "run", flush_every=1) as dbg,
    ):
        for step in range(3):
            _backward(model, step)
            dbg.step()
            model.zero_grad()
    assert len([w for w in caught if issubclass(w.category, GradDebugWarning)]) == 1
    findings = dbg.findings()
    assert set(findings["issue"]) == {"internal_error"}
    assert findings["layer"].str.contains("log_dir").all()
    # Nothing reached the disk, and nothing was dropped either.
    assert sorted(dbg.frame()["step"].unique()) == [0, 1, 2]


def test_full_disk_at_the_first_flush_only_never_escapes_step(tmp_path, monkeypatch):
    model = _mlp()
    with (
        pytest.warns(GradDebugWarning, match="No space left"),
        graddebug.watch(model, log_dir=tmp_path / "run", flush_every=1) as dbg,
    ):
        monkeypatch.setattr(layout, "atomic_write", _disk_full)
        monkeypatch.setattr(writer, "atomic_write", _disk_full)
        _backward(model)
        dbg.step()
        monkeypatch.undo()
        model.zero_grad()
        _backward(model, 1)
        dbg.step()
    run = graddebug.load(tmp_path / "run")
    # The rows of the failed flush went out with the next one.
    assert sorted(run.frame()["step"].unique()) == [0, 1]
    assert run.metadata["run"]["status"] == "complete"


# -- 5: a run is complete only if every row reached the disk ------------------------------


def test_failed_final_flush_marks_the_run_incomplete_and_keeps_the_rows(tmp_path, monkeypatch):
    model = _mlp()
    real_write = writer.atomic_write

    def stream_disk_full(path: Path, write: Any) -> None:
        if path.parent.name == "records":  # the findings file and the JSON still succeed
            _disk_full(path, write)
        real_write(path, write)

    monkeypatch.setattr(writer, "atomic_write", stream_disk_full)
    with (
        pytest.warns(GradDebugWarning, match="No space left"),
        graddebug.watch(model, log_dir=tmp_path / "run", flush_every=100) as dbg,
    ):
        for step in range(3):
            _backward(model, step)
            dbg.step()
            model.zero_grad()
    monkeypatch.undo()
    run = graddebug.load(tmp_path / "run")
    assert run.metadata["run"]["status"] == "incomplete"
    assert "could not be written" in run.metadata["incomplete_reason"]
    # The rows are still in the Watcher, and save() writes them elsewhere.
    assert sorted(dbg.frame()["step"].unique()) == [0, 1, 2]
    assert len(dbg.frame()) == 3 * 7  # 3 activations + 4 parameters a step
    saved = graddebug.load(dbg.save(tmp_path / "copy"))
    assert saved.metadata["run"]["status"] == "complete"
    assert sorted(saved.frame()["step"].unique()) == [0, 1, 2]


def test_a_run_whose_rows_all_reached_the_disk_is_complete(tmp_path):
    model = _mlp()
    with graddebug.watch(model, log_dir=tmp_path / "run") as dbg:
        _backward(model)
        dbg.step()
    run = graddebug.load(tmp_path / "run")
    assert run.metadata["run"]["status"] == "complete"
    assert "incomplete_reason" not in run.metadata


# -- 2: torch.func transforms inside watch(model) -----------------------------------------


def _functional_loss(model: nn.Module):
    def loss(params: dict[str, Any], x: Any) -> Any:
        return torch.func.functional_call(model, params, (x,)).pow(2).sum()

    return loss


def test_vmap_of_grad_inside_watch_gives_the_same_result_as_without():
    model = _mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 3)
    expected = torch.func.vmap(torch.func.grad(_functional_loss(model)), in_dims=(None, 0))(
        params, x)
    with (
        pytest.warns(GradDebugWarning, match="torch.func") as caught,
        graddebug.watch(model) as dbg,
    ):
        got = torch.func.vmap(torch.func.grad(_functional_loss(model)),
                              in_dims=(None, 0))(params, x)
        dbg.step()
    assert len(caught) == 1
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    assert dbg.findings().empty


def test_grad_transform_inside_watch_gives_no_false_cut_graph_and_backward_still_records():
    model = _mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.warns(GradDebugWarning, match="torch.func"), graddebug.watch(model) as dbg:
        for _ in range(2):
            torch.func.grad(_functional_loss(model))(params, torch.randn(5, 3))
            dbg.step()
        _backward(model)  # an ordinary step after the transformed ones
        reference = model[2].weight.grad.norm().item()
        dbg.step()
    assert dbg.findings().empty
    frame = dbg.frame()
    assert sorted(frame["step"].unique()) == [2]
    row = frame[(frame["layer"] == "2") & (frame["tensor"] == "weight")]
    assert row["norm"].item() == pytest.approx(reference, rel=1e-6)


# -- 3, 3b: keep= with sparse and half-precision gradients ----------------------------------


def test_keep_densifies_a_sparse_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    dense = copy.deepcopy(model)
    dense[0].sparse = False
    ids = torch.tensor([[1, 2, 2], [7, 1, 0]])
    with graddebug.watch(model, keep=["0"]) as dbg:
        model(ids).sum().backward()
        dbg.step()
    dense(ids).sum().backward()
    kept = dbg.tensors(0)
    assert kept["0.weight"].dtype == np.float32
    np.testing.assert_allclose(kept["0.weight"], dense[0].weight.grad.numpy(), rtol=1e-6)
    assert dbg.findings().empty


def test_keep_under_bfloat16_autocast_keeps_float32_arrays():
    model = _mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 3)
    with graddebug.watch(model, keep=["0"]) as dbg, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        out.float().pow(2).sum().backward()
        dbg.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = reference[0](x)
        out = reference[2](reference[1](h))
    (dh,) = torch.autograd.grad(out.float().pow(2).sum(), h)
    assert dh.dtype == torch.bfloat16
    kept = dbg.tensors(0)
    assert dbg.findings().empty  # no internal_error
    assert kept["0"].dtype == np.float32
    np.testing.assert_array_equal(kept["0"], dh.float().numpy())
    assert kept["0.weight"].dtype == np.float32


def test_keep_under_float16_gradients_keeps_float32_arrays():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4)).half()
    x = torch.randn(5, 3).half()
    with graddebug.watch(model, keep=["0"]) as dbg:
        model(x).float().sum().backward()
        dbg.step()
    kept = dbg.tensors(0)
    assert kept["0.weight"].dtype == np.float32
    np.testing.assert_array_equal(kept["0.weight"], model[0].weight.grad.float().numpy())


# -- 7: keep= is bounded ------------------------------------------------------------------


def _kept_run(steps: int, **options: Any) -> tuple[graddebug.Watcher, list[np.ndarray]]:
    model = _mlp()
    truth = []
    with graddebug.watch(model, keep=["0"], **options) as dbg:
        for step in range(steps):
            _backward(model, step)
            truth.append(model[0].weight.grad.clone().numpy())
            dbg.step()
            model.zero_grad()
    return dbg, truth


def test_keep_holds_the_last_ten_steps_by_default():
    dbg, truth = _kept_run(13)
    kept = dbg._buffer.kept
    assert list(kept) == list(range(3, 13))
    np.testing.assert_array_equal(dbg.tensors(12)["0.weight"], truth[12])
    np.testing.assert_array_equal(dbg.tensors(3)["0.weight"], truth[3])
    with pytest.raises(KeyError, match="keep_steps"):
        dbg.tensors(2)


def test_keep_steps_sets_how_many_steps_are_held():
    dbg, truth = _kept_run(5, keep_steps=2)
    assert list(dbg._buffer.kept) == [3, 4]
    np.testing.assert_array_equal(dbg.tensors()["0.weight"], truth[4])
    dbg, _ = _kept_run(12, keep_steps=None)
    assert list(dbg._buffer.kept) == list(range(12))


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_keep_steps_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="keep_steps"):
        graddebug.watch(_mlp(), keep=["0"], keep_steps=bad)


def test_kept_gradients_warn_once_past_the_documented_size(monkeypatch):
    import graddebug.capture.kept as kept_module

    one_step = 4 * 3 * 4 + 4 * 4 + 5 * 4 * 4  # weight, bias and output gradient, float32
    monkeypatch.setattr(kept_module, "KEEP_WARN_BYTES", 2 * one_step)
    with pytest.warns(GradDebugWarning, match="keep_steps") as caught:
        _kept_run(6)
    assert len(caught) == 1


def test_kept_gradients_below_the_size_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradDebugWarning)
        _kept_run(12)


# -- 8: step(grads) checks shape and dtype -------------------------------------------------


def _grads_of(model: nn.Module) -> list[Any]:
    return [p.grad.clone() for p in model.parameters()]


def test_step_grads_in_the_wrong_order_raise_naming_the_first_mismatch():
    model = _mlp()
    with graddebug.watch(model) as dbg:
        _backward(model)
        grads = _grads_of(model)
        with pytest.raises(GradientCountError, match=r"#0 \(for 0.weight\).*shape \(4,\)"):
            dbg.step([grads[1], grads[0], *grads[2:]])
        with pytest.raises(GradientCountError, match=r"#3 \(for 2.bias\).*float64"):
            dbg.step([*grads[:3], grads[3].double()])
        with pytest.raises(GradientCountError, match=r"#2 .*str"):
            dbg.step([grads[0], grads[1], "a", grads[3]])
        result = dbg.step(grads)
    assert result is not None
    weight = dbg.frame().query("layer == '0' and tensor == 'weight'")
    assert weight["norm"].item() == pytest.approx(grads[0].norm().item(), rel=1e-6)


# -- 9: step() twice after one backward ---------------------------------------------------


def test_second_step_after_one_backward_records_nothing_and_warns_once():
    model = _mlp()
    norms = []
    with (
        pytest.warns(GradDebugWarning, match="called again") as caught,
        graddebug.watch(model) as dbg,
    ):
        for step in range(3):
            _backward(model, step)
            norms.append(model[0].weight.grad.norm().item())
            assert dbg.step() is not None
            assert dbg.step() is None
            model.zero_grad()
    assert len(caught) == 1
    frame = dbg.frame()
    assert sorted(frame["step"].unique()) == [0, 1, 2]
    weight = frame.query("layer == '0' and tensor == 'weight'").sort_values("step")
    np.testing.assert_allclose(weight["norm"], norms, rtol=1e-6)


# -- 10: a module shared by two watched models ---------------------------------------------


def test_a_module_watched_by_another_live_watcher_raises_on_entering():
    shared = nn.Linear(3, 3)
    first = nn.Sequential(shared, nn.Linear(3, 1))
    second = nn.Sequential(shared, nn.Linear(3, 1))
    with graddebug.watch(first) as dbg:
        entering = graddebug.watch(second)
        with pytest.raises(WatcherStateError, match="'0' of Sequential is already watched"):
            entering.__enter__()
        assert not second[1]._forward_hooks  # nothing left behind by the failed entry
        second(torch.randn(2, 3)).sum().backward()
        dbg.step()
    # Only the first Watcher recorded, and once it has ended the second can enter.
    assert set(dbg.frame().query("kind == 'activation'")["layer"]) == {"0"}
    with graddebug.watch(second) as other:
        second(torch.randn(2, 3)).sum().backward()
        other.step()
    assert set(other.frame()["layer"]) == {"0", "1"}


def test_a_shared_module_left_out_with_layers_can_be_watched_twice():
    shared = nn.Linear(3, 3)
    first = nn.Sequential(shared, nn.Linear(3, 1))
    second = nn.Sequential(shared, nn.Linear(3, 1))
    with graddebug.watch(first) as a, graddebug.watch(second, layers=["1"]) as b:
        second(torch.randn(2, 3)).sum().backward()
        a.step()
        b.step()
    assert set(b.frame()["layer"]) == {"1"}


# -- 11: dataclass outputs -----------------------------------------------------------------


@dataclasses.dataclass
class _Pair:
    hidden: Any
    scaled: Any


class _PairLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Any) -> _Pair:
        h = self.fc(x)
        return _Pair(h, h * 2)


def test_dataclass_outputs_are_flattened_like_dicts():
    torch.manual_seed(0)
    model = nn.Sequential(_PairLayer())
    x = torch.randn(4, 3)
    with graddebug.watch(model, layers=["0"]) as dbg:
        out = model(x)
        (out.hidden.pow(2).sum() + out.scaled.sum()).backward()
        dbg.step()
    ref = model[0](x)
    dh, ds = torch.autograd.grad(ref.hidden.pow(2).sum() + ref.scaled.sum(),
                                 [ref.hidden, ref.scaled])
    acts = dbg.frame().query("kind == 'activation'").set_index("tensor")["norm"]
    assert sorted(acts.index) == ["output.hidden", "output.scaled"]
    assert acts["output.hidden"] == pytest.approx(dh.norm().item(), rel=1e-6)
    assert acts["output.scaled"] == pytest.approx(ds.norm().item(), rel=1e-6)


# -- 12: taps on tensors without a gradient; masks on the meta device ---------------------


def test_tap_on_a_tensor_without_gradient_is_an_event_and_a_finding():
    w = torch.randn(3, requires_grad=True)
    with graddebug.watch(params={"w": w}) as dbg:
        x = torch.randn(3)
        h = dbg.tap((w * x).detach(), "h")
        (h * w).sum().backward()
        dbg.step()
    events = dbg.events()
    assert events[["layer", "event"]].values.tolist() == [["h", "detached_output"]]
    assert "does not require a gradient" in events["detail"].item()
    findings = dbg.findings()
    assert findings[["layer", "issue"]].values.tolist() == [["h", "cut_graph"]]


def test_tap_alone_on_a_tensor_without_gradient_is_reported():
    with graddebug.watch() as dbg:
        dbg.tap(torch.randn(3), "x")
        dbg.step()
    assert dbg.events()["layer"].tolist() == ["x"]


def test_mask_on_the_meta_device_is_refused_up_front():
    model = _mlp()
    meta_mask = torch.ones(4, dtype=torch.bool, device="meta")
    with (
        pytest.raises(ConfigError, match=r"'0'.*meta"),
        graddebug.watch(model, intervene={"0": {"mask": meta_mask}}),
    ):
        pass
    assert not model[0]._forward_hooks
    with graddebug.watch(model) as dbg, pytest.raises(ConfigError, match=r"'h'.*meta"):
        dbg.tap(torch.randn(2, 4, requires_grad=True), "h", mask=meta_mask)
