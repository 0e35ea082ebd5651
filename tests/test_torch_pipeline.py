"""Pipeline parallelism (``torch.distributed.pipelining``) against one process trained on the
same global batch.

Each rank builds the whole model and deletes the blocks of the other stage, as torchtitan does,
so the names are the model's own. The multi-process tests start two gloo processes on the CPU
once for the whole module; each worker runs every scenario in turn (GPipe, 1F1B closed by the
optimizer, bf16) and leaves its results in files. The reference is computed here, in one
process, with plain torch hooks and no graddebug. The fast tests use a one-process gloo group
and a one-stage pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from graddebug.errors import ConfigError  # noqa: E402

dist = torch.distributed
if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)
pipelining = pytest.importorskip("torch.distributed.pipelining")

from test_torch_distributed import (  # noqa: E402
    Results,
    Spawned,
    graddebug_collectives,
    launch,
)

IN, WIDTH = 6, 8
WORLD = 2
BATCH = 8  # the global batch, split into MICRO micro-batches by the schedule
MICRO = 4
STEPS = 3
LR = 0.1
STAGES = (("0", "1"), ("2", "3"))  # the blocks of each stage
LEAVES = ("blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1", "blocks.1.2", "blocks.2.0",
          "blocks.2.1", "blocks.3.0")


class Cut(nn.Module):
    """Detaches its input: nothing upstream of it gets a gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


class Net(nn.Module):
    """Four blocks: ``blocks.1`` detaches its input (``blocks.0`` gets no gradient) and
    ``blocks.2``'s weights are tiny (the gradient vanishes below it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({
            "0": nn.Sequential(nn.Linear(IN, WIDTH), nn.Tanh()),
            "1": nn.Sequential(Cut(), nn.Linear(WIDTH, WIDTH), nn.Tanh()),
            "2": nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
            "3": nn.Sequential(nn.Linear(WIDTH, 1)),
        })
        with torch.no_grad():
            self.blocks["2"][0].weight.mul_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():  # a pruned stage runs the blocks it kept
            x = block(x)
        return x


def net(dtype: torch.dtype = torch.float32) -> Net:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return Net().to(dtype)


def global_batch(step: int, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``."""
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, 1, generator=gen)
    return x.to(dtype), y.to(dtype)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A mean over the (micro-)batch: the schedule scales the parameters' gradients."""
    return nn.functional.mse_loss(out, target)


def sum_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A sum over the (micro-)batch: a schedule with ``scale_grads=False``."""
    return nn.functional.mse_loss(out, target, reduction="sum")


# -- the one-process reference, with no graddebug --------------------------------------------


def reference_run(steps: int = STEPS, loss: Callable[..., torch.Tensor] = loss_fn
                  ) -> dict[str, Any]:
    """Train :class:`Net` on the global batches in one process; per step, every parameter
    gradient's statistics and those of the gradient at each leaf's output that got one."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    modules = dict(model.named_modules())
    params: dict[tuple[int, str, str], dict[str, float]] = {}
    outputs: dict[tuple[int, str], dict[str, float]] = {}
    for step in range(steps):
        handles = []
        for name in LEAVES:
            def hook(module: nn.Module, args: Any, out: torch.Tensor, name: str = name,
                     step: int = step) -> None:
                if out.requires_grad:
                    out.register_hook(lambda grad: outputs.__setitem__((step, name),
                                                                       _stats(grad)))
            handles.append(modules[name].register_forward_hook(hook))
        optimizer.zero_grad()
        x, y = global_batch(step)
        loss(model(x), y).backward()
        for handle in handles:
            handle.remove()
        for pname, p in model.named_parameters():
            if p.grad is not None:
                layer, _, tensor = pname.rpartition(".")
                params[(step, layer, tensor)] = _stats(p.grad)
        optimizer.step()
    return {"params": params, "outputs": outputs}


