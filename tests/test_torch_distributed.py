"""DDP and FSDP2 against one process trained on the same global batch.

Every rank records the rows of one process on the global batch. The multi-process tests start
two gloo processes on the CPU once for the whole module: each worker runs every scenario in
turn (DDP, a NaN on rank 1, FSDP2, HSDP, and last a rank killed mid-run) and leaves its
results in files. The reference is computed here, in one process, with plain torch hooks and
no graddebug. The fast tests use a one-process gloo group."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from graddebug.adapter import Distribution  # noqa: E402
from graddebug.errors import GradDebugInternalError  # noqa: E402
from graddebug.records import ALL_RANKS  # noqa: E402

dist = torch.distributed
if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

IN, HIDDEN = 6, 7  # 7 rows do not split evenly over 2 ranks; the head's 1 row leaves one empty
WORLD = 2
BATCH = 8  # the global batch; each rank trains on BATCH // WORLD rows of it
STEPS = 3
LR = 0.1
KILLED = 17  # exit status of the rank killed mid-run
LEAVES = ("body.0", "body.1", "body.2", "body.3", "head")


class Net(nn.Module):
    """Two hidden Linear+Tanh blocks and a one-unit head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(),
                                  nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def net() -> Net:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return Net()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, 1, generator=gen)


def local_batch(step: int, rank: int, world: int = WORLD) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch."""
    x, y = global_batch(step)
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A mean over the (local) batch, as usual."""
    return nn.functional.mse_loss(out, target)


# -- the one-process reference, with no graddebug --------------------------------------------


def reference_run(steps: int = STEPS) -> dict[str, Any]:
    """Train :class:`Net` on the global batches in one process; per step, every parameter
    gradient's statistics and the norm of the gradient at each leaf's output."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    modules = dict(model.named_modules())
    params: dict[tuple[int, str, str], dict[str, float]] = {}
    outputs: dict[tuple[int, str], float] = {}
    for step in range(steps):
        handles = []
        for name in LEAVES:
            def hook(module: nn.Module, args: Any, out: torch.Tensor, name: str = name,
                     step: int = step) -> None:
                out.register_hook(lambda grad: outputs.__setitem__(
                    (step, name), float(grad.double().norm())))
            handles.append(modules[name].register_forward_hook(hook))
        optimizer.zero_grad()
        x, y = global_batch(step)
        loss_fn(model(x), y).backward()
        for handle in handles:
            handle.remove()
        for pname, p in model.named_parameters():
            layer, _, tensor = pname.rpartition(".")
            g = p.grad.double()
            params[(step, layer, tensor)] = {
                "norm": float(g.norm()), "mean": float(g.mean()),
                "std": float(g.std(unbiased=False)), "absmax": float(g.abs().max()),
                "numel": g.numel(), "shape": str(tuple(g.shape))}
        optimizer.step()
    return {"params": params, "outputs": outputs}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run()


def param_rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["kind"] == "parameter"]


def check_params(frame: pd.DataFrame, reference: dict[str, Any], full: bool = False) -> None:
    """Every parameter row equals the reference's whole gradient, and every one is there."""
    rows = param_rows(frame)
    expected = set(reference["params"])
    assert {(int(s), str(la), str(t)) for s, la, t in
            zip(rows["step"], rows["layer"], rows["tensor"], strict=True)} == expected
    for row in rows.itertuples():
        ref = reference["params"][(row.step, row.layer, row.tensor)]
        where = f"step {row.step} {row.layer}.{row.tensor}"
        assert row.numel == ref["numel"] and row.shape == ref["shape"], where
        assert row.norm == pytest.approx(ref["norm"], rel=1e-5), where
        assert not row.nan and not row.inf, where
        if full:
            scale = ref["norm"] / math.sqrt(ref["numel"])  # the entries' root mean square
            assert row.mean == pytest.approx(ref["mean"], rel=1e-5, abs=1e-6 * scale), where
            assert row.absmax == pytest.approx(ref["absmax"], rel=1e-5), where
            # std comes from the norm and the mean, and cancels where |mean| is near the rms.
            assert row.std == pytest.approx(ref["std"], rel=1e-4, abs=1e-3 * scale), where


