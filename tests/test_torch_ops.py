"""Op-level capture (``watch(model, ops=True)``, ``escalate=True``) and the source lines of
``nonfinite`` and ``cut_graph`` findings.

Gradients of op rows are checked against ``torch.autograd.grad`` on the same intermediate
tensors, collected by a mode of this file's own in a separate, unwatched forward pass. Source
lines are checked against the line numbers of this file, found by searching for a marker
comment, so that editing the file cannot make the tests point at the wrong line.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
from torch import Tensor, nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode, resolve_name  # noqa: E402

import graddebug  # noqa: E402
from graddebug.errors import ConfigError, GradDebugWarning, UnknownNameError  # noqa: E402

HERE = Path(__file__)
SOURCE = HERE.read_text().splitlines()


def line_of(marker: str) -> str:
    """``test_torch_ops.py:<n>`` of the one line of this file that ends with ``# <marker>``."""
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, (marker, hits)
    return f"{HERE.name}:{hits[0]}"


def shown(line: int) -> str:
    """How findings show a line of this file: relative to the working directory."""
    relative = os.path.relpath(HERE)
    return f"{HERE if relative.startswith(os.pardir) else relative}:{line}"


def no_modes() -> bool:
    return not torch.overrides._get_current_function_mode_stack()


# -- models ----------------------------------------------------------------------------------


class FunctionalMLP(nn.Module):
    """Linear layers with functional activations in between: ops that are no module's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h)) * 0.5 + h
        return self.fc3(F.silu(h))


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class LogBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x).abs() + 1.0
        return torch.log(-h)  # log-of-negative


class SqrtBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.fc(x)) * 0.0
        return torch.sqrt(h)  # sqrt-at-zero


class DetachBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = torch.tanh(h)
        h = h.detach()  # detach-in-block
        return self.fc2(h * 2.0)


class NoGradBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        with torch.no_grad():
            h = h * 2.0  # under-no-grad
        return self.fc2(h)


class NumpyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        values = h.detach().numpy()  # numpy-round-trip
        h = torch.from_numpy(np.tanh(values))
        return self.fc2(h)


class Net(nn.Module):
    """``pre``, then the block under test, then ``head``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = block
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.pre(x)))


def summed(output: Tensor) -> Tensor:
    return output.sum()


# -- reference: autograd.grad on the intermediate tensors ------------------------------------


