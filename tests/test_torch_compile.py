"""graddebug under ``torch.compile``: the frame of eager mode, without added graph breaks.

Each test compiles from a clean dynamo state. Dynamo does not guard on hooks added to a module
after a hook-free graph of its class was compiled (``skip_nnmodule_hook_guards``), so a plain
compiled run is never followed by a watched one of the same class without a reset in between.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import graddebug  # noqa: E402
from graddebug.errors import GradDebugWarning, MaskShapeError  # noqa: E402
from torch_models import relu_mlp, tiny_transformer  # noqa: E402

KEY = ["step", "layer", "tensor", "kind"]
EXACT = ["depth", "shape", "numel", "nan", "inf"]
WITH_OUTPUTS_BREAKS = 0
"""Graph breaks that watching layer outputs adds on the MLP and the tiny transformer, as
measured (README, "torch.compile"): the bound these tests hold it to."""


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return relu_mlp(depth=3, width=16, inputs=8), torch.randn(4, 8)


def _transformer() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return tiny_transformer(d_model=16, layers=1), torch.randn(2, 5, 16)


def _train(model: nn.Module, call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
           steps: int = 2, **options: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``steps`` SGD steps of ``call`` watched with ``options``; the frame and the findings."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddebug.watch(call, **options) as dbg:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            call(x).square().mean().backward()
            dbg.step()
            opt.step()
    return dbg.frame(), dbg.findings()


def _eager_and_compiled(build: Callable[[], tuple[nn.Module, torch.Tensor]], steps: int = 2,
                        backend: str = "inductor", **options: Any
                        ) -> tuple[pd.DataFrame, pd.DataFrame]:
    model, x = build()
    compiled_model = copy.deepcopy(model)
    eager, _ = _train(model, model, x, steps, **options)
    compiled, _ = _train(compiled_model, torch.compile(compiled_model, backend=backend), x,
                         steps, **options)
    return eager, compiled


def assert_same_frame(eager: pd.DataFrame, compiled: pd.DataFrame) -> None:
    """Same rows (names, depths, shapes) and statistics within float32 reassociation."""
    assert len(eager) and sorted(compiled["layer"].unique()) == sorted(eager["layer"].unique())
    a = eager.sort_values(KEY).reset_index(drop=True)
    b = compiled.sort_values(KEY).reset_index(drop=True)
    pd.testing.assert_frame_equal(a[KEY + EXACT], b[KEY + EXACT])
    for column in ("norm", "std", "absmax"):
        np.testing.assert_allclose(b[column], a[column], rtol=1e-5, err_msg=column)
    outputs = a["kind"] != "parameter"
    np.testing.assert_allclose(b["zero_frac"][outputs], a["zero_frac"][outputs], rtol=1e-5)
    # A 1-D parameter's zero_frac counts its gradient's exact zeros. Where that gradient is
    # float noise (an attention key's bias: the softmax ignores a shift), another kernel's
    # summation order makes a few other entries come out exactly 0 (the tiny transformer's
    # in_proj_bias: 2 of its 16 key entries in eager, none compiled).
    params = ~outputs
    assert (a["zero_frac"][params].isna() == b["zero_frac"][params].isna()).all()
    slack = 4.0 / a["numel"][params]
    assert ((b["zero_frac"][params] - a["zero_frac"][params]).abs().fillna(0) <= slack).all()
    # A mean near zero cancels: judge it on the scale of the entries (their rms).
    rms = a["norm"] / np.sqrt(a["numel"])
    assert (np.abs(b["mean"] - a["mean"]).fillna(0) <= 1e-5 * rms + 1e-12).all()


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def _count(model: nn.Module, x: torch.Tensor, steps: int = 3, **options: Any
           ) -> tuple[int, int]:
    """Graph breaks and compiled graphs of ``steps`` steps of the compiled ``model`` (watched
    with ``options`` unless None), from a clean dynamo state; dynamo alone (backend "eager")."""
    torch._dynamo.reset()
    counters.clear()
    call = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run(dbg: Any) -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            call(x).square().mean().backward()
            if dbg is not None:
                dbg.step()
            opt.step()

    if options.get("plain"):
        run(None)
    else:
        with graddebug.watch(call, **options) as dbg:
            run(dbg)
    return _breaks(), counters["stats"]["unique_graphs"]


# -- the frame of eager mode -------------------------------------------------------------------


@pytest.mark.parametrize("outputs", [True, False], ids=["outputs", "params_only"])
def test_compiled_mlp_frame_equals_eager(outputs):
    eager, compiled = _eager_and_compiled(_mlp, backend="aot_eager", outputs=outputs)
    assert_same_frame(eager, compiled)
    assert set(compiled["kind"]) == ({"activation", "parameter"} if outputs else {"parameter"})


def test_in_place_activation_after_a_watched_layer():
    def build() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        return relu_mlp(depth=3, width=16, inputs=8, inplace=True), torch.randn(4, 8)

    eager, compiled = _eager_and_compiled(build, backend="aot_eager")
    assert_same_frame(eager, compiled)


def test_watch_entered_before_compiling_the_model_records_the_same_frame():
    model, x = _mlp()
    reference = copy.deepcopy(model)
    eager, _ = _train(reference, reference, x)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graddebug.watch(model) as dbg:
        call = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            call(x).square().mean().backward()
            dbg.step()
            opt.step()
    assert_same_frame(eager, dbg.frame())


def test_activation_norm_equals_autograd_grad_under_compile():
    model, x = _mlp()
    call = torch.compile(model, backend="aot_eager")
    with graddebug.watch(call) as dbg:
        call(x).square().mean().backward()
        dbg.step()
    h = model[:2](x)  # the output of layer "1", recomputed eagerly
    (expected,) = torch.autograd.grad(model[2:](h).square().mean(), h)
    row = dbg.frame().query("layer == '1' and kind == 'activation'")
    np.testing.assert_allclose(row["norm"], [float(expected.norm())], rtol=1e-5)


def test_every_n_records_the_same_steps_as_eager():
    eager, compiled = _eager_and_compiled(_mlp, steps=4, backend="aot_eager", every=2)
    assert sorted(compiled["step"].unique()) == [0, 2]
    assert_same_frame(eager, compiled)


def test_intervention_changes_the_gradient_as_in_eager_mode():
    spec = {"2": {"clip_norm": 1e-3}}
    model, x = _mlp()
    compiled_model = copy.deepcopy(model)
    eager, _ = _train(model, model, x, steps=1, intervene=spec)
    compiled, _ = _train(compiled_model, torch.compile(compiled_model, backend="aot_eager"), x,
                         steps=1, intervene=spec)
    assert_same_frame(eager, compiled)
    row = compiled.query("layer == '2' and kind == 'activation'").iloc[0]
    assert row["norm"] == pytest.approx(1e-3, rel=1e-5) and row["pre_norm"] > 1e-3
    for a, b in zip(model.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_mask_acts_as_in_eager_mode_without_a_recompile_and_a_wrong_one_raises():
    mask = torch.ones(1, 16)
    mask[0, :8] = 0
    eager, compiled = _eager_and_compiled(_mlp, steps=3, backend="aot_eager",
                                          intervene={"2": {"mask": mask}})
    assert_same_frame(eager, compiled)
    assert counters["stats"]["unique_graphs"] == 1
    model, x = _mlp()
    call = torch.compile(model, backend="aot_eager")
    with pytest.raises(MaskShapeError, match="'2' has shape \\(3, 5\\)"), \
            graddebug.watch(call, intervene={"2": {"mask": torch.ones(3, 5)}}):
        call(x)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_detached_layer_and_nonfinite_forward_are_found_as_in_eager_mode(backend):
    class Cut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).detach())

    class Log(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).log()

    for build in (Cut, Log):
        torch.manual_seed(0)
        model, x = build(), torch.randn(3, 4)
        compiled_model = copy.deepcopy(model)
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GradDebugWarning)  # the findings' own warnings
            _, eager = _train(model, model, x, steps=1)
            _, compiled = _train(compiled_model, torch.compile(compiled_model, backend=backend),
                                 x, steps=1)
        assert len(eager)
        columns = ["step", "layer", "tensor", "issue", "message"]
        pd.testing.assert_frame_equal(
            compiled[columns].sort_values(columns).reset_index(drop=True),
            eager[columns].sort_values(columns).reset_index(drop=True))


@pytest.mark.parametrize("train", [True, False], ids=["training", "eval"])
def test_a_nan_made_by_a_batch_norm_is_named_there_as_in_eager_mode(train: bool) -> None:
    # compiled, a batch norm's forward check reads the tensors it normalises with, not its
    # output; a NaN left in the running statistics matters only where they are used (eval)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2)).train(train)
    with torch.no_grad():
        model[1].weight[1] = float("nan")
    stale = copy.deepcopy(model)
    with torch.no_grad():
        stale[1].running_var[0] = float("nan")
    x = torch.randn(2, 3, 8, 8)

    def nonfinite(net: nn.Module, call: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GradDebugWarning)
            with graddebug.watch(call) as dbg:
                call(x).square().mean().backward()
                dbg.step()
        return dbg.findings().query("issue == 'nonfinite'")["layer"].tolist()

    assert nonfinite(model, model) == ["1"]
    compiled_model = copy.deepcopy(model)
    assert nonfinite(compiled_model, torch.compile(compiled_model, backend="aot_eager")) == ["1"]
    torch._dynamo.reset()
    with torch.no_grad():
        stale[1].weight[1] = 1.0  # only the running statistics hold a NaN now
    found = nonfinite(stale, torch.compile(stale, backend="aot_eager"))
    assert found == ([] if train else ["1"])


def test_an_output_only_eager_mode_can_judge_is_named_in_one_warning():
    class Mask(nn.Module):  # parameter-free, outside torch.nn: a cut only if values flowed
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ones(x.shape[0], 1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.mask = nn.Linear(8, 4), Mask()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return h * self.mask(h)

    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    compiled_model = copy.deepcopy(model)
    _, eager = _train(model, model, x, steps=1)  # pytest makes a GradDebugWarning an error
    with pytest.warns(GradDebugWarning, match="'mask' ran inside torch.compile") as caught:
        _, compiled = _train(compiled_model, torch.compile(compiled_model, backend="aot_eager"),
                             x, steps=2)
    assert len([w for w in caught if issubclass(w.category, GradDebugWarning)]) == 1
    assert eager.empty and compiled.empty  # no cut_graph finding either way


def test_forward_operator_measures_the_output_it_is_handed_when_it_runs():
    """Inductor reuses a graph's buffers for later results: the operator measures an output
    when it runs, not when the step closes. The call a compiled forward makes, by hand."""
    model, _ = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradDebugWarning)  # the NaN's own warning
        with graddebug.watch(model) as dbg:
            output = torch.tensor([1.0, float("nan")])
            torch.ops.graddebug.forward_ran(torch.zeros(()), [output], id(model[0]), "output",
                                            [0])
            output.zero_()  # as a later kernel of the graph reusing the buffer would
            model(torch.randn(4, 8)).square().mean().backward()
            dbg.step()
    found = dbg.findings().query("issue == 'nonfinite'")
    assert "0" in set(found["layer"])


def test_a_model_compiled_before_watch_is_named_in_one_warning_and_reset_recovers_it():
    model, x = _mlp()
    compiled = torch.compile(model, backend="eager")
    compiled(x).sum().backward()  # traced without graddebug's hooks

    def steps(dbg: Any) -> None:
        for _ in range(2):
            model.zero_grad()
            compiled(x).sum().backward()
            dbg.step()

    with (pytest.warns(GradDebugWarning, match="compiled with torch.compile before") as caught,
          graddebug.watch(compiled) as dbg):
        steps(dbg)
    assert len([w for w in caught if issubclass(w.category, GradDebugWarning)]) == 1
    assert set(dbg.frame()["kind"]) == {"parameter"}  # the hooks never ran

    with graddebug.watch(compiled) as dbg:
        torch.compiler.reset()
        steps(dbg)
    frame = dbg.frame()
    outputs = frame[frame["kind"] == "activation"]
    assert len(outputs) == 2 * 5  # five modules, two steps
    layer0 = outputs[(outputs["layer"] == "0") & (outputs["step"] == 1)]
    model.zero_grad()
    h = model[0](x)
    (expected,) = torch.autograd.grad(model[1:](h).sum(), h)
    np.testing.assert_allclose(layer0["norm"], [float(expected.norm())], rtol=1e-5)


def test_tap_inside_a_compiled_function_records_as_in_eager_mode():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def f(dbg: Any) -> torch.Tensor:
        return dbg.tap(x @ w, "h").tanh().sum()

    with graddebug.watch() as dbg:
        f(dbg).backward()
        dbg.step()
    eager = dbg.frame()
    compiled_f = torch.compile(f, backend="aot_eager")
    with graddebug.watch() as dbg:
        compiled_f(dbg).backward()
        dbg.step()
    assert_same_frame(eager, dbg.frame())
    # The tap runs eagerly between two graphs: one break, which dynamo counts once for each
    # frame it unwinds (f, Watcher.tap, the adapter's tap).
    assert counters["stats"]["unique_graphs"] == 2
    assert all("compiler.disable" in reason for reason in counters["graph_break"])
    h = x @ w
    (expected,) = torch.autograd.grad(h.tanh().sum(), h)
    np.testing.assert_allclose(dbg.frame()["norm"], [float(expected.norm())], rtol=1e-5)


# -- graph breaks and recompiles ---------------------------------------------------------------


@pytest.mark.parametrize("build", [_mlp, _transformer], ids=["mlp", "transformer"])
def test_parameter_capture_adds_no_graph_break_and_no_recompile(build):
    model, x = build()
    plain = _count(copy.deepcopy(model), x, plain=True)
    watched = _count(copy.deepcopy(model), x, outputs=False)
    assert watched == plain
    assert plain[1] == 1  # one graph, compiled once over three steps


@pytest.mark.parametrize("build", [_mlp, _transformer], ids=["mlp", "transformer"])
def test_output_capture_adds_at_most_the_documented_graph_breaks(build):
    model, x = build()
    plain_breaks, plain_graphs = _count(copy.deepcopy(model), x, plain=True)
    breaks, graphs = _count(copy.deepcopy(model), x)
    assert breaks - plain_breaks <= WITH_OUTPUTS_BREAKS
    assert graphs == plain_graphs  # compiled once: no recompile, let alone the limit


def test_a_parameter_free_module_outside_torch_nn_adds_no_graph_break():
    # eager mode follows values through such modules (GPT-2's attention helpers, position
    # tables); under dynamo that following is left to the compiled operators
    class Positions(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.pos, self.out = nn.Linear(8, 8), Positions(), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.pos(self.fc(x)))

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    plain = _count(copy.deepcopy(model), x, plain=True)
    assert _count(copy.deepcopy(model), x) == plain


def test_a_graph_compiled_under_one_watcher_serves_the_next():
    model, x = _mlp()
    call = torch.compile(model, backend="aot_eager")
    frames = []
    for _ in range(3):
        with graddebug.watch(call) as dbg:
            call(x).square().mean().backward()
            dbg.step()
        frames.append(dbg.frame())
        model.zero_grad(set_to_none=True)
    assert counters["stats"]["unique_graphs"] == 1
    for frame in frames[1:]:
        assert_same_frame(frames[0], frame)


def test_watchers_with_other_options_alternate_on_one_compiled_model():
    model, x = _mlp()
    options = ({"outputs": False}, {}, {"outputs": False}, {"every": 2})

    def frame(call: Callable[[torch.Tensor], torch.Tensor], **option: Any) -> pd.DataFrame:
        with graddebug.watch(call, **option) as dbg:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                call(x).square().mean().backward()
                dbg.step()
        return dbg.frame()

    eager = [frame(model, **option) for option in options]
    call = torch.compile(model, backend="aot_eager")
    for option, reference in zip(options, eager, strict=True):
        assert_same_frame(reference, frame(call, **option))
    assert counters["stats"]["unique_graphs"] == 2  # one with output capture, one without


def test_no_functorch_warning_under_compile():
    model, x = _mlp()
    call = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradDebugWarning)
        with graddebug.watch(call) as dbg:
            call(x).square().mean().backward()
            dbg.step()
    assert "0" in set(dbg.frame().query("kind == 'activation'")["layer"])  # the first layer


# -- larger models (compilation takes a while on CPU) ------------------------------------------


# Inductor (the default backend) compiles to C++; the backend "aot_eager" above runs the same
# dynamo and AOTAutograd graphs (where hooks become operators) without that step.


@pytest.mark.slow
@pytest.mark.parametrize("outputs", [True, False], ids=["outputs", "params_only"])
@pytest.mark.parametrize("build", [_mlp, _transformer], ids=["mlp", "transformer"])
def test_inductor_frame_equals_eager(build, outputs):
    eager, compiled = _eager_and_compiled(build, outputs=outputs)
    assert_same_frame(eager, compiled)


@pytest.mark.slow
def test_compiled_training_is_bitwise_identical_with_and_without_watch():
    model, x = _mlp()
    watched = copy.deepcopy(model)
    for m, watch in ((model, False), (watched, True)):
        torch._dynamo.reset()
        call = torch.compile(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        with graddebug.watch(call) if watch else contextlib.nullcontext() as dbg:
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                call(x).square().mean().backward()
                if dbg is not None:
                    dbg.step()
                opt.step()
    for a, b in zip(model.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)



def test_a_graph_compiled_on_a_skipped_step_keeps_graddebugs_hooks():
    # Parked on the steps every= skips, the forward hooks would be missing from a graph traced
    # then (here a recompile for a new batch size) and so from the recorded steps that reuse it.
    model, _ = _mlp()
    reference = copy.deepcopy(model)
    sizes = [4, 3, 3, 5, 5]

    def run(net: nn.Module, call: Callable[[torch.Tensor], torch.Tensor]) -> pd.DataFrame:
        torch.manual_seed(1)
        inputs = [torch.randn(n, 8) for n in sizes]
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        with graddebug.watch(net, every=2) as dbg:
            for x in inputs:
                opt.zero_grad(set_to_none=True)
                call(x).square().mean().backward()
                dbg.step()
                opt.step()
        return dbg.frame()

    eager = run(reference, reference)
    compiled = run(model, torch.compile(model, backend="aot_eager"))
    assert counters["stats"]["unique_graphs"] >= 2  # traced again on skipped step 1
    assert sorted(compiled.query("kind == 'activation'")["step"].unique()) == [0, 2, 4]
    assert_same_frame(eager, compiled)
