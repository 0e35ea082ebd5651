"""The scenarios every adapter must pass, written once against :class:`drivers.Driver`.

Each scenario takes a driver and raises ``AssertionError`` where the adapter breaks the
contract. They use the public API only (``watch``, ``dbg.step``, ``dbg.frame()``,
``dbg.findings()``), so that they run unchanged in a child process (Keras on torch and JAX).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest
from drivers import BUG, Driver
from references import INTERVENTIONS, LAYERS, batch, first_layer_grads, initial_weights, numpy_loss

from graddebug.errors import GradDebugInternalError, GradDebugWarning

Scenario = Callable[[Driver], None]
SCENARIOS: dict[str, Scenario] = {}

REL = 1e-5  # float32 gradients against the framework's own, through the same kernels


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = fn
        return fn

    return register


def _norm(a: Any) -> float:
    return float(np.linalg.norm(np.asarray(a, dtype=np.float64)))


def _step(frame: pd.DataFrame, step: int, kind: str) -> pd.DataFrame:
    return frame[(frame["step"] == step) & (frame["kind"] == kind)]


def _params(driver: Driver, frame: pd.DataFrame, step: int = 0) -> dict[str, Any]:
    """The parameter rows of ``step`` by the references' keys; exactly the model's six."""
    rows = _step(frame, step, "parameter")
    by_name = {(r.layer, r.tensor): r for r in rows.itertuples()}
    assert set(by_name) == set(driver.rows().values()), sorted(by_name)
    return {key: by_name[where] for key, where in driver.rows().items()}


def _outputs(frame: pd.DataFrame, step: int = 0) -> dict[str, Any]:
    """The layer-output rows of ``step``; exactly ``l1``, ``l2``, ``l3``, in forward order."""
    rows = _step(frame, step, "activation").sort_values("depth")
    assert list(rows["layer"]) == list(LAYERS), list(rows["layer"])
    assert (rows["tensor"] == "output").all()
    return {r.layer: r for r in rows.itertuples()}


@scenario("norms")
def norms_equal_the_frameworks_own_gradients(driver: Driver) -> None:
    want = driver.reference()
    run = driver.build()
    with driver.watch(run, param_stats="full") as dbg:
        driver.train(run, dbg, 1)
    frame = dbg.frame()
    for key, row in _params(driver, frame).items():
        g = np.asarray(want[key], dtype=np.float64)
        assert row.norm == pytest.approx(_norm(g), rel=REL), key
        assert row.mean == pytest.approx(g.mean(), rel=1e-4, abs=1e-9), key
        assert row.std == pytest.approx(g.std(), rel=1e-3, abs=1e-9), key
        assert row.absmax == pytest.approx(np.abs(g).max(), rel=1e-6), key
    for name, row in _outputs(frame).items():
        assert row.norm == pytest.approx(_norm(want[name]), rel=REL), name
        assert row.numel == want[name].size, name
    assert dbg.findings().empty, dbg.findings().to_string()


def _intervention(driver: Driver, kind: str) -> None:
    spec, change = INTERVENTIONS[kind]
    want = driver.reference()
    raw = np.asarray(want["l1"], dtype=np.float64)
    changed = change(raw)
    assert not np.allclose(changed, raw)  # the intervention acts on this gradient
    by_hand = first_layer_grads(initial_weights(), batch()[0], changed)
    spec = {k: driver.native(v) if isinstance(v, np.ndarray) else v for k, v in spec.items()}
    run = driver.build()
    with driver.watch(run, intervene={"l1": spec}) as dbg:
        driver.train(run, dbg, 1)
    frame = dbg.frame()
    row = _outputs(frame)["l1"]
    assert row.pre_norm == pytest.approx(_norm(raw), rel=REL)
    assert row.norm == pytest.approx(_norm(changed), rel=REL)
    for key, prow in _params(driver, frame).items():
        # below the intervention the changed gradient flowed on; above it, nothing changed
        expected = by_hand[key] if key.startswith("l1.") else want[key]
        assert prow.norm == pytest.approx(_norm(expected), rel=REL), key
    for name in ("l2", "l3"):
        assert np.isnan(_outputs(frame)[name].pre_norm), name


for _kind in INTERVENTIONS:
    scenario(f"intervene-{_kind}")(
        lambda driver, kind=_kind: _intervention(driver, kind))


@scenario("cut")
def a_cut_is_named_at_its_layer(driver: Driver) -> None:
    run = driver.build("cut")
    with warnings.catch_warnings(), driver.watch(run) as dbg:
        # Keras's own word on the cut, when its optimizer gets no gradient for l1
        warnings.filterwarnings("ignore", "Gradients do not exist", UserWarning)
        driver.train(run, dbg, 1)
    found = dbg.findings()
    assert set(found["issue"]) == {"cut_graph"}, found.to_string()
    boundary = found[found["layer"] == "l2"]  # the layer whose input is cut
    assert len(boundary) == 1, found.to_string()
    assert "between 'l1' and 'l2'" in boundary.iloc[0]["message"], boundary.to_string()


@scenario("nan")
def a_nan_is_named_at_the_layer_that_made_it(driver: Driver) -> None:
    run = driver.build("nan")
    with driver.watch(run) as dbg:
        driver.train(run, dbg, 1)
    found = dbg.findings()
    nonfinite = found[found["issue"] == "nonfinite"]
    assert not nonfinite.empty, found.to_string()
    assert nonfinite.iloc[0]["layer"] == "l2", nonfinite.to_string()
    assert nonfinite.iloc[0]["step"] == 0


def _estimate(a: np.ndarray, sample: Any) -> float:
    """The norm of ``a`` as ``graddebug.sampling`` estimates it from ``sample``'s entries."""
    return _norm(a.ravel()[sample.indices()]) * sample.scale