class Outputs(TorchFunctionMode):
    """Collects, in call order, every float output that needs a gradient of every torch call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Tensor]] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        found = [out] if isinstance(out, Tensor) else [
            t for t in out if isinstance(t, Tensor)] if isinstance(out, (tuple, list)) else []
        for t in found:
            if t.is_floating_point() and t.requires_grad:
                name = (resolve_name(func) or "").removesuffix(".__get__")
                self.calls.append((name, t))
        return out


def reference(model: nn.Module, x: Tensor,
              loss_fn: Callable[[Tensor], Tensor]) -> list[tuple[str, np.ndarray]]:
    """Per op call of an unwatched forward pass: its op, and the gradient of the loss at its
    output from ``torch.autograd.grad``."""
    mode = Outputs()
    with mode:
        out = model(x)
    grads = torch.autograd.grad(loss_fn(out), [t for _, t in mode.calls], allow_unused=True)
    return [(name, (g if g is not None else torch.zeros_like(t)).numpy().astype(np.float64))
            for (name, t), g in zip(mode.calls, grads, strict=True)]


def watched_ops(model: nn.Module, x: Tensor, loss_fn: Callable[[Tensor], Tensor],
                **options: Any) -> tuple[pd.DataFrame, Any]:
    with graddebug.watch(model, ops=True, **options) as dbg:
        model.zero_grad()
        loss_fn(model(x)).backward()
        dbg.step()
    frame = dbg.frame()
    return frame[frame["kind"] == "op"].sort_values("depth", kind="stable"), dbg


CASES = {
    "functional MLP": (FunctionalMLP, lambda: torch.randn(8, 6),
                       lambda out: (out ** 2).mean()),
    "TransformerEncoder": (encoder, lambda: torch.randn(3, 5, 16),
                           lambda out: (out * torch.linspace(-1, 1, 16)).sum()),
}


@pytest.mark.parametrize("case", CASES)
def test_op_rows_equal_autograd_grad_on_the_intermediate_tensors(case: str) -> None:
    build, batch, loss_fn = CASES[case]
    torch.manual_seed(0)
    model, x = build(), batch()
    expected = reference(model, x, loss_fn)
    ops, _ = watched_ops(model, x, loss_fn)
    # One site per call here: no op site runs twice in these forward passes.
    assert len(ops) == len(expected) > 5
    for row, (name, grad) in zip(ops.itertuples(), expected, strict=True):
        assert row.tensor.split("@")[0] == name
        assert row.shape == str(grad.shape)
        norm = float(np.linalg.norm(grad))
        assert row.norm == pytest.approx(norm, rel=1e-6, abs=1e-12), row.tensor
        # The mean cancels to almost 0 on some sites: compared up to float32 summation error.
        rms = norm / math.sqrt(grad.size)
        assert row.mean == pytest.approx(grad.mean(), rel=1e-5, abs=1e-5 * rms), row.tensor
        assert row.absmax == pytest.approx(np.abs(grad).max(), rel=1e-6), row.tensor
        assert not row.nan and not row.inf


def test_an_op_output_written_in_place_keeps_its_own_gradient() -> None:
    """``h.mul_(3)`` right after ``h = x @ w``, then ``F.relu(h, inplace=True)``: each op's row
    is the gradient of the value it produced, before the next write over it."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x: Tensor) -> Tensor:
            h = torch.mm(x, self.w)
            h.mul_(3.0)
            F.relu(h, inplace=True)
            return h.tanh()

    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(5, 4)
    ops, _ = watched_ops(model, x, summed)
    h = torch.mm(x, model.w)
    tripled = h * 3.0
    clipped = F.relu(tripled)
    grads = torch.autograd.grad(clipped.tanh().sum(), [h, tripled, clipped])
    norms = dict(zip(ops["tensor"].str.split("@").str[0], ops["norm"], strict=True))
    for op, grad in zip(["torch.mm", "torch.Tensor.mul_", "torch.nn.functional.relu"], grads,
                        strict=True):
        assert norms[op] == pytest.approx(float(grad.norm()), rel=1e-6), op
    assert len({round(float(g.norm()), 6) for g in grads}) == 3  # three different gradients


def test_kept_op_gradient_is_the_autograd_gradient() -> None:
    torch.manual_seed(0)
    model, x = FunctionalMLP(), torch.randn(8, 6)
    loss_fn = CASES["functional MLP"][2]
    expected = dict(reference(model, x, loss_fn))["torch.tanh"]
    ops, dbg = watched_ops(model, x, loss_fn, keep=["FunctionalMLP.torch.tanh@*"])
    (site,) = ops.loc[ops["tensor"].str.startswith("torch.tanh@"), "tensor"]
    kept = dbg.tensors()[f"FunctionalMLP.{site}"]
    np.testing.assert_allclose(kept[0] if kept.ndim == 3 else kept, expected, rtol=1e-6)


def test_op_rows_name_op_module_and_user_line() -> None:
    torch.manual_seed(0)
    ops, _ = watched_ops(FunctionalMLP(), torch.randn(8, 6), summed)
    sites = dict(zip(ops["tensor"], ops["layer"], strict=True))
    forward = next(i for i, t in enumerate(SOURCE) if "h = F.gelu(self.fc1(x))" in t) + 1
    assert sites[f"torch.nn.functional.linear@{HERE.name}:{forward}"] == "fc1"
    assert sites[f"torch.nn.functional.gelu@{HERE.name}:{forward}"] == "FunctionalMLP"
    assert sites[f"torch.tanh@{HERE.name}:{forward + 1}"] == "FunctionalMLP"
    # Two ops of one line are two sites: * 0.5 then + h.
    assert f"torch.Tensor.mul@{HERE.name}:{forward + 1}" in sites
    assert f"torch.Tensor.add@{HERE.name}:{forward + 1}" in sites
    assert (ops["depth"] >= 0).all() and ops["depth"].is_unique