def _stats(grad: torch.Tensor) -> dict[str, Any]:
    g = grad.double()
    return {"norm": float(g.norm()), "mean": float(g.mean()), "absmax": float(g.abs().max()),
            "numel": g.numel(), "shape": str(tuple(g.shape))}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run()


def check_rows(frame: pd.DataFrame, reference: dict[str, Any], stages: tuple[int, ...]) -> None:
    """The rows of the blocks of ``stages`` are the reference's, and every one is there."""
    blocks = {b for s in stages for b in STAGES[s]}
    ours = {k: v for k, v in reference["params"].items() if k[1].split(".")[1] in blocks}
    outs = {k: v for k, v in reference["outputs"].items() if k[1].split(".")[1] in blocks}
    params = frame[frame["kind"] == "parameter"]
    acts = frame[frame["kind"] == "activation"]
    assert set(zip(params["step"], params["layer"], params["tensor"], strict=True)) == set(ours)
    assert set(zip(acts["step"], acts["layer"], strict=True)) == set(outs)
    for row in params.itertuples():
        _check(row, ours[(row.step, row.layer, row.tensor)], f"{row.layer}.{row.tensor}")
    for row in acts.itertuples():
        _check(row, outs[(row.step, row.layer)], f"{row.layer} output")


def _check(row: Any, ref: dict[str, Any], what: str, rel: float = 1e-5) -> None:
    where = f"step {row.step} {what}"
    assert row.numel == ref["numel"] and row.shape == ref["shape"], where
    assert row.norm == pytest.approx(ref["norm"], rel=rel), where
    rms = ref["norm"] / math.sqrt(ref["numel"])
    if not math.isnan(row.mean):
        assert row.mean == pytest.approx(ref["mean"], rel=rel, abs=1e-5 * rms), where
    if not math.isnan(row.absmax):
        assert row.absmax == pytest.approx(ref["absmax"], rel=rel), where
    assert not row.nan and not row.inf, where


# -- a pipeline on each rank ------------------------------------------------------------------


def stage_module(model: Net, stage: int) -> Net:
    """``model`` with the blocks of the other stages deleted."""
    for name in list(model.blocks):
        if name not in STAGES[stage]:
            del model.blocks[name]
    return model


