"""TF1 graphs (``tf.compat.v1`` Graph and Session): taps, ``params=``, interventions, the
session hook and the explicit fetches, checked against ``tf.compat.v1.gradients`` run in the
same session, and the example of seed scenario 2 in a v1 graph."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import graddebug
from example_checks import X_SEED, Scenario, finite_difference_reference, run_example
from graddebug.errors import ConfigError, GradDebugWarning, GradientCountError

tf = pytest.importorskip("tensorflow")
v1 = tf.compat.v1

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 5)).astype(np.float32)
Y = RNG.normal(size=(8, 3)).astype(np.float32)
W1 = (RNG.normal(size=(5, 4)) * 0.5).astype(np.float32)
W2 = (RNG.normal(size=(4, 3)) * 0.5).astype(np.float32)
B1 = np.full(4, 0.1, np.float32)


def _variables() -> dict[str, Any]:
    """The variables of a two-layer net, in the default graph."""
    return {"w1": v1.Variable(W1, name="w1"), "b1": v1.Variable(B1, name="b1"),
            "w2": v1.Variable(W2, name="w2")}


def _net(params: dict[str, Any], dbg: Any = None, **tap: Any) -> dict[str, Any]:
    """The net's forward pass and loss; with ``dbg``, ``h`` (before the ReLU, with ``tap``'s
    options) and ``a`` (after it) are tapped."""
    x = v1.placeholder(tf.float32, [None, 5])
    h = tf.matmul(x, params["w1"]) + params["b1"]
    if dbg is not None:
        h = dbg.tap(h, "h", **tap)
    a = tf.nn.relu(h)
    if dbg is not None:
        a = dbg.tap(a, "a")
    loss = tf.reduce_mean(tf.square(tf.matmul(a, params["w2"]) - Y))
    return {"x": x, "h": h, "a": a, "loss": loss}


def _stats(g: np.ndarray) -> dict[str, float]:
    g = g.astype(np.float64)
    return {"norm": float(np.linalg.norm(g)), "mean": float(g.mean()), "std": float(g.std()),
            "absmax": float(np.abs(g).max())}


def _assert_row(row: Any, g: np.ndarray, *, full: bool = True) -> None:
    want = _stats(g)
    assert row["numel"] == g.size
    assert row["shape"] == str(tuple(g.shape))
    names = ("norm", "mean", "std", "absmax") if full else ("norm",)
    for name in names:
        assert row[name] == pytest.approx(want[name], rel=1e-5, abs=1e-9), name
    assert not row["nan"] and not row["inf"]


def test_explicit_fetches_in_a_bare_session_match_v1_gradients() -> None:
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(params=params, param_stats="full") as dbg:
            net = _net(params, dbg)
            grads = v1.gradients(net["loss"], list(params.values()))
            refs = v1.gradients(net["loss"], [net["h"], net["a"]])
            fetches = dbg.fetches(grads=grads)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                outs = []
                for i in range(2):
                    out = sess.run({"grads": grads, "refs": refs, "dbg": fetches},
                                   {net["x"]: X * (i + 1)})
                    dbg.step(out["dbg"])
                    outs.append(out)
    frame = dbg.frame()
    assert sorted(frame["step"].unique()) == [0, 1]
    for step, out in enumerate(outs):
        rows = frame[frame["step"] == step].set_index("layer")
        assert len(rows) == 5
        for name, g in zip(["h", "a"], out["refs"], strict=True):
            assert rows.loc[name, "kind"] == "activation"
            assert rows.loc[name, "tensor"] == "output"
            _assert_row(rows.loc[name], g)
        dead = float((np.abs(out["refs"][1]).max(axis=0) == 0).mean())
        assert rows.loc["a", "zero_frac"] == pytest.approx(dead)
        for name, g in zip(params, out["grads"], strict=True):
            assert rows.loc[name, "kind"] == "parameter"
            assert rows.loc[name, "tensor"] == name
            _assert_row(rows.loc[name], g)
    # Forward order: the params= keys first, then the taps as the graph was built.
    depth = frame.groupby("layer")["depth"].first()
    assert depth["w1"] < depth["b1"] < depth["w2"] < depth["h"] < depth["a"]
    assert dbg.findings().empty


def _reference_grads(x: np.ndarray) -> dict[str, np.ndarray]:
    """dL/dh and the variables' gradients of the net, in a graph without graddebug."""
    with tf.Graph().as_default():
        params = _variables()
        net = _net(params)
        names = ["h", *params]
        grads = v1.gradients(net["loss"], [net["h"], *params.values()])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            return dict(zip(names, sess.run(grads, {net["x"]: x}), strict=True))