def test_weights_are_bitwise_identical_with_and_without_ops() -> None:
    torch.manual_seed(0)
    base = encoder()
    x = torch.randn(3, 5, 16)
    results = []
    for options in (None, {"ops": True}, {"escalate": True}):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if options is None:
            for _ in range(3):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        else:
            with graddebug.watch(model, **options) as dbg:
                for _ in range(3):
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    dbg.step()
                    opt.step()
            assert (dbg.frame()["kind"] == "op").any() == bool(options.get("ops"))
        results.append([p.detach().clone() for p in model.parameters()])
    for watched in results[1:]:
        for a, b in zip(results[0], watched, strict=True):
            assert torch.equal(a, b)


def test_ops_change_no_layer_level_row_or_finding() -> None:
    torch.manual_seed(0)
    base, x = encoder(), torch.randn(3, 5, 16)
    frames = []
    for ops in (False, True):
        report = graddebug.check(copy.deepcopy(base), x, lambda o: o.square().sum(), ops=ops)
        layer = report.frame()[report.frame()["kind"] != "op"]
        frames.append((layer.drop(columns="depth").reset_index(drop=True),
                       report.findings()[["layer", "issue"]]))
    pd.testing.assert_frame_equal(frames[0][0], frames[1][0])
    pd.testing.assert_frame_equal(frames[0][1], frames[1][1])


# -- modes are always given back ---------------------------------------------------------------