def pipeline(rank: int, world: int, schedule: Any = None, dtype: torch.dtype = torch.float32,
             loss: Callable[..., torch.Tensor] = loss_fn, **options: Any) -> tuple[Net, Any]:
    """This rank's stage module, and a schedule of :data:`MICRO` micro-batches running it."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    module = net(dtype) if world == 1 else stage_module(net(dtype), rank)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    return module, (schedule or ScheduleGPipe)(stage, MICRO, loss_fn=loss, **options)


def run_step(schedule: Any, rank: int, world: int, step: int,
             dtype: torch.dtype = torch.float32) -> None:
    """One ``schedule.step`` on the global batch of ``step``."""
    x, y = global_batch(step, dtype)
    if world == 1:
        schedule.step(x, target=y)
    elif rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)


def _frame_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [dict(r._asdict()) for r in frame.itertuples(index=False)]


def _findings(dbg: graddebug.Watcher) -> list[list[Any]]:
    found = dbg.findings()
    return [[int(s), la, t, i] for s, la, t, i in
            zip(found["step"], found["layer"], found["tensor"], found["issue"], strict=True)]


def _gpipe(rank: int, world: int, out: Path) -> dict[str, Any]:
    """GPipe with ``dbg.step()``; then the same pipeline without graddebug."""
    module, schedule = pipeline(rank, world)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    with graddebug_collectives() as calls, graddebug.watch(
            schedule, log_dir=out / "gpipe", param_stats="full") as dbg:
        for step in range(STEPS):
            optimizer.zero_grad()
            run_step(schedule, rank, world, step)
            dbg.step()
            optimizer.step()
    plain, plain_schedule = pipeline(rank, world)
    start = [p.detach().clone() for p in plain.parameters()]
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for step in range(STEPS):
        plain_opt.zero_grad()
        run_step(plain_schedule, rank, world, step)
        plain_opt.step()
    pairs = list(zip(module.parameters(), plain.parameters(), strict=True))
    return {"rows": _frame_rows(dbg.frame()), "findings": _findings(dbg),
            "bitwise": all(torch.equal(a, b) for a, b in pairs),
            "moved": not all(torch.equal(p, s)
                             for p, s in zip(plain.parameters(), start, strict=True)),
            "collectives": calls}


def _one_f_one_b(rank: int, world: int) -> dict[str, Any]:
    """1F1B, each step closed by the optimizer (no ``dbg.step()``)."""
    from torch.distributed.pipelining import Schedule1F1B

    module, schedule = pipeline(rank, world, Schedule1F1B)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    with graddebug.watch(schedule, optimizer=optimizer) as dbg:
        for step in range(STEPS):
            optimizer.zero_grad()
            run_step(schedule, rank, world, step)
            optimizer.step()
    return {"rows": _frame_rows(dbg.frame()), "findings": _findings(dbg)}


def _bf16(rank: int, world: int) -> dict[str, Any]:
    """A bf16 pipeline; the truth is the float64 statistics of the very gradients it made,
    read by plain hooks (the outputs' ones pooled over the micro-batches, divided by their
    number as the schedule divides the parameters')."""
    module, schedule = pipeline(rank, world, dtype=torch.bfloat16)
    run_step(schedule, rank, world, 0, torch.bfloat16)  # torch's metadata inference, unseen
    module.zero_grad()
    squares: dict[str, float] = {}

    def hook(name: str) -> Callable[..., None]:
        def forward(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda g: squares.__setitem__(
                    name, squares.get(name, 0.0) + float(g.double().pow(2).sum())))
        return forward

    handles = [m.register_forward_hook(hook(n)) for n, m in module.named_modules()
               if n in LEAVES]
    truth: dict[str, float] = {}
    with graddebug.watch(schedule) as dbg:
        run_step(schedule, rank, world, 1, torch.bfloat16)
        dbg.step()
    for handle in handles:
        handle.remove()
    for name, sq in squares.items():
        truth[f"{name}/output"] = math.sqrt(sq) / MICRO
    for pname, p in module.named_parameters():
        if p.grad is not None:
            layer, _, tensor = pname.rpartition(".")
            truth[f"{layer}/{tensor}"] = float(p.grad.double().norm())
    return {"rows": _frame_rows(dbg.frame()), "truth": truth}


def _scenarios(rank: int, world: int, out: Path) -> None:
    results = Results(out, rank)
    results.phase("gpipe", lambda: _gpipe(rank, world, out))
    results.phase("1f1b", lambda: _one_f_one_b(rank, world))
    results.phase("bf16", lambda: _bf16(rank, world))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Spawned:
    out = tmp_path_factory.mktemp("stages")
    return Spawned(out, launch(_scenarios, out, world=WORLD, timeout=150.0))


@pytest.fixture(scope="module")
def single() -> graddebug.Watcher:
    """graddebug in one process trained on the global batches."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with graddebug.watch(model, param_stats="full") as dbg:
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = global_batch(step)
            loss_fn(model(x), y).backward()
            dbg.step()
            optimizer.step()
    return dbg


@pytest.fixture(scope="module")
def single_findings(single: graddebug.Watcher) -> set[tuple[int, str, str, str]]:
    """What graddebug finds in one process trained on the global batches."""
    found = single.findings()
    return set(zip(found["step"], found["layer"], found["tensor"], found["issue"], strict=True))


def _as_set(findings: list[list[Any]]) -> set[tuple[int, str, str, str]]:
    return {(int(s), str(la), str(t), str(i)) for s, la, t, i in findings}


@pytest.mark.slow
def test_gpipe_rows_on_every_rank_are_those_of_one_process(
        spawned: Spawned, reference: dict[str, Any]) -> None:
    for rank in spawned.phase("gpipe"):
        check_rows(pd.DataFrame(rank["rows"]), reference, stages=(0, 1))


@pytest.mark.slow
def test_gpipe_findings_are_those_of_one_process(
        spawned: Spawned, single_findings: set[tuple[int, str, str, str]]) -> None:
    issues = {issue for _, _, _, issue in single_findings}
    assert {"cut_graph", "vanishing"} <= issues  # the comparison proves something
    ranks = spawned.phase("gpipe")
    # The vanishing gradient spans both stages: every rank sees it in the combined rows.
    rows_found = {f for f in single_findings if f[3] == "vanishing"}
    for rank in ranks:
        assert rows_found <= _as_set(rank["findings"])
    assert set().union(*(_as_set(rank["findings"]) for rank in ranks)) == single_findings
    report = graddebug.load(spawned.out / "gpipe")
    found = report.findings()
    assert set(zip(found["step"], found["layer"], found["tensor"], found["issue"],
                   strict=True)) == single_findings


@pytest.mark.slow
def test_gpipe_findings_of_every_rank_are_those_of_one_process(
        spawned: Spawned, single_findings: set[tuple[int, str, str, str]]) -> None:
    for rank in spawned.phase("gpipe"):
        assert _as_set(rank["findings"]) == single_findings


@pytest.mark.slow
def test_gpipe_run_files_hold_every_stage_once_in_model_order(
        spawned: Spawned, reference: dict[str, Any], single: graddebug.Watcher) -> None:
    spawned.phase("gpipe")
    frame = graddebug.load(spawned.out / "gpipe").frame()
    keys = list(zip(frame["step"], frame["layer"], frame["tensor"], frame["kind"], strict=True))
    assert len(keys) == len(set(keys))  # once, not once per rank
    check_rows(frame, reference, stages=(0, 1))
    one = single.frame()
    assert dict(zip(keys, frame["depth"], strict=True)) == dict(zip(
        zip(one["step"], one["layer"], one["tensor"], one["kind"], strict=True), one["depth"],
        strict=True))
    for step in range(STEPS):
        acts = frame[(frame["kind"] == "activation") & (frame["step"] == step)]
        by_depth = list(acts.sort_values("depth")["layer"])
        assert by_depth == [name for name in LEAVES if name in set(acts["layer"])]
        assert by_depth[0].startswith("blocks.1") and by_depth[-1] == "blocks.3.0"


@pytest.mark.slow
def test_gpipe_watch_leaves_weights_bitwise_identical(spawned: Spawned) -> None:
    for rank in spawned.phase("gpipe"):
        assert rank["moved"], "the weights did not change: the comparison would prove nothing"
        assert rank["bitwise"]


@pytest.mark.slow
def test_gpipe_costs_one_collective_per_recorded_step(spawned: Spawned) -> None:
    single = "all_gather_single" if hasattr(dist, "all_gather_single") \
        else "all_gather_into_tensor"
    for rank in spawned.phase("gpipe"):
        # The first step's exchange of row keys is an all_gather_object, which is not counted.
        assert rank["collectives"] == [single] * STEPS


@pytest.mark.slow
def test_1f1b_closed_by_the_optimizer_gives_the_rows_of_one_process(
        spawned: Spawned, reference: dict[str, Any],
        single_findings: set[tuple[int, str, str, str]]) -> None:
    for rank in spawned.phase("1f1b"):
        check_rows(pd.DataFrame(rank["rows"]), reference, stages=(0, 1))
    union = set().union(*(_as_set(rank["findings"]) for rank in spawned.phase("1f1b")))
    assert union == single_findings


@pytest.mark.slow
def test_bf16_rows_equal_the_float64_statistics_of_its_gradients(spawned: Spawned) -> None:
    ranks = spawned.phase("bf16")
    truth = {k: v for rank in ranks for k, v in rank["truth"].items()}
    assert any(k.endswith("/output") for k in truth) and any(k.endswith("/weight")
                                                            for k in truth)
    for rank in ranks:
        frame = pd.DataFrame(rank["rows"])
        assert {f"{la}/{t}" for la, t in zip(frame["layer"], frame["tensor"],
                                             strict=True)} == set(truth)
        for row in frame.itertuples():
            expected = truth[f"{row.layer}/{row.tensor}"]
            assert row.norm == pytest.approx(expected, rel=1e-3), (row.layer, row.tensor)


# -- one process: a one-stage pipeline, fast ---------------------------------------------------


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _one_stage(steps: int, **options: Any) -> pd.DataFrame:
    module, schedule = pipeline(0, 1, **options)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    with graddebug.watch(schedule, param_stats="full", strict=True) as dbg:
        for step in range(steps):
            optimizer.zero_grad()
            run_step(schedule, 0, 1, step)
            dbg.step()
            optimizer.step()
    return dbg.frame()


def test_micro_batches_pool_into_the_rows_of_the_global_batch(group: None) -> None:
    # The first step runs torch's metadata inference too: its pass is not recorded.
    check_rows(_one_stage(2), reference_run(2), stages=(0, 1))


def test_a_schedule_that_does_not_scale_needs_no_division(group: None) -> None:
    frame = _one_stage(2, loss=sum_loss, scale_grads=False)
    check_rows(frame, reference_run(2, loss=sum_loss), stages=(0, 1))


def test_clips_under_a_pipeline_are_refused(group: None) -> None:
    _, schedule = pipeline(0, 1)
    with pytest.raises(ConfigError, match="micro-batch"), graddebug.watch(
            schedule, intervene={"blocks.2.0": {"clip_norm": 1.0}}):
        pass


def test_several_stages_per_rank_are_refused(group: None) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    stages = [PipelineStage(stage_module(net(), s), s, 2, torch.device("cpu"))
              for s in range(2)]
    schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss_fn)
    with pytest.raises(ConfigError, match="one stage per rank"), graddebug.watch(schedule):
        pass


def test_a_data_parallel_stage_is_refused(group: None) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel as DDP

    stage = PipelineStage(DDP(net()), 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, MICRO, loss_fn=loss_fn)
    with pytest.raises(ConfigError, match="data parallelism"), graddebug.watch(schedule):
        pass


def test_a_stage_module_watched_alone_is_refused(group: None) -> None:
    module, schedule = pipeline(0, 1)
    with pytest.raises(ConfigError, match=r"graddebug.watch\(schedule\)"), \
            graddebug.watch(module):
        pass
    other = net()  # a module that no stage runs is watched as ever
    with graddebug.watch(other) as dbg:
        x, y = global_batch(0)
        loss_fn(other(x), y).backward()
        dbg.step()
    assert set(dbg.frame()["kind"]) == {"activation", "parameter"}
    assert schedule is not None  # the stage stays alive until here


def test_kept_output_gradients_are_each_micro_batch_of_the_global_one(group: None) -> None:
    model = net()
    x, y = global_batch(0)
    out = model(x)
    (truth,) = torch.autograd.grad(loss_fn(out, y), out)  # the global batch's, one process
    module, schedule = pipeline(0, 1)
    with graddebug.watch(schedule, keep=["blocks.3.0"]) as dbg:
        run_step(schedule, 0, 1, 0)
        result = dbg.step()
    assert result is not None
    rows = BATCH // MICRO
    for call in range(MICRO):
        label = "blocks.3.0" + (f"#{call}" if call else "")
        expected = truth[call * rows:(call + 1) * rows].numpy()
        assert result.kept[label] == pytest.approx(expected, rel=1e-5, abs=1e-8), label
    assert module.blocks["3"][0].weight.grad is not None
