"""The options of ``watch`` as data: their names come from :class:`WatchOptions` alone, and an
option the model's adapter does not declare is refused at ``watch()`` with one typed message
that names the adapter, in every framework."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import graddebug
from graddebug.adapter import WatchOptions
from graddebug.adapter.options import (
    ADAPTER_OPTIONS,
    WATCH_OPTIONS,
    WATCHER_OPTIONS,
    options_set,
)
from graddebug.capture.capabilities import INSTEAD, refuse_options
from graddebug.errors import ConfigError, UnsupportedOptionError
from graddebug.plugins import new_plugin_manager
from test_adapter_protocol import batch, small_model, tg


def test_the_watchers_keywords_are_the_fields_of_watch_options_in_order() -> None:
    parameters = inspect.signature(graddebug.Watcher.__init__).parameters.values()
    keywords = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    fields = [f.name for f in dataclasses.fields(WatchOptions) if not f.metadata.get("derived")]
    assert keywords == fields == list(WATCH_OPTIONS)


def test_every_option_is_the_watchers_or_an_adapters_and_each_has_a_way_out() -> None:
    assert set(WATCHER_OPTIONS) | set(ADAPTER_OPTIONS) == set(WATCH_OPTIONS)
    assert not set(WATCHER_OPTIONS) & set(ADAPTER_OPTIONS)
    assert set(INSTEAD) == set(ADAPTER_OPTIONS)


def test_options_set_are_those_that_differ_from_their_default() -> None:
    assert options_set(WatchOptions()) == []
    given = WatchOptions(keep=frozenset({"a"}), ops=True, every=2, scaler=object(),
                         full_stats_every=10, outputs=True, intervene={})
    assert options_set(given) == ["keep", "every", "scaler", "ops"]


def test_check_and_callbacks_know_every_option_but_their_own() -> None:
    from graddebug.integrations.stopping import check_watch_options

    check_watch_options({name: None for name in WATCH_OPTIONS if name != "optimizer"},
                        "check()", ("steps",))
    with pytest.raises(ConfigError, match=r"unknown option 'opps'.*'ops'"):
        check_watch_options({"opps": True}, "check()", ("steps",))


# -- the toy adapter (examples/adapter) --------------------------------------------------------


def toy_watch(model: Any = None, **options: Any) -> graddebug.Watcher:
    pm = new_plugin_manager(entry_points=False)
    pm.register(tg)
    return graddebug.watch(model, plugin_manager=pm, **options)


def test_toy_refuses_ops_at_watch_naming_the_adapter_and_what_to_do() -> None:
    model = small_model()
    with pytest.raises(UnsupportedOptionError) as caught:
        toy_watch(model, ops=True)
    text = str(caught.value)
    assert "the toygrad adapter (toygrad.ToyAdapter)" in text
    assert "does not honour ops=" in text and "dbg.tap(x, name)" in text
    assert isinstance(caught.value, ConfigError)
    assert not any(m._forward_hooks for _, m in model.named_modules())  # nothing attached


def test_toy_refuses_every_unsupported_option_in_one_message() -> None:
    with pytest.raises(UnsupportedOptionError, match=r"watch\(scaler=\.\.\., escalate=\.\.\.\)"):
        toy_watch(small_model(), scaler=object(), escalate=True)


def test_toy_honours_what_it_declares() -> None:
    model = small_model()
    x, y = batch()
    with toy_watch(model, keep=["1"], full_stats_every=1, param_stats="full") as dbg:
        tg.mse(model(x), y).backward()
        dbg.step()
    assert "1" in dbg.tensors(0)


def test_layers_without_a_model_is_refused_whatever_the_adapter() -> None:
    var = tg.Var(np.ones((2, 2)), requires_grad=True)
    with pytest.raises(UnsupportedOptionError,
                       match=r"toygrad adapter .*layers=.*no model was given"):
        toy_watch(params={"W": var}, layers=["x"])


def test_an_adapter_that_declares_no_options_is_not_asked() -> None:
    undeclared = type("Undeclared", (), {"name": "undeclared"})
    refuse_options(undeclared, WatchOptions(ops=True, scaler=object()), model=True)


def test_a_tap_finds_its_adapter_and_is_refused_then() -> None:
    with toy_watch(keep=["t"]) as dbg:  # the toy keeps taps' gradients: no refusal
        dbg.tap(tg.Var(np.ones(3), requires_grad=True), "t")
    with toy_watch(scaler=object()) as dbg, pytest.raises(UnsupportedOptionError,
                                                          match="toygrad adapter"):
        dbg.tap(tg.Var(np.ones(3), requires_grad=True), "t")


# -- torch, TensorFlow, TF1 graphs, JAX --------------------------------------------------------


def test_torch_refuses_layers_without_a_model_and_honours_ops() -> None:
    torch = pytest.importorskip("torch")
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(UnsupportedOptionError, match=r"the torch adapter \(graddebug_torch"):
        graddebug.watch(params={"W": w}, layers=["fc"])
    graddebug.watch(torch.nn.Linear(2, 2), ops=True, scaler=None, keep=["fc"])


def test_tensorflow_refuses_layers_without_a_model_and_honours_keep() -> None:
    tf = pytest.importorskip("tensorflow")
    import keras

    w = tf.Variable(np.ones(2, np.float32))
    with pytest.raises(UnsupportedOptionError, match=r"the tensorflow adapter \(graddebug_tens"):
        graddebug.watch(params={"W": w}, layers=["dense"])
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d")])
    graddebug.watch(model, keep=["d"], ops=True)


def test_tf1_graphs_refuse_outputs_and_honour_keep() -> None:
    tf = pytest.importorskip("tensorflow")
    with tf.Graph().as_default():
        w = tf.compat.v1.Variable(np.ones(2, np.float32), name="w")
        with pytest.raises(UnsupportedOptionError,
                           match=r"tensorflow adapter \(graddebug_tensorflow\.v1graph\..*outputs="):
            graddebug.watch(params={"W": w}, outputs=False)
        graddebug.watch(params={"W": w}, keep=["W"])


@pytest.mark.parametrize("option", [{"ops": True}, {"escalate": True}, {"scaler": object()},
                                    {"keep": ["layers.0"]}, {"full_stats_every": 1}],
                         ids=lambda o: next(iter(o)))
def test_jax_refuses_what_it_does_not_honour(option: dict[str, Any]) -> None:
    pytest.importorskip("flax.nnx")
    from jax_models import MLP

    name = next(iter(option))
    with pytest.raises(UnsupportedOptionError, match=rf"the jax adapter .*does not honour {name}="):
        graddebug.watch(MLP([4, 8, 2]), **option)


def test_jax_honours_layers_and_has_no_callback() -> None:
    pytest.importorskip("flax.nnx")
    from jax_models import MLP

    with graddebug.watch(MLP([4, 8, 2]), param_stats="full") as dbg, pytest.raises(
            ConfigError, match="the jax adapter has none"):
        dbg.callback()


# -- Keras on the torch and JAX backends (one process per backend) -----------------------------

KERAS_CHILD = textwrap.dedent('''
    import json
    import keras
    import graddebug
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d1")])
    out = {}
    for option in ({"scaler": object()}, {"ops": True}, {"params": {"W": model.weights[0]}},
                   {"keep": ["d1"]}):
        name = next(iter(option))
        try:
            graddebug.watch(model, **option)
            out[name] = None
        except graddebug.errors.UnsupportedOptionError as exc:
            out[name] = str(exc)
    print("GD-RESULT " + json.dumps(out))
''')


def keras_child(backend: str) -> dict[str, str | None]:
    pytest.importorskip("keras")
    pytest.importorskip(backend)
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", KERAS_CHILD], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("GD-RESULT ")]
    assert lines, done.stderr[-3000:]
    result: dict[str, str | None] = json.loads(lines[-1].removeprefix("GD-RESULT "))
    return result


def test_keras_on_torch_refuses_a_torch_scaler_and_honours_the_rest() -> None:
    got = keras_child("torch")
    assert got["scaler"] is not None and "the keras-torch adapter" in got["scaler"]
    assert got["ops"] is None and got["params"] is None and got["keep"] is None


def test_keras_on_jax_refuses_what_its_compiled_step_cannot_do() -> None:
    got = keras_child("jax")
    for name in ("scaler", "ops", "params", "keep"):
        assert got[name] is not None and "the keras-jax adapter" in got[name], name