def test_no_mode_is_left_after_exit_or_an_exception() -> None:
    model, x = FunctionalMLP(), torch.randn(2, 6)
    with graddebug.watch(model, ops=True):
        model(x).sum().backward()
        assert no_modes()  # popped at the end of the forward pass
    assert no_modes()

    class Boom(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            torch.tanh(x)
            raise ValueError("in forward")

    boom = nn.Sequential(nn.Linear(6, 6), Boom())
    with graddebug.watch(boom, ops=True):
        with pytest.raises(ValueError, match="in forward"):
            boom(x)
        assert no_modes()
    assert no_modes()
    with pytest.raises(RuntimeError, match="in the block"), graddebug.watch(model, ops=True):
        model(x)
        raise RuntimeError("in the block")
    assert no_modes()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_an_interrupted_forward_leaves_no_mode_after_exit() -> None:
    class Interrupt(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise KeyboardInterrupt  # skips the always_call hooks

    model = nn.Sequential(nn.Linear(3, 3), Interrupt())
    with pytest.raises(KeyboardInterrupt), graddebug.watch(model, ops=True):
        model(torch.randn(2, 3))
    assert no_modes()


def test_a_caught_interrupt_leaves_no_mode_for_the_next_forward() -> None:
    class Interrupt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.armed = True

        def forward(self, x: Tensor) -> Tensor:
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return torch.tanh(x)

    model, x = nn.Sequential(nn.Linear(3, 3), Interrupt()), torch.randn(2, 3)
    with graddebug.watch(model, ops=True) as dbg:
        with pytest.raises(KeyboardInterrupt):
            model(x)
        out = model(x)
        assert no_modes()
        out.exp().sum().backward()  # outside the forward: not an op row
        dbg.step()
    ops = dbg.frame().query("kind == 'op'")
    assert sorted(op.split("@")[0] for op in ops["tensor"]) == [
        "torch.nn.functional.linear", "torch.tanh"]


def test_a_compiled_model_trains_on_with_ops_and_a_warning() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="eager")
    # Other warnings about compiled models may come too: only this one is asserted.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with graddebug.watch(compiled, ops=True) as dbg:
            for _ in range(2):
                compiled(torch.randn(3, 4)).sum().backward()
                dbg.step()
    assert any(issubclass(w.category, GradDebugWarning) and "ops=True" in str(w.message)
               and "torch.compile" in str(w.message) for w in caught)
    assert no_modes()
    assert (dbg.frame()["kind"] == "parameter").any()
    assert dbg.findings().query("issue == 'internal_error'").empty


def test_a_bug_in_op_capture_is_an_internal_error_not_a_crash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from graddebug_torch.ops import flow

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug in op capture")

    monkeypatch.setattr(flow.ValueFlow, "follow", broken)
    model, x = FunctionalMLP(), torch.randn(2, 6)
    with pytest.warns(graddebug.GradDebugWarning, match="internal error"), \
            graddebug.watch(model, ops=True) as dbg:
        model(x).sum().backward()
        dbg.step()
    assert no_modes()
    assert (dbg.findings()["issue"] == "internal_error").any()
    assert (dbg.frame()["kind"] == "activation").any()  # layer-level capture went on
    with pytest.raises(graddebug.GradDebugInternalError), \
            graddebug.watch(model, ops=True, strict=True):
        model(x)
    assert no_modes()


def test_ops_outside_the_watched_forward_are_not_captured() -> None:
    model, x = FunctionalMLP(), torch.randn(2, 6)
    with graddebug.watch(model, ops=True) as dbg:
        out = model(x)
        loss = torch.log1p(out.square()).sum()  # the loss: outside the forward
        loss.backward()
        dbg.step()
    ops = dbg.frame().query("kind == 'op'")
    assert not ops["tensor"].str.startswith(("torch.log1p", "torch.Tensor.square")).any()
    assert len(ops) == 8  # linear x3, gelu, tanh, mul, add, silu


def test_every_skips_op_capture_too() -> None:
    model, x = FunctionalMLP(), torch.randn(2, 6)
    with graddebug.watch(model, ops=True, every=2) as dbg:
        for _ in range(3):
            model(x).sum().backward()
            dbg.step()
    ops = dbg.frame().query("kind == 'op'")
    assert sorted(ops["step"].unique()) == [0, 2]


# -- layers=, keep=, intervene= name op sites ------------------------------------------------------


def test_intervene_and_layers_take_op_sites() -> None:
    torch.manual_seed(0)
    model, x = FunctionalMLP(), torch.randn(4, 6)
    with graddebug.watch(model, ops=True, layers=["*torch.tanh@*"],
                         intervene={"FunctionalMLP.torch.tanh@*": {"scale": 0.0}}) as dbg:
        model(x).sum().backward()
        dbg.step()
    frame = dbg.frame()
    assert frame["kind"].unique().tolist() == ["op"]
    assert frame["tensor"].str.startswith("torch.tanh@").all()
    assert frame["norm"].iloc[0] == 0.0 and frame["pre_norm"].iloc[0] > 0
    # Scaling tanh's gradient to 0 leaves fc2 only the gradient of h's skip path: none.
    assert float(model.fc2.weight.grad.abs().sum()) == 0.0


def test_op_site_names_need_ops_and_must_match() -> None:
    with pytest.raises(ConfigError, match="ops=True"):
        graddebug.watch(FunctionalMLP(), keep=["FunctionalMLP.torch.tanh@*"])
    with pytest.raises(ConfigError, match="ops=True"):
        graddebug.watch(FunctionalMLP(), layers=["*torch.tanh@*"])
    model = FunctionalMLP()
    with pytest.raises(UnknownNameError, match=r"torch\.nope"), \
            graddebug.watch(model, ops=True, keep=["*torch.nope@*"]):
        model(torch.randn(2, 6)).sum().backward()


@pytest.mark.parametrize("option", ["ops", "escalate"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_ops_and_escalate_must_be_bools(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{option}="):
        graddebug.watch(FunctionalMLP(), **{option: value})
    with pytest.raises(ConfigError, match=f"{option}="):
        graddebug.check(FunctionalMLP(), torch.randn(2, 6), summed, **{option: value})


@pytest.mark.parametrize("option", ["ops", "escalate"])
def test_ops_need_a_model(option: str) -> None:
    with pytest.raises(ConfigError, match=f"{option}=True .* no model"):
        graddebug.watch(params={"w": torch.ones(2, requires_grad=True)}, **{option: True})


def test_op_rows_of_several_ranks_combine_like_activation_rows() -> None:
    """Each rank's op rows hold its own slice of the batch, as activation rows do: their
    norms combine over ranks (parameter rows are the same gradient on every rank)."""
    from graddebug.frames import combine_ranks, record_frame
    from graddebug.records import Record

    def row(kind: str, rank: int) -> Record:
        return Record.from_sums(0, "block", "torch.log@m.py:3" if kind == "op" else "weight",
                                kind, 0, "(2,)", 2, norm=3.0, total=0.0, absmax=2.0,
                                zero_frac=0.0, nan=False, inf=False, rank=rank)

    combined = combine_ranks(record_frame([row(k, r) for k in ("op", "parameter")
                                           for r in (0, 1)]))
    by_kind = combined.set_index("kind")
    assert by_kind.loc["op", "norm"] == pytest.approx(3.0 * math.sqrt(2))
    assert by_kind.loc["op", "numel"] == 4
    assert by_kind.loc["parameter", "norm"] == 3.0


# -- the source line of findings -------------------------------------------------------------------


ORIGINS = {
    "log of a negative": (LogBlock, "nonfinite", "log-of-negative", "torch.log",
                          "first operation whose output held NaN in the forward pass"),
    "sqrt at 0": (SqrtBlock, "nonfinite", "sqrt-at-zero", "torch.sqrt",
                  "the backward of torch.sqrt in 'block'"),
    "detach in a block": (DetachBlock, "cut_graph", "detach-in-block", "torch.Tensor.detach",
                          ".detach()"),
    "no_grad around one line": (NoGradBlock, "cut_graph", "under-no-grad", "torch.Tensor.mul",
                                "torch.no_grad()"),
    "numpy round trip": (NumpyBlock, "cut_graph", "numpy-round-trip", "torch.Tensor.detach",
                         ".numpy()"),
}


def findings_of(block: Callable[[], nn.Module], steps: int = 1, **options: Any) -> pd.DataFrame:
    torch.manual_seed(0)
    report = graddebug.check(Net(block()), torch.randn(3, 4), summed, steps=steps, **options)
    return report.findings()


@pytest.mark.parametrize("case", ORIGINS)
def test_findings_name_the_op_and_its_line(case: str) -> None:
    block, issue, marker, op, words = ORIGINS[case]
    findings = findings_of(block, ops=True)
    rows = findings[findings["issue"] == issue]
    assert not rows.empty
    assert (rows["source"].str.endswith(line_of(marker))).all(), rows["source"].tolist()
    first = rows.iloc[0]
    assert first["message"].count(op) >= 1 and words in first["message"], first["message"]
    assert first["layer"] in ("block", "block.fc2")
    if issue == "nonfinite":
        assert first["tensor"].startswith(f"{op}@") and first["layer"] == "block"


def test_ops_in_parameter_free_modules_keep_their_line() -> None:
    """Modules without parameters of their own run under graddebug's value-flow mode too;
    the op's line is still the user's."""

    class Log(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.log(x - 10.0)  # log-in-parameter-free

    findings = findings_of(Log, ops=True)
    (row,) = findings.query("issue == 'nonfinite'").itertuples()
    assert row.layer == "block" and row.source == shown(int(line_of(
        "log-in-parameter-free").rpartition(":")[2]))


class Masked(nn.Module):
    """Causal attention scores filled with -inf before the softmax: -inf by design."""

    def __init__(self, poison: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.poison = poison

    def forward(self, x: Tensor) -> Tensor:
        scores = x @ x.transpose(0, 1)
        causal = torch.ones(len(x), len(x), dtype=torch.bool).triu(1)
        weights = scores.masked_fill(causal, float("-inf")).softmax(-1)
        h = self.fc(weights @ x)
        if self.poison:
            h = torch.log(h.abs().neg() - 1.0)  # poison-after-mask
        return h


def test_minus_inf_masks_are_no_finding_with_ops() -> None:
    torch.manual_seed(0)
    report = graddebug.check(Net(Masked()), torch.randn(3, 4), summed, steps=2, ops=True)
    assert report.findings().query("issue == 'nonfinite'").empty
    assert not report.events()["event"].str.startswith("op_").any()  # nothing to pin down


def test_the_nan_after_a_mask_is_named_not_the_mask() -> None:
    findings = findings_of(lambda: Masked(poison=True), ops=True)
    (row,) = findings.query("issue == 'nonfinite'").itertuples()
    assert row.tensor.startswith("torch.log@") and row.source.endswith(
        line_of("poison-after-mask"))


def test_cut_messages_name_both_sides() -> None:
    findings = findings_of(DetachBlock, ops=True)
    boundary = findings[findings["layer"] == "block.fc2"].iloc[0]["message"]
    tanh = next(i for i, t in enumerate(SOURCE) if "h = torch.tanh(h)" in t) + 1
    fc2 = next(i for i, t in enumerate(SOURCE) if "return self.fc2(h * 2.0)" in t) + 1
    # Upstream, the op whose output was cut; downstream, the first op that used the cut values
    # where a gradient was needed (h * 2.0 needs none: fc2's weight brings it back).
    assert (f"between torch.tanh in 'block' ({shown(tanh)}) and "
            f"torch.nn.functional.linear in 'block.fc2' ({shown(fc2)})" in boundary), boundary


@pytest.mark.parametrize("case", ORIGINS)
def test_without_ops_findings_are_unchanged_and_have_no_source(case: str) -> None:
    block, issue, *_ = ORIGINS[case]
    plain, pinned = findings_of(block), findings_of(block, ops=True)
    assert (plain["source"] == "").all()
    # A cut keeps its layers and gains a line; a NaN is named at the op, in the module it ran
    # in, which the layer-level finding may only see downstream (a module with no rows).
    keys = ["step", "layer", "issue"] if issue == "cut_graph" else ["step", "issue"]
    assert plain[keys].values.tolist() == pinned[keys].values.tolist()
    assert "Op-level" not in " ".join(plain["message"])
    assert (pinned.loc[pinned["issue"] == issue, "source"] != "").all()


@pytest.mark.parametrize("case", ORIGINS)
def test_escalation_gets_the_line_from_the_next_recorded_step(case: str) -> None:
    block, issue, marker, *_ = ORIGINS[case]
    torch.manual_seed(0)
    model, x = Net(block()), torch.randn(3, 4)
    with graddebug.watch(model, escalate=True, every=2) as dbg:
        for _ in range(6):
            model.zero_grad()
            model(x).sum().backward()
            dbg.step()
    frame = dbg.frame()
    # Op-level capture ran in the next recorded step (2) only, not in the first or later ones.
    assert sorted(frame.loc[frame["kind"] == "op", "step"].unique()) == [2]
    rows = dbg.findings()
    rows = rows[rows["issue"] == issue]
    assert rows.iloc[0]["step"] == 0
    assert rows.iloc[0]["source"].endswith(line_of(marker))


def test_no_escalation_without_a_finding() -> None:
    torch.manual_seed(0)
    model = FunctionalMLP()
    with graddebug.watch(model, escalate=True) as dbg:
        for _ in range(3):
            model(torch.randn(4, 6)).square().mean().backward()
            dbg.step()
    assert (dbg.frame()["kind"] != "op").all()
    assert not any(m._forward_pre_hooks for m in model.modules() if m is not model)


def test_escalation_after_a_nan_update_names_no_wrong_line() -> None:
    """After an optimizer applied a NaN update, the first op to go non-finite is the first to
    read the weights: the layer-level origin changed, and the finding keeps no source line."""
    torch.manual_seed(0)
    model, x = Net(SqrtBlock()), torch.randn(3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddebug.watch(model, escalate=True) as dbg:
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            dbg.step()
            opt.step()
    assert (dbg.frame()["kind"] == "op").any()
    nonfinite = dbg.findings().query("issue == 'nonfinite'").iloc[0]
    assert nonfinite["source"] == "" and "Op-level" not in nonfinite["message"]


def test_a_healthy_model_gives_no_finding_with_ops() -> None:
    torch.manual_seed(0)
    for build, batch, loss_fn in CASES.values():
        report = graddebug.check(build(), batch(), loss_fn, steps=2, ops=True)
        assert report.findings().query("issue in ('nonfinite', 'cut_graph')").empty


def test_stop_gradient_tricks_are_no_cut_finding() -> None:
    """A straight-through estimator detaches on purpose; its op_cut event explains nothing
    and raises nothing."""

    class StraightThrough(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            h = self.fc(x)
            return h + (torch.round(h) - h).detach()

    report = graddebug.check(Net(StraightThrough()), torch.randn(3, 4), summed, ops=True)
    assert report.findings().query("issue == 'cut_graph'").empty
    assert (report.events()["event"] == "op_cut").any()


def test_source_survives_save_and_load(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    findings = findings_of(DetachBlock, ops=True)
    torch.manual_seed(0)
    report = graddebug.check(Net(DetachBlock()), torch.randn(3, 4), summed, ops=True)
    report.save(tmp_path / "run")
    loaded = graddebug.load(tmp_path / "run")
    assert loaded.findings()["source"].tolist() == findings["source"].tolist()
    assert loaded.events()["source"].tolist() == report.events()["source"].tolist()
    assert (loaded.rediagnose()["source"] == findings["source"]).all()
    assert math.isfinite(loaded.frame().query("kind == 'op'")["norm"].sum())