@pytest.mark.parametrize("tap", [
    {"clip_value": 0.01},
    {"mask": np.array([True, False, True, False])},
    {"mask": tf.constant([1.0, 0.0, 0.0, 1.0])},  # an eager tensor enters the graph
])
def test_intervention_alters_the_gradient_that_flows_on(tap: dict[str, Any]) -> None:
    ref = _reference_grads(X)
    g = ref["h"].astype(np.float64)
    if "clip_value" in tap:
        altered = np.clip(g, -tap["clip_value"], tap["clip_value"])
    else:
        altered = g * np.asarray(tap["mask"], dtype=np.float64)
    assert not np.allclose(altered, g)  # the intervention must act
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(params=params) as dbg:
            net = _net(params, dbg, **tap)
            grads = v1.gradients(net["loss"], list(params.values()))
            fetches = dbg.fetches(grads=grads)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                out = sess.run({"grads": grads, "dbg": fetches}, {net["x"]: X})
                dbg.step(out["dbg"])
    w1_grad, b1_grad, w2_grad = out["grads"]
    np.testing.assert_allclose(w1_grad, X.astype(np.float64).T @ altered, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b1_grad, altered.sum(axis=0), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(w2_grad, ref["w2"])  # above the tap: untouched
    row = dbg.frame().set_index("layer").loc["h"]
    _assert_row(row, altered)
    assert row["pre_norm"] == pytest.approx(np.linalg.norm(g), rel=1e-5)


def test_session_hook_records_every_run_of_a_monitored_session() -> None:
    steps = 3
    with tf.Graph().as_default():
        params = _variables()
        opt = v1.train.GradientDescentOptimizer(0.1)
        with graddebug.watch(params=params, optimizer=opt) as dbg:
            net = _net(params, dbg)
            train = opt.minimize(net["loss"])  # the optimizer hands graddebug the gradients
            refs = v1.gradients(net["loss"], [net["h"], *params.values()])
            outs = []
            with v1.train.MonitoredTrainingSession(
                    hooks=[dbg.session_hook()], log_step_count_steps=None,
                    save_summaries_steps=None) as sess:
                for _ in range(steps):
                    outs.append(sess.run([train, refs], {net["x"]: X})[1])
    # apply_gradients is the optimizer's own again.
    assert "apply_gradients" not in vars(opt)
    frame = dbg.frame()
    assert sorted(frame["step"].unique()) == list(range(steps))
    for step, (g_h, *g_params) in enumerate(outs):
        rows = frame[frame["step"] == step].set_index("layer")
        _assert_row(rows.loc["h"], g_h)
        for name, g in zip(params, g_params, strict=True):
            _assert_row(rows.loc[name], g, full=False)
    # Training moved the weights, so the steps differ.
    assert frame[frame["layer"] == "w1"]["norm"].nunique() == steps


def _train(watched: bool, steps: int = 3) -> tuple[list[np.ndarray], list[np.ndarray]]:
    with tf.Graph().as_default():
        params = _variables()
        watcher = graddebug.watch(params=params) if watched else None
        dbg = watcher.__enter__() if watcher is not None else None
        try:
            net = _net(params, dbg)
            grads = v1.gradients(net["loss"], list(params.values()))
            train = v1.train.GradientDescentOptimizer(0.1).apply_gradients(
                zip(grads, params.values(), strict=True))
            fetches = {"train": train, "grads": grads}
            if dbg is not None:
                fetches["dbg"] = dbg.fetches(grads=grads)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for i in range(steps):
                    out = sess.run(fetches, {net["x"]: X * (1 + i)})
                    if dbg is not None:
                        dbg.step(out["dbg"])
                return out["grads"], sess.run(list(params.values()))
        finally:
            if watcher is not None:
                watcher.__exit__(None, None, None)


def test_weights_and_gradients_are_bitwise_identical_with_and_without_graddebug() -> None:
    grads_plain, weights_plain = _train(False)
    grads_watched, weights_watched = _train(True)
    for a, b in zip(grads_plain + weights_plain, grads_watched + weights_watched, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(weights_plain[0], W1)  # it trained


def test_the_backward_that_feeds_the_given_gradients_is_recorded() -> None:
    ref = _reference_grads(X)
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(params=params) as dbg:
            net = _net(params, dbg)
            # Built first through the same taps, with a gradient 3x the loss's.
            v1.gradients(3.0 * net["loss"], list(params.values()))
            grads = v1.gradients(net["loss"], list(params.values()))
            fetches = dbg.fetches(grads=grads)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                dbg.step(sess.run(fetches, {net["x"]: X}))
    _assert_row(dbg.frame().set_index("layer").loc["h"], ref["h"])


def test_keep_and_log_dir_round_trip(tmp_path: Path) -> None:
    ref = _reference_grads(X)
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(params=params, keep=["h", "w2"], log_dir=tmp_path / "run") as dbg:
            net = _net(params, dbg)
            grads = v1.gradients(net["loss"], list(params.values()))
            fetches = dbg.fetches(grads=grads)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                result = dbg.step(sess.run(fetches, {net["x"]: X}))
    assert result is not None
    np.testing.assert_allclose(result.kept["h"], ref["h"], rtol=1e-6)
    np.testing.assert_array_equal(result.kept["w2.w2"], ref["w2"])  # "<key>.<key>", as in TF2
    report = graddebug.load(tmp_path / "run")
    assert report.frame().equals(dbg.frame())
    assert set(report.frame()["layer"]) == {"h", "a", "w1", "b1", "w2"}


def test_a_stop_gradient_in_a_v1_graph_is_named() -> None:
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(params=params) as dbg:
            x = v1.placeholder(tf.float32, [None, 5])
            h = dbg.tap(tf.matmul(x, params["w1"]) + params["b1"], "block1")
            a = dbg.tap(tf.nn.relu(tf.stop_gradient(h)), "block2")
            loss = tf.reduce_mean(tf.square(tf.matmul(a, params["w2"]) - Y))
            grads = v1.gradients(loss, list(params.values()))
            fetches = dbg.fetches(grads=grads)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                dbg.step(sess.run(fetches, {x: X}))
    findings = dbg.findings()
    assert set(findings["issue"]) == {"cut_graph"}
    assert any("block1" in m and "block2" in m for m in findings["message"])
    assert {"w1", "b1"} <= set(findings["layer"])


def test_taps_alone_with_every_record_one_run_in_n() -> None:
    ref = _reference_grads(X)
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(every=2) as dbg:  # no params=: the first tap picks the adapter
            net = _net(params, dbg)
            v1.gradients(net["loss"], list(params.values()))  # builds the taps' backward
            fetches = dbg.fetches()
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                results = [dbg.step(sess.run(fetches, {net["x"]: X})) for _ in range(4)]
    assert [r is not None for r in results] == [True, False, True, False]
    frame = dbg.frame()
    assert sorted(frame["step"].unique()) == [0, 2]
    assert set(frame["layer"]) == {"h", "a"}
    _assert_row(frame[frame["layer"] == "h"].iloc[0], ref["h"])


# -- misuse ---------------------------------------------------------------------------------


def test_misuse_raises_typed_errors() -> None:
    eager = tf.constant([1.0])
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(params=params) as dbg:
            net = _net(params, dbg)
            grads = v1.gradients(net["loss"], list(params.values()))
            with pytest.raises(GradientCountError, match="2 gradients for 3"):
                dbg.fetches(grads=grads[:2])
            with pytest.raises(GradientCountError, match="1 gradients for 3"):
                dbg.fetches(grads=grads[0])  # one tensor, not a list
            with pytest.raises(GradientCountError, match="not a graph tensor"):
                dbg.fetches(grads=[np.zeros_like(W1), None, None])
            with pytest.raises(GradientCountError, match="'w2'"):
                dbg.fetches(grads=list(zip(grads[:2], list(params.values())[:2], strict=True)))
            pairs = list(zip(grads, params.values(), strict=True))
            fetches = dbg.fetches(grads=pairs)  # (gradient, variable) pairs work
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                out = sess.run({"grads": grads, "dbg": fetches}, {net["x"]: X})
            with pytest.raises(ConfigError, match="nothing"):
                dbg.step()
            with pytest.raises(ConfigError, match="got a list"):
                dbg.step(out["grads"])  # gradient values, not graddebug's fetched values
            with pytest.raises(ConfigError, match="the fetches themselves"):
                dbg.step(fetches)
            with pytest.raises(ConfigError, match=r"model\.fit"):
                dbg.callback()
            assert dbg.step(out["dbg"]) is not None
            with pytest.raises(ConfigError, match=r"tf\.compat\.v1 graph"):
                dbg.tap(eager, "other")
    # Entered outside the graph, the Watcher still watches it, and fetches() needs it.
    with graddebug.watch(params=params) as outside, pytest.raises(
            ConfigError, match=r"inside `with graph\.as_default"):
        outside.fetches()
    with graddebug.watch(params={"w": tf.Variable([1.0])}) as eager:
        with pytest.raises(ConfigError, match="runs none"):
            eager.fetches()
        with pytest.raises(ConfigError, match="runs no session"):
            eager.session_hook()


def test_values_fetched_for_another_watcher_are_refused() -> None:
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(params=params) as first:
            fetches = first.fetches(grads=v1.gradients(_net(params)["loss"], list(params.values())))
        with graddebug.watch(params=params) as second, v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            with pytest.raises(ConfigError, match="another Watcher"):
                second.step(sess.run(fetches, {sess.graph.get_tensor_by_name(
                    "Placeholder:0"): X}))


def test_a_keras_model_in_a_v1_graph_is_refused() -> None:
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    with (tf.Graph().as_default(), pytest.raises(ConfigError, match="not a Keras model"),
          graddebug.watch(model)):
        pass


def test_torch_has_no_session_hook() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 2)
    with graddebug.watch(model) as dbg:
        with pytest.raises(ConfigError, match="session_hook"):
            dbg.session_hook()
        with pytest.raises(ConfigError, match="fetches"):
            dbg.fetches()


def test_no_gradients_for_params_warns_and_records_the_taps() -> None:
    with tf.Graph().as_default():
        params = _variables()
        with graddebug.watch(params=params) as dbg:
            net = _net(params, dbg)
            v1.gradients(net["loss"], list(params.values()))
            with pytest.warns(GradDebugWarning, match="no gradients for the params="):
                fetches = dbg.fetches()
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                dbg.step(sess.run(fetches, {net["x"]: X}))
    assert set(dbg.frame()["layer"]) == {"h", "a"}
    assert dbg.findings().empty


# -- with eager execution disabled for the whole process ------------------------------------

_DISABLED = """
import numpy as np, tensorflow as tf, graddebug
tf.compat.v1.disable_eager_execution()
v1 = tf.compat.v1
W = v1.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))
x = tf.constant(np.array([[0.1, 0.2], [0.3, 0.4]], np.float32))
with graddebug.watch(params={"W": W}) as dbg:
    h = dbg.tap(tf.matmul(x, W), "h", clip_norm=0.5)
    loss = tf.reduce_sum(tf.square(h))
    (g_h,) = v1.gradients(loss, h)
    (g_w,) = v1.gradients(loss, W)
    fetches = dbg.fetches(grads=[g_w])
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        out = sess.run({"h": g_h, "w": g_w, "dbg": fetches})
        dbg.step(out["dbg"])
rows = dbg.frame().set_index("layer")
np.save("{path}", np.array([rows.loc["h", "pre_norm"], rows.loc["h", "norm"],
        rows.loc["W", "norm"], np.linalg.norm(out["h"]), np.linalg.norm(out["w"]),
        np.linalg.norm(x.eval(session=v1.Session()).T @ (out["h"] * min(1, 0.5 /
        np.linalg.norm(out["h"]))))]))
"""


def test_eager_execution_disabled_in_a_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "out.npy"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", textwrap.dedent(_DISABLED).replace("{path}", str(path))],
                   check=True, env=env, timeout=120)
    pre, norm, w_norm, ref_h, ref_w, clipped_w = np.load(path)
    assert pre == pytest.approx(ref_h, rel=1e-5)
    assert norm == pytest.approx(0.5, rel=1e-5)
    assert w_norm == pytest.approx(ref_w, rel=1e-5)
    assert ref_w == pytest.approx(clipped_w, rel=1e-5)  # the clipped gradient reached W