# -- launching two processes ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _entry(fn: Callable[[int, int, Path], None], rank: int, world: int, port: int,
           out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes share two cores
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    fn(rank, world, Path(out))


def launch(fn: Callable[[int, int, Path], None], out: Path, world: int = WORLD,
           timeout: float = 240.0) -> list[int | None]:
    """Run ``fn(rank, world, out)`` in ``world`` spawned processes joined in one gloo group;
    return their exit codes (None for one that had to be killed after ``timeout``)."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, port, str(out)))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    codes: list[int | None] = []
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
            codes.append(None)
        else:
            codes.append(proc.exitcode)
    return codes


class Results:
    """What one worker found, phase by phase, written after each phase (a rank may die)."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"rank{rank}.json"
        self.data: dict[str, Any] = {}

    def phase(self, name: str, run: Callable[[], dict[str, Any]]) -> None:
        try:
            self.data[name] = run()
        except Exception:
            self.data[name] = {"error": traceback.format_exc()}
            self.save()
            raise  # the other rank would wait in a collective: end the worker
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, default=str))


_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") \
    else "all_gather_into_tensor"  # the one collective of a recorded step
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "broadcast", "reduce_scatter_tensor")


@contextlib.contextmanager
def graddebug_collectives() -> Iterator[list[str]]:
    """The names of the ``torch.distributed`` collectives that graddebug's own code calls
    inside the block (DDP's and FSDP's own ones are not counted)."""
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = str(sys._getframe(1).f_globals.get("__name__", ""))
            if caller.startswith("graddebug"):
                calls.append(name)
            return real(*args, **kwargs)
        return call

    for name, real in saved.items():
        setattr(dist, name, counting(name, real))
    try:
        yield calls
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


def _internal_errors(dbg: graddebug.Watcher) -> list[str]:
    found = dbg.findings()
    return list(found.loc[found["issue"] == "internal_error", "message"])


def _frame_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return json.loads(frame.to_json(orient="records", double_precision=15))


# -- the worker's scenarios --------------------------------------------------------------------


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int,
           dbg: graddebug.Watcher | None) -> None:
    optimizer.zero_grad()
    x, y = local_batch(step, rank)
    loss_fn(model(x), y).backward()
    if dbg is not None:
        dbg.step()
    optimizer.step()


