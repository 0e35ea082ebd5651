"""The method of ``benchmarks/overhead_torch.py`` and its modules (``torch_workloads``,
``torch_configs``, ``torch_timing``): the twins' pairs of single steps, the floor (g), the
compiled twins and the command line (its statistics are tested in ``test_benchmark_ratios.py``)."""

from __future__ import annotations

import pytest

from benchmark_scripts import imported, loaded

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def workloads():
    return imported("torch_workloads")


@pytest.fixture(scope="module")
def configs():
    return imported("torch_configs")


@pytest.fixture(scope="module")
def timing():
    return imported("torch_timing")


def test_time_pairs_alternates_single_steps_and_the_plain_twin_never_carries_a_hook(
        workloads, timing):
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
    work = workloads.Workload("tiny", "", plain_model,
                              torch.optim.SGD(plain_model.parameters(), lr=1e-4),
                              torch.randn(8, 4), torch.randn(8, 2), nn.functional.mse_loss)
    other = workloads.twin(work)
    other.model[0].tag = "watched"
    model_of = {"plain": plain_model, "watched": other.model}
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(),
                                                  other.model.parameters(), strict=True))
    watcher = graddebug.watch(other.model)
    plain, watched, enter_exit = timing.time_pairs(work, other, 4, watcher,
                                                   torch.device("cpu"), watched_first=True)
    assert [tag for tag, _ in log] == ["watched", "plain", "plain", "watched",
                                       "watched", "plain", "plain", "watched"]
    assert all(hooks == 0 for tag, hooks in log if tag == "plain")
    assert all(hooks > 0 for tag, hooks in log if tag == "watched")
    assert len(plain) == len(watched) == 4 and min(plain + watched) > 0 and enter_exit > 0
    assert sorted(set(watcher.frame()["step"])) == [0, 1, 2, 3]


def test_the_outputs_floor_measures_what_b_records_of_outputs_and_leaves_no_hook(configs):
    import torch
    from torch import nn

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    x = torch.randn(6, 5)

    # The reference, with no hook: the outputs and their gradients by torch.autograd.grad.
    h1 = model[0](x)
    r1 = model[1](h1)
    h2 = model[2](r1)
    loss = h2.square().sum()
    g_h2, g_r1, g_h1 = torch.autograd.grad(loss, [h2, r1, h1], retain_graph=True)
    param_grads = torch.autograd.grad(loss, list(model.parameters()))

    floor = configs.make_watcher(model, next(c for c in configs.CONFIGS if c.key == "g"))
    with floor:
        model(x).square().sum().backward()
        values = floor.step()
        assert floor.step() == [pytest.approx(float(g.norm())) for g in param_grads]  # taken

    def sentinel(g):
        return [float(g.square().sum()), float(g.sum())]

    # Parameter norms; the forward sums of the Linear outputs (a ReLU cannot make a NaN);
    # each output gradient's sum of squares and sum, in backward order.
    want = [*(float(g.norm()) for g in param_grads),
            float(h1.detach().sum()), float(h2.detach().sum()),
            *sentinel(g_h2), *sentinel(g_r1), *sentinel(g_h1)]
    assert values == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert all(not m._forward_hooks for m in model.modules())


def test_compiled_configs_each_time_a_twin_that_records_what_they_ask(
        workloads, configs, timing, monkeypatch):
    """Under --compile a config without graddebug (n) makes dynamo compile the watched twin
    again without hooks; that graph must not serve (b)'s later rounds."""
    import io

    import torch
    from rich.console import Console
    from torch import nn

    def tiny():
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
        return model, torch.randn(4, 6), torch.randn(4, 2), nn.functional.mse_loss, "tiny"

    real_compile = torch.compile
    monkeypatch.setitem(workloads.BUILDERS, "tiny", tiny)
    monkeypatch.setattr(torch, "compile", lambda model, **options: real_compile(
        model, **{"backend": "aot_eager", **options}))
    torch._dynamo.reset()
    chosen = [c for c in configs.CONFIGS if c.key in ("b", "n")]
    results = timing.benchmark_workload("tiny", chosen, rounds=2, steps=2, warmup=1,
                                        device=torch.device("cpu"),
                                        console=Console(file=io.StringIO()), compiled=True)
    torch._dynamo.reset()
    model = tiny()[0]
    outputs, params = len(model), len(list(model.parameters()))
    by_key = {r.config: r for r in results}
    assert by_key["b"].rows_per_step == outputs + params  # every round, not the first alone
    assert by_key["n"].rows_per_step == 0


def test_the_command_line_keeps_its_defaults_and_refuses_what_it_cannot_measure(capsys):
    with loaded("overhead_torch") as bench:
        args = bench.parse_args([])
        assert args.workload_names == ["mlp", "cnn", "transformer"]
        assert [c.key for c in args.config_list] == ["a", "b"]
        assert args.json == bench.DEFAULT_JSON
        args = bench.parse_args(["--configs", "n,g,a", "--compile"])
        assert [c.key for c in args.config_list] == ["a", "g", "n"]  # in the table's order
        assert args.json == bench.COMPILED_JSON
        assert bench.parse_args(["--profile"]).workload_names == ["mlp"]
        for argv in (["--configs", "a,x"], ["--configs", "c", "--steps-per-round", "5"],
                     ["--workloads", "mlp,cnn", "--profile"], ["--workloads", "vgg"],
                     ["--compile", "--warmup", "0"], ["--rounds", "0"]):
            with pytest.raises(SystemExit):
                bench.parse_args(argv)
    assert "choose from a,b,c,o,d,f,g,n" in capsys.readouterr().err
