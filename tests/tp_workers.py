"""The workers of ``test_torch_tensor_parallel.py``: each rank trains the model of
``tp_models.py`` sharded one way, watched and not, and leaves what it saw in a JSON file.

Besides graddebug's rows, each scenario trains a plain twin (no graddebug) and rebuilds, from
the pieces every rank holds, the whole gradient of each parameter (``DTensor.full_tensor``) and
of each layer output (the local pieces put back together over the tensor-parallel ranks, then
over the data-parallel groups, times ``1/dp``), in float64: the truth for that very run, which
the tests check against the single process.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import graddebug
from tp_models import (
    CLIP,
    LR,
    SPLIT_OUTPUTS,
    STEPS,
    Layout,
    Net,
    loss_fn,
    net,
    output_hooks,
    parallelize,
    stats,
    whole,
)

dist = torch.distributed
Builder = Callable[[], Net]


@contextlib.contextmanager
def collectives() -> Iterator[list[str]]:
    """The collectives that run inside the block, as the gloo backend records each one (the
    process group's own record: every ``torch.distributed`` call, functional or not, made by
    graddebug or by ``DTensor``)."""
    from torch.profiler import ProfilerActivity, profile

    calls: list[str] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield calls
    calls.extend(e.name for e in prof.events() if e.name.startswith("gloo:"))


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def gather_truth(model: Net, seen: dict[str, torch.Tensor], layout: Layout,
                 rank: int) -> dict[str, Any]:
    """The whole gradients of one step of ``model`` (after its backward), in float64."""
    params = {}
    for pname, p in model.named_parameters():
        if p.grad is not None:  # the same parameters on every rank: the collectives pair up
            params[pname] = stats(whole(p.grad).detach().double())
    pieces = {name: whole(seen[name]).detach().double().numpy() for name in sorted(seen)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    outputs = {}
    for name in pieces:
        groups = []
        for group in range(layout.dp):
            ranks = range(group * layout.tp, (group + 1) * layout.tp)
            if name in SPLIT_OUTPUTS and not hasattr(seen[name], "full_tensor"):
                groups.append(np.concatenate([everyone[r][name] for r in ranks],
                                             axis=SPLIT_OUTPUTS[name]))
            else:
                groups.append(everyone[ranks[0]][name])
        outputs[name] = stats(np.concatenate(groups, axis=0) / layout.dp)
    return {"params": params, "outputs": outputs}


def _rows(frame: Any) -> list[dict[str, Any]]:
    """A frame's rows as plain Python values, every float at full precision."""
    return [{k: v.item() if hasattr(v, "item") else v for k, v in row.items()}
            for row in frame.to_dict(orient="records")]