def _ddp(rank: int, out: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    watched, plain = DDP(net()), DDP(net())
    start = [p.detach().clone() for p in plain.parameters()]
    opt_w = torch.optim.SGD(watched.parameters(), lr=LR)
    opt_p = torch.optim.SGD(plain.parameters(), lr=LR)
    kept: dict[str, list[float]] = {}
    with graddebug_collectives() as calls, \
            graddebug.watch(watched, log_dir=out / "ddp", keep=["head"]) as dbg:
        for step in range(STEPS):
            opt_w.zero_grad()
            x, y = local_batch(step, rank)
            loss_fn(watched(x), y).backward()
            result = dbg.step()
            assert result is not None
            kept = {k: v.ravel().tolist() for k, v in result.kept.items()}
            opt_w.step()
    head_grad = watched.module.head.weight.grad.ravel().tolist()
    for step in range(STEPS):
        _train(plain, opt_p, step, rank, None)
    pairs = list(zip(watched.parameters(), plain.parameters(), strict=True))
    moved = not all(torch.equal(p, s) for p, s in zip(plain.parameters(), start, strict=True))
    with graddebug.watch(watched, layers=["body.0", "head"],
                         intervene={"head": {"scale": 1.0}}) as named:
        x, y = local_batch(0, rank)
        loss_fn(watched(x), y).backward()
        named.step()
    return {
        "bitwise": all(torch.equal(a, b) for a, b in pairs), "moved": moved,
        "collectives": calls,
        "distribution": [dbg.distribution.rank, dbg.distribution.world_size,
                         dbg.distribution.backend],
        "internal": _internal_errors(dbg) + _internal_errors(named),
        "kept": kept, "head_grad": head_grad, "rows": _frame_rows(dbg.frame()),
        "selected": sorted(set(named.frame()["layer"])),
    }


def _nan(rank: int, out: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net())
    with graddebug.watch(model, log_dir=out / "nan") as dbg:
        for step in range(2):
            x, y = local_batch(step, rank)
            if step == 1 and rank == 1:
                x = x.clone()
                x[0, 0] = math.nan
            model.zero_grad()
            loss_fn(model(x), y).backward()
            dbg.step()
    return {"internal": _internal_errors(dbg)}


def _fully_shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.body[0], mesh=mesh)
    fully_shard(model.body[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp(rank: int, world: int, out: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _fully_shard(net(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with graddebug_collectives() as full_calls, \
            graddebug.watch(model, param_stats="full", log_dir=out / "fsdp") as dbg:
        for step in range(STEPS):
            _train(model, optimizer, step, rank, dbg)
    slices = {n: list(p.to_local().shape) for n, p in model.named_parameters()}

    norm_model = _fully_shard(net(), mesh)
    optimizer = torch.optim.SGD(norm_model.parameters(), lr=LR)
    with graddebug_collectives() as norm_calls, \
            graddebug.watch(norm_model, outputs=False, every=2) as norm_dbg:
        for step in range(STEPS):
            _train(norm_model, optimizer, step, rank, norm_dbg)
    return {"internal": _internal_errors(dbg) + _internal_errors(norm_dbg), "slices": slices,
            "collectives": {"full": full_calls, "norm": norm_calls},
            "norm_rows": _frame_rows(param_rows(norm_dbg.frame()))}


def _hsdp(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Replicated slices (HSDP over a (2, 1) mesh) and a DTensor on a mesh that spans part of
    the world: each slice is counted once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = net()
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with graddebug.watch(model) as dbg:
        for step in range(STEPS):
            _train(model, optimizer, step, rank, dbg)
    placements = sorted({str(p.placements) for p in model.parameters()})

    sub = mesh["shard"]  # one rank each: the world holds two copies
    torch.manual_seed(3)
    value, grad = torch.randn(5, 3), torch.randn(5, 3)
    weight = nn.Parameter(distribute_tensor(value, sub, [Shard(0)]))
    with graddebug.watch(params={"W": weight}, param_stats="full") as sub_dbg:
        weight.grad = distribute_tensor(grad, sub, [Shard(0)])
        sub_dbg.step()
    row = param_rows(sub_dbg.frame()).iloc[0]
    return {"internal": _internal_errors(dbg) + _internal_errors(sub_dbg),
            "placements": placements, "rows": _frame_rows(param_rows(dbg.frame())),
            "sub": {"norm": float(row["norm"]), "mean": float(row["mean"]),
                    "absmax": float(row["absmax"]), "ref_norm": float(grad.norm()),
                    "ref_mean": float(grad.mean()), "ref_absmax": float(grad.abs().max())}}


def _killed(rank: int, results: Results, out: Path) -> None:
    """Rank 1 dies after two flushed steps, inside the with block; rank 0 stops there too
    (DDP has no peer left) and leaves the block normally."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with graddebug.watch(model, log_dir=out / "killed", flush_every=1) as dbg:
        for step in range(STEPS):
            if step == 2:
                if rank == 1:
                    results.data["killed"] = {"steps": step}
                    results.save()
                    os._exit(KILLED)
                break
            _train(model, optimizer, step, rank, dbg)
    results.data["killed"] = {"steps": 2}
    results.save()


def _scenarios(rank: int, world: int, out: Path) -> None:
    results = Results(out, rank)
    results.phase("ddp", lambda: _ddp(rank, out))
    results.phase("nan", lambda: _nan(rank, out))
    results.phase("fsdp", lambda: _fsdp(rank, world, out))
    results.phase("hsdp", lambda: _hsdp(rank, world, out))
    _killed(rank, results, out)


class Spawned:
    """The two workers' exit codes and results, and the run directories they wrote."""

    def __init__(self, out: Path, codes: list[int | None]) -> None:
        self.out = out
        self.codes = codes
        self.ranks = []
        for rank in range(WORLD):
            path = out / f"rank{rank}.json"
            self.ranks.append(json.loads(path.read_text()) if path.exists() else {})

    def phase(self, name: str) -> list[dict[str, Any]]:
        """Each rank's results of one phase; fails with the worker's traceback if it failed."""
        found = []
        for rank, data in enumerate(self.ranks):
            assert name in data, f"rank {rank} never finished {name!r} (exit codes {self.codes})"
            assert "error" not in data[name], f"rank {rank}, {name}:\n{data[name]['error']}"
            found.append(data[name])
        return found


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Spawned:
    out = tmp_path_factory.mktemp("ranks")
    return Spawned(out, launch(_scenarios, out))


# -- DDP -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_rows_match_one_process_on_the_global_batch(spawned: Spawned,
                                                         reference: dict[str, Any]) -> None:
    ranks = spawned.phase("ddp")
    report = graddebug.load(spawned.out / "ddp")
    frame = report.frame()
    # Every rank holds the same global rows; the run files hold them once.
    assert set(frame["rank"]) == {ALL_RANKS}
    assert not frame.duplicated(["step", "layer", "tensor", "kind"]).any()
    assert report.metadata["world_size"] == WORLD and report.metadata["backend"] == "gloo"
    assert report.metadata["run"]["status"] == "complete"
    assert [r["distribution"] for r in ranks] == [[0, WORLD, "gloo"], [1, WORLD, "gloo"]]
    assert all(not r["internal"] for r in ranks)
    check_params(frame, reference)
    for rank in ranks:  # and each rank's own frame, live, is the same global truth
        check_params(pd.DataFrame(rank["rows"]), reference)
    # The names are those of one process, not "module.body.0".
    model = net()
    with graddebug.watch(model) as single:
        x, y = global_batch(0)
        loss_fn(model(x), y).backward()
        single.step()
    names = {(la, t, k) for la, t, k in zip(frame["layer"], frame["tensor"], frame["kind"],
                                           strict=True)}
    assert names == {(la, t, k) for la, t, k in zip(
        single.frame()["layer"], single.frame()["tensor"], single.frame()["kind"], strict=True)}
    assert report.findings().empty


@pytest.mark.slow
def test_ddp_activation_rows_are_those_of_one_process_on_the_global_batch(
        spawned: Spawned, reference: dict[str, Any]) -> None:
    ranks = spawned.phase("ddp")
    report = graddebug.load(spawned.out / "ddp")
    for frame in [report.frame(), *(pd.DataFrame(r["rows"]) for r in ranks)]:
        act = frame[frame["kind"] == "activation"]
        assert len(act) == STEPS * len(LEAVES)
        for row in act.itertuples():
            # Each rank's loss is a mean over its half of the batch, which DDP averages: the
            # global loss's gradient at each half is the local one over the world size.
            expected = reference["outputs"][(row.step, row.layer)]
            assert row.norm == pytest.approx(expected, rel=1e-5), (row.step, row.layer)
            assert row.shape == str((BATCH, 1 if row.layer == "head" else HIDDEN))
    last = report.summary().set_index(["layer", "kind"])
    for name in LEAVES:
        expected = reference["outputs"][(STEPS - 1, name)]
        assert last.loc[(name, "activation"), "norm_last"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_ddp_watch_leaves_weights_bitwise_identical(spawned: Spawned) -> None:
    for rank in spawned.phase("ddp"):
        assert rank["moved"], "the weights did not change: the comparison would prove nothing"
        assert rank["bitwise"]
        # One collective per recorded step, whatever the number of rows (the first step
        # exchanges the rows' names once more, with all_gather_object).
        assert rank["collectives"] == [_SINGLE] * STEPS


@pytest.mark.slow
def test_ddp_layers_keep_and_intervene_take_the_unwrapped_names(spawned: Spawned) -> None:
    for rank in spawned.phase("ddp"):
        assert rank["selected"] == ["body.0", "head"]
        assert set(rank["kept"]) == {"head", "head.weight", "head.bias"}
        assert rank["kept"]["head.weight"] == rank["head_grad"]


# -- a NaN on one rank --------------------------------------------------------------------------


@pytest.mark.slow
def test_nan_on_rank_1_is_named_with_its_rank(spawned: Spawned,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert all(not r["internal"] for r in spawned.phase("nan"))
    report = graddebug.load(spawned.out / "nan")
    found = report.findings()
    nonfinite = found[found["issue"] == "nonfinite"]
    assert len(nonfinite) >= 1
    first = nonfinite.iloc[0]
    assert first["step"] == 1 and first["layer"] == "body.0" and first["rank"] == 1
    assert "rank 1" in first["message"]

    from graddebug.cli import main

    code = main(["report", str(spawned.out / "nan"), "--format", "json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 1  # a nonfinite finding is an error
    assert payload["run"]["ranks"] == {"0": "complete", "1": "complete"}
    assert payload["metadata"]["world_size"] == WORLD


# -- FSDP2 --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp2_rows_are_whole_gradients_with_uneven_slices(spawned: Spawned,
                                                           reference: dict[str, Any]) -> None:
    ranks = spawned.phase("fsdp")
    assert all(not r["internal"] for r in ranks)
    # The slices really are uneven, and one rank holds nothing of the head.
    assert ranks[0]["slices"]["body.0.weight"] == [4, IN]
    assert ranks[1]["slices"]["body.0.weight"] == [3, IN]
    assert ranks[1]["slices"]["head.bias"] == [0]
    report = graddebug.load(spawned.out / "fsdp")
    frame = report.frame()
    assert set(frame["rank"]) == {ALL_RANKS}
    check_params(frame, reference, full=True)
    assert report.findings().empty
    recorded = range(0, STEPS, 2)
    for rank in ranks:  # param_stats="norm" (one all_reduce), with outputs=False, every=2
        rows = pd.DataFrame(rank["norm_rows"])
        assert sorted(set(rows["step"])) == list(recorded)
        check_params(rows, {"params": {k: v for k, v in reference["params"].items()
                                       if k[0] in recorded}})
        # One collective per recorded step, whatever the number of parameters.
        assert rank["collectives"] == {"full": [_SINGLE] * STEPS,
                                       "norm": [_SINGLE] * len(recorded)}


@pytest.mark.slow
def test_hsdp_and_partial_meshes_count_each_slice_once(spawned: Spawned,
                                                       reference: dict[str, Any]) -> None:
    ranks = spawned.phase("hsdp")
    for rank in ranks:
        assert not rank["internal"]
        assert rank["placements"] == ["(Replicate(), Shard(dim=0))"]
        check_params(pd.DataFrame(rank["rows"]), reference)
        sub = rank["sub"]
        assert sub["norm"] == pytest.approx(sub["ref_norm"], rel=1e-6)
        assert sub["mean"] == pytest.approx(sub["ref_mean"], rel=1e-5, abs=1e-7)
        assert sub["absmax"] == pytest.approx(sub["ref_absmax"], rel=1e-6)


# -- a rank killed mid-run ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_rank_leaves_a_loadable_run(spawned: Spawned) -> None:
    assert spawned.codes == [0, KILLED]
    report = graddebug.load(spawned.out / "killed")
    run = report.metadata["run"]
    assert run["status"] == "incomplete"
    assert run["ranks"] == {"0": "complete", "1": "running"}
    frame = report.frame()  # rank 0 wrote the global rows of the steps every rank closed
    assert sorted(set(frame.loc[frame["rank"] == ALL_RANKS, "step"])) == [0, 1]
    assert report.findings().empty


# -- one process: the adapter's distributed paths, fast ------------------------------------------


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_distribution_is_one_process_without_a_group() -> None:
    assert not dist.is_initialized()
    with graddebug.watch(net()) as dbg:
        assert dbg.distribution == Distribution()


def test_distribution_reads_the_process_group(group: None) -> None:
    with graddebug.watch(net()) as dbg:
        assert dbg.distribution == Distribution(0, 1, "gloo")


def _plain_stats(grad: torch.Tensor) -> dict[str, float]:
    g = grad.double()
    return {"norm": float(g.norm()), "mean": float(g.mean()),
            "std": float(g.std(unbiased=False)), "absmax": float(g.abs().max())}


def test_fully_shard_rows_and_kept_gradients_are_the_whole_ones(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    plain = net()
    model = _fully_shard(net(), init_device_mesh("cpu", (1,)))
    x, y = global_batch(0)
    loss_fn(plain(x), y).backward()
    with graddebug.watch(model, param_stats="full", keep=["head"], strict=True) as dbg:
        loss_fn(model(x), y).backward()
        result = dbg.step()
    assert result is not None
    rows = param_rows(dbg.frame()).set_index(["layer", "tensor"])
    assert len(rows) == 6
    for pname, p in plain.named_parameters():
        row = rows.loc[tuple(pname.rsplit(".", 1))]
        assert row["shape"] == str(tuple(p.shape)) and row["numel"] == p.numel()
        stats = _plain_stats(p.grad)
        scale = stats["norm"] / math.sqrt(p.numel())
        for stat, value in stats.items():
            # std follows from the norm and the mean, and cancels where |mean| is near the rms
            tolerance = 1e-3 * scale if stat == "std" else 1e-6 * scale
            assert row[stat] == pytest.approx(value, rel=1e-5, abs=tolerance), (pname, stat)
    assert np.array_equal(result.kept["head.weight"], plain.head.weight.grad.numpy())
    assert dbg.findings().empty


def _dtensor_param(value: torch.Tensor) -> tuple[nn.Parameter, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return nn.Parameter(distribute_tensor(value, mesh, [Shard(0)])), mesh, distribute_tensor


def test_sharded_gradients_set_without_hooks_are_recorded_every_step(group: None) -> None:
    from torch.distributed.tensor import Shard

    weight, mesh, distribute = _dtensor_param(torch.zeros(4, 3))
    grads = [torch.full((4, 3), 2.0), torch.full((4, 3), -0.5)]
    with graddebug.watch(params={"W": weight}) as dbg:
        for grad in grads:
            weight.grad = distribute(grad, mesh, [Shard(0)])  # no accumulation hook runs
            assert dbg.adapter.has_pending()  # type: ignore[union-attr]
            dbg.step()
        assert not dbg.adapter.has_pending()  # type: ignore[union-attr]
    norms = list(param_rows(dbg.frame())["norm"])
    assert norms == pytest.approx([float(g.norm()) for g in grads])


def test_sharded_nonfinite_gradients_are_flagged(group: None) -> None:
    from torch.distributed.tensor import Shard

    weight, mesh, distribute = _dtensor_param(torch.zeros(4, 3))
    inf, nan = torch.ones(4, 3), torch.ones(4, 3)
    inf[1, 2] = math.inf
    nan[0, 0], nan[3, 1] = math.nan, -math.inf
    with graddebug.watch(params={"W": weight}, param_stats="full") as dbg:
        for grad in (inf, nan):
            weight.grad = distribute(grad, mesh, [Shard(0)])
            dbg.step()
    rows = param_rows(dbg.frame())
    assert list(rows["nan"]) == [False, True]
    assert list(rows["inf"]) == [True, False]  # NaN wins where both are there
    assert rows["norm"].iloc[0] == math.inf and math.isnan(rows["absmax"].iloc[1])
    assert set(dbg.findings()["issue"]) == {"nonfinite"}


def test_sharded_failures_fail_open_and_strict_raises(group: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import graddebug_torch.closing as closing

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    model = _fully_shard(net(), _dtensor_param(torch.zeros(1))[1])
    x, y = global_batch(0)
    monkeypatch.setattr(closing, "local_slice", broken)
    warns = pytest.warns(graddebug.GradDebugWarning, match="boom")
    with warns, graddebug.watch(model) as dbg:
        loss_fn(model(x), y).backward()
        assert dbg.step() is not None
    assert len(param_rows(dbg.frame())) == 0  # no parameter row rather than a wrong one
    assert set(dbg.findings()["issue"]) == {"internal_error"}

    raises = pytest.raises(GradDebugInternalError, match="boom")
    with raises, graddebug.watch(model, strict=True) as dbg:
        model.zero_grad()
        loss_fn(model(x), y).backward()
        dbg.step()


class Gained(Net):
    """A parameter of the root module itself, named after the root's class."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


def _names(model: nn.Module, **options: Any) -> set[tuple[str, str, str]]:
    x, y = global_batch(0)
    with graddebug.watch(model, **options) as dbg:
        loss_fn(model(x), y).backward()
        dbg.step()
    frame = dbg.frame()
    assert dbg.findings().empty
    return set(zip(frame["layer"], frame["tensor"], frame["kind"], strict=True))


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_wrapped_models_have_the_names_of_one_process(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    expected = _names(Gained())
    assert ("Gained", "gain", "parameter") in expected
    torch.manual_seed(0)
    model = Gained()
    fully_shard(model.body, mesh=init_device_mesh("cpu", (1,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert type(model).__name__ == "FSDPGained"
    assert _names(model) == expected
    torch.manual_seed(0)
    fsdp1 = FullyShardedDataParallel(Gained(), use_orig_params=True,
                                     device_id=torch.device("cpu"),
                                     auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    assert _names(fsdp1) == expected
    # layers=, keep= and intervene= take the same names.
    named = _names(fsdp1, layers=["body.0", "Gained"], keep=["head"],
                   intervene={"body.2": {"scale": 1.0}})
    assert {la for la, _, _ in named} == {"body.0", "body.2", "head", "Gained"}


def test_slices_held_as_plain_tensors_are_left_out_with_one_warning(group: None) -> None:
    from graddebug.records import sums_record
    from graddebug_torch.params import ParamRow, TorchParam
    from graddebug_torch.sharding import rank_rows

    megatron = nn.Parameter(torch.ones(3))
    megatron.tensor_model_parallel = True  # type: ignore[attr-defined]
    plain = nn.Parameter(torch.ones(2))
    params = [TorchParam("mlp", "weight", megatron, ("mlp",)),
              TorchParam("head", "bias", plain, ("head",))]
    warned: list[tuple[str, str]] = []
    ranks = rank_rows(2, {}, params, lambda key, message: warned.append((key, message)))
    assert ranks is not None
    rows = [ParamRow("mlp", "weight", 0, torch.ones(3), False),
            ParamRow("head", "bias", 1, torch.ones(2), False)]
    records = [sums_record(0, r.layer, r.tensor, "parameter", r.depth, "(3,)", 3, 1.0, 0.0,
                           1.0, math.nan, False, False) for r in rows]
    shares = ranks._shares(records, rows)
    assert shares[0] is None and shares[1] is not None and shares[1].whole
    assert len(warned) == 1 and "'mlp' (weight)" in warned[0][1]
    assert "tensor_model_parallel" in warned[0][1]
