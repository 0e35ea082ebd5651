"""DeepSpeed ZeRO-1, -2 and -3 against one process trained on the global batch.

Two gloo processes on the CPU are started once for the module (``DS_ACCELERATOR=cpu``, set in
the workers only); each runs every scenario in turn and leaves its results in files: ZeRO-1,
-2 and -3 in fp32 with two micro-batches per update, then in bf16. The reference is computed
here, in one process, with plain torch hooks and no graddebug; the bf16 reference is the float64
norm of the gradients DeepSpeed holds (``safe_get_full_grad``, an all-gather the test may make)
and of the layer outputs' gradients caught by plain hooks on every rank.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("deepspeed") is None:  # not imported here: workers import it
    pytest.skip("deepspeed is not installed (graddebug[deepspeed])", allow_module_level=True)
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from graddebug.errors import ConfigError  # noqa: E402
from graddebug_torch.deepspeed import claim, is_engine  # noqa: E402
from test_torch_distributed import (  # noqa: E402
    Results,
    Spawned,
    graddebug_collectives,
    launch,
)

IN, HIDDEN = 6, 8
WORLD = 2
MICRO = 2  # rows of one micro-batch on one rank
ACCUMULATE = 2  # micro-batches per update
BATCH = WORLD * MICRO * ACCUMULATE  # the global batch of one update
STEPS = 3
LR = 0.1
LEAVES = ("inp", "mid", "side", "head")
CLIP = 1.0  # DeepSpeed's default gradient_clipping: every update here is clipped
MID_SCALE = 0.5
STAGES = (1, 2, 3)


class Net(nn.Module):
    """A Tanh MLP whose ``mid`` layer has tiny weights (the gradient vanishes below it) and
    whose ``side`` branch is detached (its parameters get no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.side = nn.Linear(IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)
        with torch.no_grad():
            self.mid.weight.mul_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.head(h + self.side(x).detach())


def net() -> Net:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return Net()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, 1, generator=gen)


def micro_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``micro``-th micro-batch of update ``step``: the ranks' micro-batches
    make up the global batch."""
    x, y = global_batch(step)
    start = (micro * WORLD + rank) * MICRO
    return x[start:start + MICRO], y[start:start + MICRO]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


# -- the one-process reference, with no graddebug --------------------------------------------


def reference_run(mid_scale: float | None = None) -> dict[str, Any]:
    """Train :class:`Net` with SGD on the global batches in one process, clipping the
    gradients' global norm as DeepSpeed does: every parameter gradient's norm, mean, absmax
    and norm after the clip, and the norm of the gradient at each leaf's output (``mid``'s
    multiplied by ``mid_scale`` first, where given, as ``intervene={"mid": {"scale": ...}}``
    does)."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    modules = dict(model.named_modules())
    params: dict[tuple[int, str, str], dict[str, float]] = {}
    outputs: dict[tuple[int, str], float] = {}
    for step in range(STEPS):
        handles = []
        for name in LEAVES:
            def hook(module: nn.Module, args: Any, out: torch.Tensor, name: str = name,
                     step: int = step) -> None:
                if name == "mid" and mid_scale is not None:
                    out.register_hook(lambda grad: grad * mid_scale)
                out.register_hook(lambda grad: outputs.__setitem__(
                    (step, name), float(grad.double().norm())))
            handles.append(modules[name].register_forward_hook(hook))
        optimizer.zero_grad(set_to_none=True)
        x, y = global_batch(step)
        loss_fn(model(x), y).backward()
        for handle in handles:
            handle.remove()
        for pname, p in model.named_parameters():
            if p.grad is None:
                continue
            layer, _, tensor = pname.rpartition(".")
            g = p.grad.double()
            params[(step, layer, tensor)] = {"norm": float(g.norm()), "mean": float(g.mean()),
                                             "absmax": float(g.abs().max()),
                                             "shape": str(tuple(g.shape))}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for pname, p in model.named_parameters():
            if p.grad is not None:
                layer, _, tensor = pname.rpartition(".")
                params[(step, layer, tensor)]["clipped"] = float(p.grad.double().norm())
        optimizer.step()
    return {"params": params, "outputs": outputs}