def _same(a: Net, b: Net) -> bool:
    return all(torch.equal(_local(p), _local(q))
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def compare_run(build: Builder, layout: Layout, rank: int, log_dir: Path,
                dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Train ``build()`` watched (``param_stats="full"``, run files in ``log_dir``) and a plain
    twin on the same batches; return the watched rows and findings, the collectives of each
    ``dbg.step()``, the twin's whole gradients, and whether the weights are bitwise equal."""
    start, watched, plain = build(), build(), build()
    opt_w = torch.optim.SGD(watched.parameters(), lr=LR)
    opt_p = torch.optim.SGD(plain.parameters(), lr=LR)
    calls: list[list[str]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", graddebug.GradDebugWarning)
        with graddebug.watch(watched, param_stats="full", log_dir=log_dir) as dbg:
            for step in range(STEPS):
                opt_w.zero_grad()
                x, y = layout.batch(step, rank, dtype)
                loss_fn(watched(x), y).backward()
                with collectives() as made:
                    dbg.step()
                calls.append(made)
                opt_w.step()
    truth = []
    for step in range(STEPS):
        seen: dict[str, torch.Tensor] = {}
        handles = output_hooks(plain, seen)
        opt_p.zero_grad()
        x, y = layout.batch(step, rank, dtype)
        loss_fn(plain(x), y).backward()
        for handle in handles:
            handle.remove()
        truth.append(gather_truth(plain, seen, layout, rank))
        opt_p.step()
    return {"rows": _rows(dbg.frame()), "findings": _rows(dbg.findings()), "collectives": calls,
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, graddebug.GradDebugWarning)],
            "truth": truth, "bitwise": _same(watched, plain), "moved": not _same(plain, start)}


def clipped_run(build: Builder, layout: Layout, rank: int,
                clip: dict[str, float]) -> dict[str, Any]:
    """Train ``build()`` watched with ``clip_norm`` on the layer outputs ``clip`` names; return
    the rows and the whole weights after :data:`STEPS` steps."""
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    intervene = {name: {"clip_norm": value} for name, value in clip.items()}
    with graddebug.watch(model, intervene=intervene) as dbg:
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = layout.batch(step, rank)
            loss_fn(model(x), y).backward()
            dbg.step()
            optimizer.step()
    weights = {n: whole(p).detach().double().numpy().tolist()
               for n, p in model.named_parameters()}
    return {"rows": _rows(dbg.frame()), "findings": _rows(dbg.findings()), "weights": weights}


def refused(rank: int, world: int) -> dict[str, Any]:
    """A parameter ``DTensor`` whose placement no rule covers, watched for three steps: what
    graddebug raised or warned, and the rows it recorded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

    class Striped(Placement):
        """A layout of the user's own, which graddebug has never heard of."""

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Striped)

        def __hash__(self) -> int:
            return 7

        def __repr__(self) -> str:
            return "Striped()"

    mesh = init_device_mesh("cpu", (world,))

    def striped(local: torch.Tensor) -> Any:
        return DTensor.from_local(local, mesh, [Striped()], run_check=False,
                                  shape=torch.Size([3 * world, 4]), stride=(4, 1))

    torch.manual_seed(rank)
    weight = torch.nn.Parameter(striped(torch.randn(3, 4)))
    raised = ""
    dbg = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with graddebug.watch(params={"W": weight}) as dbg:
                for _ in range(STEPS):
                    weight.grad = striped(torch.randn(3, 4))
                    dbg.step()
        except graddebug.GradDebugError as e:
            raised = f"{type(e).__name__}: {e}"
    return {"raised": raised, "internal": isinstance_name(raised, "GradDebugInternalError"),
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, graddebug.GradDebugWarning)],
            "rows": _rows(dbg.frame()) if dbg is not None else [],
            "findings": _rows(dbg.findings()) if dbg is not None else []}


def isinstance_name(raised: str, name: str) -> bool:
    """Whether the error written as ``"Type: message"`` is of the class ``name``."""
    return raised.startswith(f"{name}:")


# -- the meshes ---------------------------------------------------------------------------------


def tp_builder(world: int, dtype: torch.dtype) -> Builder:
    """Tensor parallelism over the whole world."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return lambda: parallelize(net(dtype), mesh)


def fsdp_tp_builder(dtype: torch.dtype) -> Builder:
    """FSDP2 over ``dp`` times tensor parallelism over ``tp`` on a ``(2, 2)`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build() -> Net:
        model = parallelize(net(dtype), mesh["tp"])
        for part in (model.first, model.ffn, model.hand, model.side):
            fully_shard(part, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    return build


def hsdp_builder(dtype: torch.dtype) -> Builder:
    """HSDP: FSDP2 on a ``(replicate 2, shard 2)`` mesh, no tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build() -> Net:
        model = net(dtype)
        for part in (model.first, model.ffn, model.hand, model.side):
            fully_shard(part, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return build


# -- the workers ------------------------------------------------------------------------------


def two_ranks(rank: int, world: int, out: Path) -> None:
    """Tensor parallelism over two ranks: fp32, a clip, bf16, and an unknown placement."""
    from test_torch_distributed import Results

    results = Results(out, rank)
    layout = Layout(1, world)
    results.phase("tp", lambda: compare_run(tp_builder(world, torch.float32), layout, rank,
                                            out / "tp"))
    results.phase("clip", lambda: clipped_run(tp_builder(world, torch.float32), layout, rank,
                                              CLIP))
    results.phase("tp_bf16", lambda: compare_run(tp_builder(world, torch.bfloat16), layout,
                                                 rank, out / "tp_bf16", torch.bfloat16))
    results.phase("refuse", lambda: refused(rank, world))


def four_ranks(rank: int, world: int, out: Path) -> None:
    """FSDP2 x TP and HSDP on ``(2, 2)`` meshes, in fp32 and in bf16."""
    from test_torch_distributed import Results

    results = Results(out, rank)
    for name, builder, layout in (("fsdp_tp", fsdp_tp_builder, Layout(2, 2)),
                                  ("hsdp", hsdp_builder, Layout(4, 1))):
        for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
            tag = name + suffix
            results.phase(tag, lambda b=builder, la=layout, d=dtype, t=tag: compare_run(
                b(d), la, rank, out / t, d))
