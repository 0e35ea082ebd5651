"""Small gradients staged and reduced in one batched pass give the same statistics as the
per-hook reductions that larger gradients get."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import ClassVar

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
import graddebug_torch.params as torch_params  # noqa: E402
from graddebug_torch.staging import SmallGrads  # noqa: E402
from torch_models import ResCNN  # noqa: E402


class _Twice(nn.Module):
    """One Linear called twice (its rows pool both calls), a ReLU with dead units, and a
    tap whose gradient turns NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.relu = nn.ReLU()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.relu(self.fc(self.relu(self.fc(x)))))


def _run(model: nn.Module, x: torch.Tensor, nan: bool = False) -> pd.DataFrame:
    with graddebug.watch(model, full_stats_every=1) as dbg:  # every step, both paths
        for _ in range(2):
            out = model(x)
            if nan:
                h = dbg.tap(out * 1.0, "h")
                out = torch.sqrt(h - h)  # sqrt at 0: inf * 0 = NaN in backward
            out.sum().backward()
            dbg.step()
            model.zero_grad()
    return dbg.frame()


def _unstaged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SmallGrads, "fits", staticmethod(lambda grad: False))
    monkeypatch.setattr(torch_params, "SMALL_NUMEL", -1)


@pytest.mark.parametrize("case", ["cnn", "twice", "nan"])
def test_staged_statistics_equal_per_hook_statistics(case, monkeypatch):
    torch.manual_seed(0)
    if case == "cnn":
        model, x = ResCNN(channels=4), torch.randn(2, 3, 8, 8)
    else:
        model, x = _Twice(), torch.randn(3, 6)
    staged = _run(copy.deepcopy(model), x, nan=case == "nan")
    _unstaged(monkeypatch)
    direct = _run(copy.deepcopy(model), x, nan=case == "nan")
    assert len(staged) == len(direct) > 0
    pd.testing.assert_frame_equal(staged.drop(columns=["norm", "mean", "std", "absmax"]),
                                  direct.drop(columns=["norm", "mean", "std", "absmax"]))
    for column in ("norm", "mean", "std", "absmax"):
        np.testing.assert_allclose(staged[column], direct[column], rtol=1e-5, atol=1e-7,
                                   equal_nan=True)
    if case == "twice":
        fc = staged.query("layer == 'fc' and kind == 'activation'")
        assert (fc["numel"] == 2 * 3 * 6).all()  # both calls pooled into one row a step
    if case == "nan":
        assert staged.query("layer == 'h'")["nan"].all()