@scenario("optimizer")
def weight_and_update_norms_are_those_of_the_weights(driver: Driver) -> None:
    # Every adapter reads a large tensor through the one plan of graddebug.sampling: the norm
    # of every stride-th entry, scaled by sqrt(numel / count). Small tensors are read whole.
    from graddebug.sampling import plan

    run = driver.build("wide")
    before = driver.weights(run)
    with driver.watch(run) as dbg:
        driver.train(run, dbg, 1)
    after = driver.weights(run)
    read = before if driver.weights_read == "before" else after
    keys = list(driver.rows())
    shapes = [before[k.split(".")[0]]["wb".index(k.split(".")[1])].shape for k in keys]
    samples = dict(zip(keys, plan(shapes), strict=True))
    assert not all(s.whole for s in samples.values())  # the wide model is sampled
    for key, row in _params(driver, dbg.frame()).items():
        layer, index = key.split(".")[0], "wb".index(key.split(".")[1])
        update = after[layer][index].astype(np.float64) - before[layer][index]
        assert _norm(update) > 0
        assert row.update_norm == pytest.approx(_estimate(update, samples[key]), rel=REL), key
        assert row.weight_norm == pytest.approx(_estimate(read[layer][index], samples[key]),
                                                rel=REL), key
        if not samples[key].whole:  # and the estimate is near the whole tensor's norm
            assert row.weight_norm == pytest.approx(_norm(read[layer][index]), rel=0.15), key


@scenario("loss")
def each_step_has_its_loss_row(driver: Driver) -> None:
    run, (x, y) = driver.build(), batch()
    want = []
    with driver.watch(run) as dbg:
        for _ in range(2):
            want.append(numpy_loss(driver.weights(run), x, y))
            driver.train(run, dbg, 1)
    frame = dbg.frame()
    rows = frame[frame["kind"] == "loss"].sort_values("step")
    assert list(rows["step"]) == [0, 1]
    assert list(rows["mean"]) == pytest.approx(want, rel=1e-5)
    assert want[0] != pytest.approx(want[1], rel=1e-3)


@scenario("cleanup")
def everything_is_given_back_after_the_block(driver: Driver) -> None:
    run = driver.build()
    untouched = driver.probe(run)
    with driver.watch(run) as dbg:
        driver.train(run, dbg, 1)
        assert driver.probe(run) != untouched  # the probe sees what the adapter installs
    assert driver.probe(run) == untouched
    with pytest.raises(RuntimeError, match="the user's own bug"), driver.watch(run) as dbg:
        driver.train(run, dbg, 1)
        raise RuntimeError("the user's own bug")
    assert driver.probe(run) == untouched
    steps = len(dbg.frame())
    driver.train(run, None, 1)  # after the block: nothing records, nothing raises
    assert len(dbg.frame()) == steps


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in LAYERS:
        for x, y in zip(a[name], b[name], strict=True):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name


@scenario("bitwise")
def training_is_bitwise_that_without_graddebug(driver: Driver) -> None:
    plain = driver.build(plain=True)
    driver.train(plain, None, 3)
    run = driver.build()
    with driver.watch(run) as dbg:
        driver.train(run, dbg, 3)
    assert sorted(set(dbg.frame()["step"])) == [0, 1, 2]
    _same_weights(driver.weights(plain), driver.weights(run))
    start = initial_weights()
    assert not np.array_equal(driver.weights(plain)["l1"][0], start["l1"][0])  # it trained


@scenario("fail-open")
def a_bug_inside_the_adapter_is_an_internal_error_and_training_goes_on(driver: Driver) -> None:
    plain = driver.build(plain=True)
    driver.train(plain, None, 2)
    run = driver.build()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        driver.break_adapter(patch)
        with driver.watch(run) as dbg:
            driver.train(run, dbg, 2)
    ours = [w for w in caught if issubclass(w.category, GradDebugWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]  # one warning, however many bugs
    assert BUG in str(ours[0].message)
    found = dbg.findings()
    assert set(found["issue"]) == {"internal_error"}, found.to_string()
    assert found["message"].str.contains("ZeroDivisionError").all()
    _same_weights(driver.weights(plain), driver.weights(run))
    if not driver.bug_empties_step:  # what did not fail is still recorded, at every step
        params = _step(dbg.frame(), 1, "parameter")
        assert len(params) == len(driver.rows()), dbg.frame().to_string()
        assert not (dbg.frame()["kind"] == "activation").any()


@scenario("fail-open-strict")
def strict_raises_the_bug(driver: Driver) -> None:
    run = driver.build()
    untouched = driver.probe(run)
    with pytest.MonkeyPatch.context() as patch:
        driver.break_adapter(patch)
        with pytest.raises(GradDebugInternalError) as info, \
                driver.watch(run, strict=True) as dbg:
            driver.train(run, dbg, 1)
    assert BUG in str(info.value)
    if driver.keeps_cause:
        assert isinstance(info.value.__cause__, ZeroDivisionError), repr(info.value.__cause__)
    assert driver.probe(run) == untouched  # given back on the way out