def single_findings() -> set[tuple[int, str, str, str]]:
    """The findings of graddebug in one process on the global batches."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with graddebug.watch(model, param_stats="full") as dbg:
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            x, y = global_batch(step)
            loss_fn(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            dbg.step()
            optimizer.step()
    return _finding_keys(_rows(dbg.findings()))


def _rows(frame: Any) -> list[dict[str, Any]]:
    """A frame's rows at full precision (to_json's default keeps ten decimals)."""
    rows: list[dict[str, Any]] = json.loads(frame.to_json(orient="records",
                                                         double_precision=15))
    return rows


def _finding_keys(rows: list[dict[str, Any]]) -> set[tuple[int, str, str, str]]:
    return {(int(f["step"]), f["layer"], f["tensor"], f["issue"]) for f in rows}


# -- the workers' scenarios --------------------------------------------------------------------


def _engine(model: nn.Module, stage: int, bf16: bool) -> Any:
    import deepspeed

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATE,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 6}  # and DeepSpeed's default gradient_clipping, 1.0
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    return engine


def _weights(engine: Any) -> list[torch.Tensor]:
    """The engine's module's weights, whole (ZeRO-3 gathers its partitions)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _train(engine: Any, rank: int, before_update: Any = None) -> None:
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            x, y = micro_batch(step, micro, rank)
            if engine.bfloat16_enabled():
                x, y = x.bfloat16(), y.bfloat16()
            engine.backward(loss_fn(engine(x), y))
            if before_update is not None and micro == ACCUMULATE - 1:
                before_update(step)
            engine.step()


def _raised(call: Any) -> list[str]:
    try:
        call()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return []


def _zero(stage: int, rank: int, out: Path) -> dict[str, Any]:
    watched, plain = _engine(net(), stage, False), _engine(net(), stage, False)
    name = f"zero{stage}"
    with graddebug_collectives() as calls, \
            graddebug.watch(watched, param_stats="full", log_dir=out / name) as dbg:
        refused = [_raised(dbg.step)]  # before the engine closed any step
        _train(watched, rank)
        refused.append(_raised(dbg.step))  # after
    _train(plain, rank)
    bitwise = all(torch.equal(a, b) for a, b in zip(_weights(watched), _weights(plain),
                                                        strict=True))
    return {"frame": _rows(dbg.frame()),
            "findings": _rows(dbg.findings()),
            "collectives": calls, "bitwise": bitwise, "step_refused": refused,
            "module_refused": _raised(lambda: graddebug.watch(watched.module))}


def _scaled(rank: int) -> dict[str, Any]:
    """ZeRO-2 with an intervention on a layer output; an engine without ZeRO, refused."""
    engine = _engine(net(), 2, False)
    with graddebug.watch(engine, intervene={"mid": {"scale": MID_SCALE}},
                         param_stats="full") as dbg:
        _train(engine, rank)
    stage0 = _engine(net(), 0, False)

    def enter() -> None:
        with graddebug.watch(stage0):
            pass
    return {"frame": _rows(dbg.frame()), "stage0_refused": _raised(enter)}


def _bf16(stage: int, rank: int) -> dict[str, Any]:
    """Rows of a bf16 engine, and their float64 truth from what DeepSpeed holds."""
    from deepspeed.utils import safe_get_full_grad

    engine = _engine(net(), stage, True)
    params: dict[str, float] = {}
    sums: dict[str, float] = {}

    def truth(step: int) -> None:
        for pname, p in engine.module.named_parameters():
            if not pname.startswith("side."):
                params[f"{step}:{pname}"] = float(safe_get_full_grad(p).double().norm())

    modules = dict(engine.module.named_modules())
    for leaf in LEAVES:
        def hook(module: nn.Module, args: Any, output: torch.Tensor, leaf: str = leaf) -> None:
            def add(grad: torch.Tensor) -> None:
                key = f"{engine.global_steps}:{leaf}"
                sums[key] = sums.get(key, 0.0) + float(grad.double().square().sum())
            output.register_hook(add)
        modules[leaf].register_forward_hook(hook)
    with graddebug.watch(engine) as dbg:
        _train(engine, rank, truth)
    return {"frame": _rows(dbg.frame()), "params": params, "sums": sums}


def _scenarios(rank: int, world: int, out: Path) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results = Results(out, rank)
    for stage in STAGES:
        results.phase(f"zero{stage}", lambda stage=stage: _zero(stage, rank, out))
    results.phase("scaled", lambda: _scaled(rank))
    for stage in STAGES:
        results.phase(f"bf16_{stage}", lambda stage=stage: _bf16(stage, rank))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Spawned:
    out = tmp_path_factory.mktemp("deepspeed")
    return Spawned(out, launch(_scenarios, out, timeout=420.0))


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run()


def _check_rows(frame: list[dict[str, Any]], reference: dict[str, Any], where: str) -> None:
    """Every parameter and layer-output row equals the one-process truth, each once."""
    params = [r for r in frame if r["kind"] == "parameter"]
    assert {(r["step"], r["layer"], r["tensor"]) for r in params} == set(reference["params"])
    assert len(params) == len(reference["params"]), where
    for r in params:
        ref = reference["params"][(r["step"], r["layer"], r["tensor"])]
        at = f"{where} step {r['step']} {r['layer']}.{r['tensor']}"
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-5), at
        assert r["shape"] == ref["shape"], at
        scale = ref["norm"] / math.sqrt(r["numel"])
        assert r["mean"] == pytest.approx(ref["mean"], rel=1e-4, abs=1e-6 * scale), at
        assert r["absmax"] == pytest.approx(ref["absmax"], rel=1e-5), at
        assert r["clipped_norm"] == pytest.approx(ref["clipped"], rel=1e-5), at
        assert r["clipped_norm"] < r["norm"], at  # the clip acted
    outputs = [r for r in frame if r["kind"] == "activation"]
    assert {(r["step"], r["layer"]) for r in outputs} == set(reference["outputs"]), where
    assert len(outputs) == len(reference["outputs"]), where
    for r in outputs:
        expected = reference["outputs"][(r["step"], r["layer"])]
        assert r["norm"] == pytest.approx(expected, rel=1e-5), f"{where} {r}"


