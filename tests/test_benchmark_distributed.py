"""``benchmarks/distributed.py``: its command line, what it counts as graddebug's collective,
and a tiny run on two gloo processes that writes the JSON the docs render."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import imported

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    # Imported under its own name: the spawned processes import its worker by that name.
    return imported("distributed")


def test_the_command_line_keeps_its_defaults_and_refuses_what_it_cannot_split(bench) -> None:
    args = bench.parse_args([])
    assert args.worlds == [2, 4] and args.setups == ["ddp", "tp", "fsdp2"]
    for argv in (["--worlds", "3"], ["--setups", "zero"], ["--worlds", "1"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_only_graddebugs_own_calls_are_timed(bench, tmp_path: Path) -> None:
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        ours = {"__name__": "graddebug_torch.fake", "dist": dist, "torch": torch}
        exec("def gather():\n    dist.all_reduce(torch.ones(2))\n", ours)
        real = dist.all_reduce
        with bench.graddebug_collectives() as spent:
            dist.all_reduce(torch.ones(2))  # the user's (or DDP's) own: not counted
            ours["gather"]()
            ours["gather"]()
        assert len(spent) == 2 and all(s > 0 for s in spent)
        assert dist.all_reduce is real  # given back
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_tiny_run_writes_every_setup_and_the_docs_render_it(bench, tmp_path: Path) -> None:
    out = tmp_path / "distributed.json"
    assert bench.main(["--worlds", "2", "--rounds", "1", "--steps-per-round", "2", "--warmup",
                       "0", "--width", "8", "--blocks", "1", "--batch", "4", "--json",
                       str(out)]) == 0
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert [(r["setup"], r["world"]) for r in results] == [("DDP", 2), ("TP", 2), ("FSDP2", 2)]
    for res in results:
        assert res["plain_ms"] > 0 and res["watched_ms"] > 0 and res["close_ms"] > 0
        assert 0 <= res["collective_ms"] <= res["close_ms"]
        assert res["rows_per_step"] > 0 and res["findings"] == 0
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        from benchtables import build_table
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    table = build_table([out])
    assert [row[:2] for row in table.rows] == [["DDP", "2"], ["TP", "2"], ["FSDP2", "2"]]