def test_staged_norm_matches_an_independent_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    x = torch.randn(3, 4)
    with graddebug.watch(model) as dbg:
        model(x).pow(2).sum().backward()
        dbg.step()
    h = model[0](x)
    (dh,) = torch.autograd.grad(model[2](model[1](h)).pow(2).sum(), h)
    row = dbg.frame().query("layer == '0' and kind == 'activation'")
    assert row["norm"].item() == pytest.approx(dh.norm().item(), rel=1e-6)
    assert row["absmax"].item() == pytest.approx(dh.abs().max().item(), rel=1e-6)
    assert row["mean"].item() == pytest.approx(dh.mean().item(), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("change", ["cast", "reshaped"])
def test_parameter_norms_hold_after_a_parameter_changes_under_watch(change):
    """Small parameters of one shape are measured in one batched pass: a parameter cast or
    given data of another shape after ``watch()`` grouped them must still be measured right
    (a group that no longer stacks is measured one gradient at a time)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    x = torch.randn(5, 6)
    with graddebug.watch(model, outputs=False) as dbg:  # the loop below calls no module
        if change == "cast":
            model[1].double()  # the weights' group now holds float32 and float64 gradients
        else:
            model[2].weight.data = torch.randn(36)  # flat: its group no longer stacks
        h = x
        for layer in model:
            h = nn.functional.linear(h.to(layer.weight.dtype), layer.weight.reshape(6, 6),
                                     layer.bias)
        loss = h.float().pow(2).sum()
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
        dbg.step()
    rows = dbg.frame().query("kind == 'parameter'").set_index(["layer", "tensor"])
    names = [name.rsplit(".", 1) for name, _ in model.named_parameters()]
    for (layer, tensor), grad in zip(names, grads, strict=True):
        row = rows.loc[(layer, tensor)]
        assert row["norm"] == pytest.approx(grad.double().norm().item(), rel=1e-6)
        assert row["shape"] == str(tuple(grad.shape))


def test_a_closed_step_holds_no_parameter_gradient():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5000))  # a held and a measured one
    with graddebug.watch(model) as dbg:
        model(torch.randn(2, 4)).sum().backward()
        refs = [weakref.ref(p.grad) for p in model.parameters()]
        dbg.step()
        model.zero_grad(set_to_none=True)
        gc.collect()
        assert [r() for r in refs] == [None] * len(refs)


class _Mixed(nn.Module):
    """Small outputs (staged for the forward check) between large ones (checked in place);
    ``poison`` names the layer whose forward turns one entry NaN."""

    def __init__(self, poison: str) -> None:
        super().__init__()
        self.small1 = nn.Linear(8, 8)
        self.big = nn.Linear(8, 5000)  # 4 x 5000 outputs: more than staging takes
        self.small2 = nn.Linear(5000, 8)
        self.small3 = nn.Linear(8, 1)
        self.poison = poison
        for name in ("small1", "big", "small2", "small3"):
            getattr(self, name).register_forward_hook(self._poison)

    def _poison(self, module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        if module is getattr(self, self.poison):
            output = output.clone()
            output[0, 0] = float("nan")
        return output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small3(self.small2(self.big(self.small1(x))))


@pytest.mark.parametrize("poison", ["small1", "big", "small2"])
def test_forward_check_names_the_layer_among_staged_and_unstaged_outputs(poison):
    torch.manual_seed(0)
    model = _Mixed(poison)
    with graddebug.watch(model) as dbg:
        model(torch.randn(4, 8)).sum().backward()
        dbg.step()
    events = dbg.events()
    born = events[events["event"] == "forward_nonfinite"]
    # The first layer in forward order whose output held NaN is the poisoned one.
    assert born.sort_values("depth")["layer"].iloc[0] == poison
    # The NaN flows on through every later layer, and none before it is marked.
    order = ["small1", "big", "small2", "small3"]
    assert set(born["layer"]) == set(order[order.index(poison):])
    findings = dbg.findings()
    nonfinite = findings[findings["issue"] == "nonfinite"]
    assert list(nonfinite["layer"]) == [poison]


class _GcProbe(torch.autograd.Function):
    """Identity whose backward notes whether the garbage collector was enabled."""

    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _GcProbe.seen.append(gc.isenabled())
        return grad


class _Probe(nn.Module):
    """Notes whether the collector was enabled in its forward, and in its backward."""

    forward_seen: ClassVar[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Probe.forward_seen.append(gc.isenabled())
        return _GcProbe.apply(x)


def test_collector_paused_during_a_recorded_step_and_resumed_after():
    torch.manual_seed(0)
    # The probe's backward runs after the last layer's gradient was recorded.
    model = nn.Sequential(nn.Linear(4, 4), _Probe(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    assert gc.isenabled()
    _GcProbe.seen.clear()
    _Probe.forward_seen.clear()
    with graddebug.watch(model, every=2) as dbg:
        for _ in range(2):  # step 1 is not recorded: left alone
            out = model(x)
            assert gc.isenabled()  # resumed when the forward pass returned
            out.sum().backward()
            assert gc.isenabled()  # resumed when the backward pass ended, before step()
            dbg.step()
    assert _Probe.forward_seen == [False, True]
    assert _GcProbe.seen == [False, True]
    # Unwatched, the collector is left alone.
    _GcProbe.seen.clear()
    _Probe.forward_seen.clear()
    model(x).sum().backward()
    assert _Probe.forward_seen == [True]
    assert _GcProbe.seen == [True]


def test_collector_resumed_after_a_forward_that_raised():
    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad batch")

    model = nn.Sequential(nn.Linear(4, 4), Failing())
    with graddebug.watch(model):
        with pytest.raises(ValueError, match="bad batch"):
            model(torch.randn(3, 4))
        assert gc.isenabled()


def test_collector_resumed_after_a_backward_that_raised():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    with graddebug.watch(model) as dbg:
        out = model(Boom.apply(x.requires_grad_()))
        with pytest.raises(RuntimeError, match="boom"):
            out.sum().backward()
        model(x)  # the next forward resumes it
        assert gc.isenabled()
        with pytest.raises(RuntimeError, match="boom"):
            model(Boom.apply(x)).sum().backward()
        dbg.step()  # so does closing the step
        assert gc.isenabled()
        with pytest.raises(RuntimeError, match="boom"):
            model(Boom.apply(x)).sum().backward()
    assert gc.isenabled()  # and leaving watch()


def test_collector_the_user_disabled_stays_disabled():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    gc.disable()
    try:
        with graddebug.watch(model) as dbg:
            model(torch.randn(3, 4)).sum().backward()
            dbg.step()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_hooks_of_a_closed_step_are_removed():
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 4)
    with graddebug.watch(params={"w": w}) as dbg:
        h = x @ w
        hidden = dbg.tap(h * 2.0, "doubled")
        hidden.sum().backward(retain_graph=True)
        dbg.step()
        # A second backward through the graph of the closed step: the tap's hook is gone.
        hidden.sum().backward()
        dbg.step()
    frame = dbg.frame()
    assert list(frame.query("layer == 'w'")["step"]) == [0, 1]
    assert list(frame.query("layer == 'doubled'")["step"]) == [0]
    assert not hidden._backward_hooks


class _Marked(torch.Tensor):
    """A tensor subclass: its hooks go through Tensor.register_hook."""


def test_tap_on_a_tensor_subclass_records_its_gradient():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 4)
    with graddebug.watch(params={"w": w}) as dbg:
        h = (x @ w).as_subclass(_Marked)
        tapped = dbg.tap(h, "h")
        (tapped.sin()).sum().backward()
        dbg.step()
    h_ref = x @ w.detach()
    (ref,) = torch.autograd.grad(h_ref.requires_grad_().sin().sum(), h_ref)
    row = dbg.frame().query("layer == 'h'")
    assert row["norm"].item() == pytest.approx(ref.norm().item(), rel=1e-6)