# -- ZeRO-1, -2, -3 in fp32 --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_rows_match_one_process_on_the_global_batch(spawned: Spawned, stage: int,
                                                         reference: dict[str, Any]) -> None:
    ranks = spawned.phase(f"zero{stage}")
    for rank, found in enumerate(ranks):
        _check_rows(found["frame"], reference, f"ZeRO-{stage} rank {rank}")
    # Every rank holds the same global rows, and the run files hold them once.
    assert ranks[0]["frame"] == ranks[1]["frame"]
    stored = graddebug.load(spawned.out / f"zero{stage}").frame()
    stored = stored[stored["kind"] != "loss"]
    assert len(stored) == len(ranks[0]["frame"])
    assert not stored.duplicated(["step", "layer", "tensor", "kind"]).any()


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_findings_are_those_of_one_process(spawned: Spawned, stage: int) -> None:
    ranks = spawned.phase(f"zero{stage}")
    expected = single_findings()
    issues = {issue for _, _, _, issue in expected}
    assert {"vanishing", "cut_graph"} <= issues, expected  # the model's two faults
    for found in ranks:
        assert _finding_keys(found["findings"]) == expected


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_costs_one_collective_per_step_and_leaves_the_weights_bitwise(
        spawned: Spawned, stage: int) -> None:
    for found in spawned.phase(f"zero{stage}"):
        assert len(found["collectives"]) == STEPS, found["collectives"]
        assert found["bitwise"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_refuses_dbg_step_and_the_engines_module(spawned: Spawned, stage: int) -> None:
    for found in spawned.phase(f"zero{stage}"):
        for kind, message in found["step_refused"]:
            assert kind == "EngineStepError" and "engine.step()" in message
        kind, message = found["module_refused"]
        assert kind == "ConfigError" and "graddebug.watch(engine)" in message


@pytest.mark.slow
def test_an_intervention_on_a_layer_output_acts_as_in_one_process(spawned: Spawned) -> None:
    reference = reference_run(mid_scale=MID_SCALE)
    for rank, found in enumerate(spawned.phase("scaled")):
        _check_rows(found["frame"], reference, f"scaled, rank {rank}")
        for r in found["frame"]:
            if r["layer"] == "mid" and r["kind"] == "activation":
                assert r["pre_norm"] == pytest.approx(r["norm"] / MID_SCALE, rel=1e-5)


@pytest.mark.slow
def test_an_engine_without_zero_is_refused(spawned: Spawned) -> None:
    for found in spawned.phase("scaled"):
        kind, message = found["stage0_refused"]
        assert kind == "ConfigError" and "stage 0" in message


# -- bf16 --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_rows_equal_their_float64_truth(spawned: Spawned, stage: int) -> None:
    ranks = spawned.phase(f"bf16_{stage}")
    sums: dict[str, float] = {}
    for found in ranks:  # each rank's micro-batches, pooled
        for key, value in found["sums"].items():
            sums[key] = sums.get(key, 0.0) + value
    for rank, found in enumerate(ranks):
        frame = found["frame"]
        params = [r for r in frame if r["kind"] == "parameter"]
        assert len(params) == len(found["params"]) > 0
        for r in params:
            truth = found["params"][f"{r['step']}:{r['layer']}.{r['tensor']}"]
            assert r["norm"] == pytest.approx(truth, rel=1e-3), (rank, r)
        outputs = [r for r in frame if r["kind"] == "activation"]
        assert len(outputs) == STEPS * (len(LEAVES) - 1)
        for r in outputs:
            # the ranks' losses are averaged: each rank's output gradient is WORLD times the
            # global loss's
            truth = math.sqrt(sums[f"{r['step']}:{r['layer']}"]) / WORLD
            assert r["norm"] == pytest.approx(truth, rel=1e-3), (rank, r)


# -- without DeepSpeed -------------------------------------------------------------------------


def test_a_module_with_zero_partitioned_parameters_is_refused_with_the_fix() -> None:
    model = nn.Linear(3, 2)
    model.weight.ds_id = 0  # what ZeRO-3 marks its parameters with
    with pytest.raises(ConfigError, match=r"graddebug\.watch\(engine\)"):
        claim(model)
    assert claim(nn.Linear(3, 2)) is None and not is_engine(model)