# -- the example: seed scenario 2 in a v1 graph ---------------------------------------------


@pytest.fixture(scope="module")
def scenario2() -> Scenario:
    return run_example("tf1", "scenario2_split_chain_rule")


def test_example_vjp_is_the_chain_rule(scenario2: Scenario) -> None:
    namespace, result = scenario2
    numeric = finite_difference_reference()
    g = numeric["dl_dh"]
    with tf.Graph().as_default():  # the VJP, built here without graddebug
        w = v1.Variable(namespace["W0"], dtype=tf.float32)
        h = tf.constant(namespace["X0"], tf.float32) @ w + tf.constant(namespace["B0"])
        (vjp,) = v1.gradients(h, w, grad_ys=tf.constant(g, tf.float32))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            reference = sess.run(vjp)
    np.testing.assert_allclose(result["vjp"], reference, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(result["vjp"], X_SEED.T @ g, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(result["direct"], numeric["dl_dw"], rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(result["dl_dh"], g, rtol=1e-4, atol=1e-9)
    assert not np.allclose(result["elementwise"], numeric["dl_dw"])


@pytest.mark.parametrize("label", ["clipped", "masked"])
def test_example_intervention_reaches_w(scenario2: Scenario, label: str) -> None:
    namespace, result = scenario2
    g = finite_difference_reference()["dl_dh"]
    if label == "clipped":
        c = result["clip_norm"]
        assert c < np.linalg.norm(g)
        altered = g * (c / np.linalg.norm(g))
    else:
        altered = g * np.array(namespace["MASK"], dtype=np.float64)
    run = result[label]
    np.testing.assert_allclose(run["w_grad"], X_SEED.T @ altered, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(run["b_grad"], altered.sum(axis=0), rtol=1e-4, atol=1e-9)
    assert run["pre_norm"] == pytest.approx(np.linalg.norm(g), rel=1e-5)
    assert run["norm"] == pytest.approx(np.linalg.norm(altered), rel=1e-5)
