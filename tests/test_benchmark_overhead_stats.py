"""The method of ``benchmarks/overhead_torch.py``: the twins' pairs of single steps (its
statistics are tested in ``test_benchmark_ratios.py``)."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded

pytest.importorskip("torch")

@pytest.fixture(scope="module")
def bench():
    with loaded("overhead_torch") as module:
        yield module


def test_time_pairs_alternates_single_steps_and_the_plain_twin_never_carries_a_hook(bench):
    import torch
    from torch import nn

    import graddebug

    log: list[tuple[str, int]] = []

    class Probe(nn.Linear):
        """Logs which twin ran and how many forward hooks its model carried then."""

        def __init__(self, tag: str) -> None:
            super().__init__(4, 4)
            self.tag = tag

        def forward(self, x):
            log.append((self.tag, sum(len(m._forward_hooks) for m in model_of[self.tag]
                                      .modules())))
            return super().forward(x)

    torch.manual_seed(0)
    plain_model = nn.Sequential(Probe("plain"), nn.ReLU(), nn.Linear(4, 2))
    work = bench.Workload("tiny", "", plain_model,
                          torch.optim.SGD(plain_model.parameters(), lr=1e-4),
                          torch.randn(8, 4), torch.randn(8, 2), nn.functional.mse_loss)
    other = bench.twin(work)
    other.model[0].tag = "watched"
    model_of = {"plain": plain_model, "watched": other.model}
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(),
                                                  other.model.parameters(), strict=True))
    watcher = graddebug.watch(other.model)
    plain, watched, enter_exit = bench.time_pairs(work, other, 4, watcher,
                                                  torch.device("cpu"), watched_first=True)
    assert [tag for tag, _ in log] == ["watched", "plain", "plain", "watched",
                                       "watched", "plain", "plain", "watched"]
    assert all(hooks == 0 for tag, hooks in log if tag == "plain")
    assert all(hooks > 0 for tag, hooks in log if tag == "watched")
    assert len(plain) == len(watched) == 4 and min(plain + watched) > 0 and enter_exit > 0
    assert sorted(set(watcher.frame()["step"])) == [0, 1, 2, 3]
