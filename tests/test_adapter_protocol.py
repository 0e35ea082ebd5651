"""The adapter protocol, through the toy framework of ``examples/adapter/toygrad.py``.

The toy adapter's rows are checked against gradients derived by hand (the chain rule written
out in numpy) and by finite differences; the capability protocols are checked to accept a class
with all their methods and to refuse it with any one missing.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd
import pytest

import graddebug
import graddebug.adapter as protocol
from graddebug.adapter import (
    Adapter,
    CompiledTiers,
    Distributed,
    GradientSource,
    ReadAhead,
    SessionGraphs,
    StepClock,
    Training,
    TrainingCallback,
    TrainStep,
)
from graddebug.adapter.capabilities import CAPABILITIES as declared
from graddebug.errors import (
    ConfigError,
    GradDebugInternalError,
    GradDebugWarning,
    MaskShapeError,
    UnknownNameError,
)
from graddebug.plugins import new_plugin_manager

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "adapter" / "toygrad.py"


def _load() -> ModuleType:
    """The example, imported under the name its hook's docstring uses."""
    spec = importlib.util.spec_from_file_location("toygrad", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the example registers itself by this name
    spec.loader.exec_module(module)
    return module


tg = _load()

# The frame's columns as the README's DataFrame contract lists them, then `rank`.
CONTRACT = ["step", "layer", "tensor", "kind", "depth", "shape", "numel", "norm", "mean", "std",
            "absmax", "zero_frac", "nan", "inf", "rank", "weight_norm", "update_norm",
            "clipped_norm"]

CAPABILITIES = [StepClock, GradientSource, Distributed, CompiledTiers, ReadAhead, TrainStep,
                TrainingCallback, SessionGraphs]


def watch(model: Any = None, **options: Any) -> graddebug.Watcher:
    """``graddebug.watch`` with a plugin manager that knows toygrad and nothing installed."""
    pm = new_plugin_manager(entry_points=False)
    pm.register(tg)
    return graddebug.watch(model, plugin_manager=pm, **options)


def small_model(seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    return tg.Sequential(tg.Linear(3, 5, rng), tg.Act("tanh"), tg.Linear(5, 2, rng))


def batch(seed: int = 1) -> tuple[Any, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tg.Var(rng.normal(size=(8, 3))), rng.normal(size=(8, 2))


def train_steps(dbg: graddebug.Watcher, model: Any, x: Any, y: np.ndarray, steps: int) -> None:
    """``steps`` backward passes of the MSE loss on one batch, each closed by ``dbg.step()``."""
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        tg.mse(model(x), y).backward()
        dbg.step()


def by_hand(model: Any, x: np.ndarray, y: np.ndarray, clip_a1: float | None = None
            ) -> dict[str, np.ndarray]:
    """Every gradient of ``mse(Linear -> tanh -> Linear)``, written out: for h = a @ W + b,
    dL/dW = a.T @ dL/dh, dL/db = sum over the batch of dL/dh, dL/da = dL/dh @ W.T. With
    ``clip_a1`` the gradient at the tanh output is clipped to that norm before it flows on."""
    w1, b1 = model.layers[0].weight.value, model.layers[0].bias.value
    w2, b2 = model.layers[2].weight.value, model.layers[2].bias.value
    h1 = x @ w1 + b1
    a1 = np.tanh(h1)
    h2 = a1 @ w2 + b2
    g_h2 = 2.0 * (h2 - y) / h2.size
    g_a1 = g_h2 @ w2.T
    g_a1_pre = g_a1
    if clip_a1 is not None:
        g_a1 = g_a1 * min(1.0, clip_a1 / np.linalg.norm(g_a1))
    g_h1 = g_a1 * (1.0 - a1 ** 2)
    return {"0": g_h1, "1": g_a1, "1.pre": g_a1_pre, "2": g_h2, "0.weight": x.T @ g_h1,
            "0.bias": g_h1.sum(axis=0), "2.weight": a1.T @ g_h2, "2.bias": g_h2.sum(axis=0)}


def row(frame: pd.DataFrame, layer: str, tensor: str = "output", step: int = 0) -> pd.Series:
    rows = frame[(frame["step"] == step) & (frame["layer"] == layer) & (frame["tensor"] == tensor)]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def train_step(model: Any, opt: Any, x: Any, y: np.ndarray) -> None:
    opt.zero_grad()
    tg.mse(model(x), y).backward()
    opt.step()


# -- the rows against independent references -----------------------------------------------

def test_rows_equal_the_gradients_derived_by_hand() -> None:
    model = small_model()
    x, y = batch()
    expected = by_hand(model, x.value, y)
    with watch(model) as dbg:
        tg.mse(model(x), y).backward()
        dbg.step()
    frame = dbg.frame()
    for layer in ("0", "1", "2"):
        g, r = expected[layer], row(frame, layer)
        assert r["norm"] == pytest.approx(np.linalg.norm(g), rel=1e-12)
        assert r["mean"] == pytest.approx(g.mean(), rel=1e-9, abs=1e-15)
        assert r["std"] == pytest.approx(g.std(), rel=1e-9)
        assert r["absmax"] == pytest.approx(np.abs(g).max(), rel=1e-12)  # step 0 is full
        assert r["zero_frac"] == 0.0
        assert r["shape"] == str(g.shape) and r["numel"] == g.size
        assert not r["nan"] and not r["inf"]
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        layer, tensor = name.split(".")
        assert row(frame, layer, tensor)["norm"] == pytest.approx(
            np.linalg.norm(expected[name]), rel=1e-12)


def test_parameter_norm_equals_finite_differences() -> None:
    model = small_model()
    x, y = batch()
    w1 = model.layers[0].weight
    with watch(model) as dbg:
        tg.mse(model(x), y).backward()
        dbg.step()

    def loss(w: np.ndarray) -> float:
        a1 = np.tanh(x.value @ w + model.layers[0].bias.value)
        h2 = a1 @ model.layers[2].weight.value + model.layers[2].bias.value
        return float(((h2 - y) ** 2).mean())

    eps, fd = 1e-6, np.zeros_like(w1.value)
    for index in np.ndindex(*w1.shape):
        step = np.zeros_like(w1.value)
        step[index] = eps
        fd[index] = (loss(w1.value + step) - loss(w1.value - step)) / (2 * eps)
    assert row(dbg.frame(), "0", "weight")["norm"] == pytest.approx(np.linalg.norm(fd), rel=1e-7)


def test_frame_follows_the_contract() -> None:
    model = small_model()
    x, y = batch()
    with watch(model) as dbg:
        train_steps(dbg, model, x, y, 3)
    frame = dbg.frame()
    assert list(frame.columns) == CONTRACT  # no pre_norm: no intervention acted
    assert frame["step"].dtype == np.int64 and frame["depth"].dtype == np.int64
    assert frame["norm"].dtype == np.float64 and frame["nan"].dtype == bool
    assert not frame.duplicated(["step", "layer", "tensor"]).any()
    assert sorted(set(frame["step"])) == [0, 1, 2]
    acts = frame[frame["kind"] == "activation"]
    params = frame[frame["kind"] == "parameter"]
    assert len(acts) + len(params) == len(frame)
    assert set(acts["tensor"]) == {"output"}
    assert set(params["tensor"]) == {"weight", "bias"}
    # forward order: Linear "0", tanh "1", Linear "2"; a parameter has its owner's depth
    assert dict(zip(acts["layer"], acts["depth"], strict=False)) == {"0": 0, "1": 1, "2": 2}
    assert dict(zip(params["layer"], params["depth"], strict=False)) == {"0": 0, "2": 2}
    assert set(frame["rank"]) == {0}


def test_full_tier_on_step_zero_sentinel_only_after() -> None:
    model = small_model()
    x, y = batch()
    with watch(model) as dbg:
        train_steps(dbg, model, x, y, 2)
    acts = dbg.frame().query("kind == 'activation'")
    first, second = acts[acts["step"] == 0], acts[acts["step"] == 1]
    assert first["absmax"].notna().all() and first["zero_frac"].notna().all()
    assert second["absmax"].isna().all() and second["zero_frac"].isna().all()
    assert second["norm"].notna().all() and second["std"].notna().all()


# -- diagnoses ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_tanh_net_has_no_findings(seed: int) -> None:
    dbg = tg.main(steps=20, seed=seed)
    assert len(dbg.frame()) == 20 * 11
    assert dbg.findings().empty, dbg.findings()["message"].tolist()


def test_deep_sigmoid_stack_is_flagged_vanishing() -> None:
    rng = np.random.default_rng(0)
    layers: list[Any] = []
    for _ in range(20):
        layers += [tg.Linear(16, 16, rng, std=0.05), tg.Act("sigmoid")]
    model = tg.Sequential(*layers, tg.Linear(16, 1, rng))
    opt = tg.SGD(model.parameters(), lr=0.1)
    x, y = tg.Var(rng.normal(size=(32, 16))), rng.normal(size=(32, 1))
    with watch(model, optimizer=opt) as dbg:
        for _ in range(3):
            train_step(model, opt, x, y)
    found = dbg.findings()
    vanishing = found[found["issue"] == "vanishing"]
    assert not vanishing.empty, found
    # the gradient shrinks towards the input: the layer named lies in the first half
    depth = {name: i for i, (name, _) in enumerate(model.named_modules()) if name}
    assert all(depth[layer] <= len(depth) // 2 for layer in vanishing["layer"]), vanishing


# -- interventions --------------------------------------------------------------------------

def test_intervene_clips_a_layer_output_and_the_clipped_gradient_flows_on() -> None:
    model = small_model()
    x, y = batch()
    free = by_hand(model, x.value, y)
    c = 0.5 * float(np.linalg.norm(free["1"]))
    expected = by_hand(model, x.value, y, clip_a1=c)
    with watch(model, intervene={"1": {"clip_norm": c}}) as dbg:
        tg.mse(model(x), y).backward()
        grads = {n: p.grad.copy() for n, p in model.named_parameters()}
        dbg.step()
    frame = dbg.frame()
    clipped = row(frame, "1")
    assert clipped["norm"] <= c * (1 + 1e-12)
    assert clipped["pre_norm"] == pytest.approx(np.linalg.norm(free["1"]), rel=1e-12)
    assert math.isnan(row(frame, "0")["pre_norm"])  # no intervention acted there
    # downstream in backward order: the clipped gradient, through tanh and the first Linear
    assert row(frame, "0")["norm"] == pytest.approx(np.linalg.norm(expected["0"]), rel=1e-12)
    np.testing.assert_allclose(grads["0.weight"], expected["0.weight"], rtol=1e-12)
    np.testing.assert_allclose(grads["0.bias"], expected["0.bias"], rtol=1e-12, atol=1e-18)
    # upstream of the clip nothing changed
    np.testing.assert_allclose(grads["2.weight"], free["2.weight"], rtol=1e-12)


def test_tap_clip_norm_without_a_model() -> None:
    rng = np.random.default_rng(3)
    w = tg.Var(rng.normal(size=(4, 3)), requires_grad=True)
    x = rng.normal(size=(6, 4))
    target = rng.normal(size=(6, 3))
    h_value = x @ w.value
    g = 2.0 * (h_value - target) / h_value.size  # dL/dh of the mse
    c = 0.25 * float(np.linalg.norm(g))
    with watch() as dbg:
        h = dbg.tap(tg.Var(x) @ w, "h", clip_norm=c)
        tg.mse(h, target).backward()
        dbg.step()
    r = row(dbg.frame(), "h")
    assert r["norm"] == pytest.approx(c, rel=1e-12)
    assert r["pre_norm"] == pytest.approx(np.linalg.norm(g), rel=1e-12)
    np.testing.assert_allclose(w.grad, x.T @ (g * c / np.linalg.norm(g)), rtol=1e-12)


def test_tap_applies_mask_scale_clip_value_clip_norm_in_that_order() -> None:
    rng = np.random.default_rng(4)
    w = tg.Var(rng.normal(size=(4, 3)), requires_grad=True)
    x = rng.normal(size=(6, 4))
    target = rng.normal(size=(6, 3))
    mask = np.array([[1, 0, 1]], dtype=bool)
    g = 2.0 * (x @ w.value - target) / target.size
    scaled = np.where(mask, g, 0.0) * 3.0
    value = float(np.median(np.abs(scaled[:, [0, 2]])))  # clips half of the live entries
    clipped = np.clip(scaled, -value, value)
    norm = 0.5 * float(np.linalg.norm(clipped))
    out = clipped * norm / np.linalg.norm(clipped)
    # another order gives another gradient, so the check below can tell them apart
    other = np.clip(np.where(mask, g, 0.0), -value, value) * 3.0
    assert not np.allclose(other * norm / np.linalg.norm(other), out)
    with watch() as dbg:
        h = dbg.tap(tg.Var(x) @ w, "h", mask=mask, scale=3.0, clip_value=value, clip_norm=norm)
        tg.mse(h, target).backward()
        dbg.step()
    np.testing.assert_allclose(w.grad, x.T @ out, rtol=1e-12)
    r = row(dbg.frame(), "h")
    assert r["norm"] == pytest.approx(norm, rel=1e-12)
    assert r["pre_norm"] == pytest.approx(np.linalg.norm(g), rel=1e-12)


def test_interventions_act_on_the_steps_every_skips() -> None:
    model = small_model()
    x, y = batch()
    free = by_hand(model, x.value, y)
    c = 0.5 * float(np.linalg.norm(free["1"]))
    with watch(model, every=2, intervene={"1": {"clip_norm": c}}) as dbg:
        train_steps(dbg, model, x, y, 2)
        assert dbg.step_index == 2
        np.testing.assert_allclose(model.layers[0].weight.grad,
                                   by_hand(model, x.value, y, clip_a1=c)["0.weight"], rtol=1e-12)
    assert sorted(set(dbg.frame()["step"])) == [0]  # step 1 was not recorded


def test_params_are_recorded_as_parameters_under_their_key() -> None:
    rng = np.random.default_rng(6)
    w = tg.Var(rng.normal(size=(4, 3)), requires_grad=True)
    x, target = rng.normal(size=(6, 4)), rng.normal(size=(6, 3))
    with watch(params={"W": w}) as dbg:
        tg.mse(tg.Var(x) @ w, target).backward()
        dbg.step()
    r = row(dbg.frame(), "W", "W")
    assert r["kind"] == "parameter"
    g = x.T @ (2.0 * (x @ w.value - target) / target.size)
    assert r["norm"] == pytest.approx(np.linalg.norm(g), rel=1e-12)


def test_a_wrong_number_of_gradients_raises() -> None:
    model = small_model()
    x, y = batch()
    with pytest.raises(graddebug.GradientCountError, match="3 gradients"), watch(model) as dbg:
        tg.mse(model(x), y).backward()
        dbg.step([p.grad for p in model.parameters()][:3])


def test_a_mask_that_does_not_fit_raises_at_the_first_forward() -> None:
    model = small_model()
    x, _ = batch()
    with pytest.raises(MaskShapeError, match="'1'"), \
            watch(model, intervene={"1": {"mask": np.ones(3)}}):
        model(x)


def test_a_new_mask_on_a_tap_is_checked_again() -> None:
    rng = np.random.default_rng(3)
    w = tg.Var(rng.normal(size=(3, 4)), requires_grad=True)
    x = rng.normal(size=(2, 3))
    with watch() as dbg:
        dbg.tap(tg.Var(x) @ w, "h", mask=np.ones((1, 4), dtype=bool))
        with pytest.raises(MaskShapeError, match="'h'"):
            dbg.tap(tg.Var(x) @ w, "h", mask=np.ones((5,), dtype=bool))


def test_unknown_names_raise() -> None:
    with pytest.raises(UnknownNameError, match="nope"), watch(small_model(), layers=["nope"]):
        pass
    with pytest.raises(UnknownNameError, match="nope"), \
            watch(small_model(), intervene={"nope": {"scale": 2.0}}):
        pass


# -- steps, observer effect, clean-up ------------------------------------------------------

def test_optimizer_closes_one_step_per_opt_step() -> None:
    model = small_model()
    x, y = batch()
    opt = tg.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=opt) as dbg:
        for _ in range(3):
            train_step(model, opt, x, y)
        assert dbg.step_index == 3
    assert sorted(set(dbg.frame()["step"])) == [0, 1, 2]
    with watch(model) as plain:  # without optimizer= the steps stay open
        train_step(model, opt, x, y)
        assert plain.step_index == 0


def test_weights_are_bitwise_identical_with_and_without_watch() -> None:
    def trained(watched: bool) -> list[bytes]:
        model = small_model(seed=7)
        x, y = batch(seed=8)
        opt = tg.SGD(model.parameters(), lr=0.2)
        if watched:
            with watch(model, optimizer=opt, full_stats_every=1):
                for _ in range(6):
                    train_step(model, opt, x, y)
        else:
            for _ in range(6):
                train_step(model, opt, x, y)
        return [p.value.tobytes() for p in model.parameters()]

    plain = trained(False)
    assert plain != [p.value.tobytes() for p in small_model(seed=7).parameters()]  # it trained
    assert trained(True) == plain


def test_detach_removes_every_hook_and_restores_training() -> None:
    model = small_model()
    x, y = batch()
    opt = tg.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=opt) as dbg:
        assert all(m._forward_hooks for _, m in model.named_modules() if not m.children())
        model.train(False)
        train_step(model, opt, x, y)
    assert model.training
    assert not any(m._forward_hooks for _, m in model.named_modules())
    assert not any(p._hooks for p in model.parameters())
    assert not opt._post_hooks
    train_step(model, opt, x, y)  # after the block: nothing records, nothing raises
    assert sorted(set(dbg.frame()["step"])) == [0]


# -- fail-open ------------------------------------------------------------------------------

def test_a_bug_in_a_hook_is_an_internal_error_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    reference = small_model(seed=5)
    x, y = batch()
    ref_opt = tg.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        train_step(reference, ref_opt, x, y)

    monkeypatch.setattr(tg._Capture, "add", broken)
    model = small_model(seed=5)
    opt = tg.SGD(model.parameters(), lr=0.1)
    with pytest.warns(GradDebugWarning, match="boom"), watch(model, optimizer=opt) as dbg:
        for _ in range(2):
            train_step(model, opt, x, y)
        assert dbg.step_index == 2  # training and the step clock went on
    found = dbg.findings()
    errors = found[found["issue"] == "internal_error"]
    assert not errors.empty
    assert set(errors["layer"]) <= {"0", "1", "2"}
    assert "boom" in errors["message"].iloc[0]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.value.tobytes() == q.value.tobytes()  # the gradient flowed on unaltered


def test_strict_raises_a_bug_in_a_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(tg._Capture, "add", broken)
    model = small_model()
    x, y = batch()
    with pytest.raises(GradDebugInternalError, match="boom"), watch(model, strict=True):
        tg.mse(model(x), y).backward()


class Subscriber:
    """A run subscriber that raises what it is given at each recorded step."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    @graddebug.hookimpl
    def graddebug_step_recorded(self, watcher: Any, step: int, result: Any) -> None:
        raise self.error


@pytest.mark.parametrize("where", ["subscriber", "live findings"])
def test_one_fail_open_rule_in_the_core(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's guards (here a plugin subscriber and the live diagnoses) follow the hooks'
    rule: a bug becomes an internal_error finding, a GradDebugError propagates."""
    from graddebug.capture.live import LiveFindings

    def run(error: Exception) -> graddebug.Watcher:
        pm = new_plugin_manager(entry_points=False)
        pm.register(tg)
        if where == "subscriber":
            pm.register(Subscriber(error))
        else:
            def broken(*args: Any, **kwargs: Any) -> None:
                raise error
            monkeypatch.setattr(LiveFindings, "observe", broken)
        model = small_model()
        x, y = batch()
        with graddebug.watch(model, plugin_manager=pm) as dbg:
            tg.mse(model(x), y).backward()
            dbg.step()
        return dbg

    with pytest.warns(GradDebugWarning, match="boom"):
        found = run(RuntimeError("boom")).findings()
    assert list(found.loc[found["issue"] == "internal_error", "message"].str.contains("boom")) \
        == [True]
    with pytest.raises(ConfigError, match="a user's mistake"):
        run(ConfigError("a user's mistake"))


def test_the_core_catches_exceptions_only_through_the_one_guard() -> None:
    """No ``except Exception`` in the Watcher's modules: FailOpen is the one guard."""
    capture = Path(graddebug.__file__).parent / "capture"
    offenders = [f"{path.name}:{i}" for path in sorted(capture.glob("*.py"))
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if "except Exception" in line and "class FailOpen" not in line]
    assert offenders == []


# -- the protocol and its capabilities ------------------------------------------------------

def _members(proto: type) -> list[str]:
    return sorted(n for n, v in vars(proto).items() if not n.startswith("_") and callable(v))


def _stub(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def test_capability_list_is_every_runtime_protocol_of_the_package() -> None:
    runtime = {name for name in protocol.__all__
               if getattr(getattr(protocol, name), "_is_runtime_protocol", False)}
    # Training is the two training capabilities in one, kept for older code.
    assert runtime - {"CallbackContext", "Training"} == {c.__name__ for c in CAPABILITIES}
    assert list(declared) == CAPABILITIES


def test_training_is_still_both_training_capabilities() -> None:
    both = type("Both", (), {"train_step": _stub, "callback": _stub})
    one = type("One", (), {"train_step": _stub})
    assert isinstance(both(), Training)
    assert not isinstance(one(), Training)
    assert isinstance(one(), TrainStep) and not isinstance(one(), TrainingCallback)


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: c.__name__)
def test_each_capability_can_fail(capability: type) -> None:
    assert _members(capability)
    assert not isinstance(object(), capability)


@pytest.mark.parametrize(("capability", "method"),
                         [(c, m) for c in CAPABILITIES for m in _members(c)],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_capability_needs_every_method(capability: type, method: str) -> None:
    full = type("Full", (), dict.fromkeys(_members(capability), _stub))
    partial = type("Partial", (), {m: _stub for m in _members(capability) if m != method})
    assert isinstance(full(), capability)
    assert not isinstance(partial(), capability)


ADAPTER_METHODS = {"attach", "detach", "tap", "has_pending", "close_step", "matched_names",
                   "known_names"}


def test_toy_adapter_satisfies_adapter_and_only_step_clock() -> None:
    assert set(_members(Adapter)) == ADAPTER_METHODS
    assert "name" in Adapter.__annotations__
    with watch(small_model()) as dbg:
        adapter = dbg.adapter
    assert isinstance(adapter, tg.ToyAdapter)
    assert isinstance(adapter.name, str) and adapter.name
    for method in ADAPTER_METHODS:
        assert callable(getattr(adapter, method)), method
    assert isinstance(adapter, StepClock)
    assert [c.__name__ for c in CAPABILITIES if isinstance(adapter, c)] == ["StepClock"]


class ProtocolOnly:
    """The toy adapter seen through the Adapter protocol alone: no capability."""

    name = "protocol-only"

    def __init__(self, context: Any, model: Any, params: Any, options: Any) -> None:
        self._inner = tg.ToyAdapter(context, model, params, options)

    def attach(self) -> None:
        self._inner.attach()

    def detach(self) -> None:
        self._inner.detach()

    def tap(self, tensor: Any, name: str, intervention: Any) -> Any:
        return self._inner.tap(tensor, name, intervention)

    def has_pending(self) -> bool:
        return bool(self._inner.has_pending())

    def close_step(self, step: int, grads: Any, record: bool) -> Any:
        return self._inner.close_step(step, grads, record)

    def matched_names(self) -> set[str]:
        return set(self._inner.matched_names())

    def known_names(self) -> list[str]:
        return list(self._inner.known_names())


class ProtocolOnlyPlugin:
    @graddebug.hookimpl
    def graddebug_adapter(self, target: object) -> Any:
        return ProtocolOnly if isinstance(target, tg.Module) else None


def test_optimizer_needs_a_step_clock_or_a_gradient_source() -> None:
    pm = new_plugin_manager(entry_points=False)
    pm.register(ProtocolOnlyPlugin())
    model = small_model()
    opt = tg.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="cannot be followed"), \
            graddebug.watch(model, optimizer=opt, plugin_manager=pm):
        pass
    assert not any(m._forward_hooks for _, m in model.named_modules())  # detached again
    x, y = batch()
    with graddebug.watch(model, plugin_manager=pm) as dbg:  # the protocol alone records
        tg.mse(model(x), y).backward()
        dbg.step()
    assert row(dbg.frame(), "0", "weight")["norm"] == pytest.approx(
        np.linalg.norm(by_hand(model, x.value, y)["0.weight"]), rel=1e-12)


def test_calls_of_missing_capabilities_are_config_errors() -> None:
    with watch(small_model()) as dbg:
        for call in (dbg.fetches, dbg.session_hook, dbg.callback):
            with pytest.raises(ConfigError):
                call()
        with pytest.raises(ConfigError):
            dbg.train_step(batch()[0], (), tg.mse)
