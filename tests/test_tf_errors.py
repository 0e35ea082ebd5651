"""Typed errors for bad input, and fail-open handling of a bug in the eager sentinel rows, in the
TensorFlow adapter. That a bug in a gradient hook fails open (and strict=True raises it) is
checked for every adapter by tests/conformance."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import graddebug  # noqa: E402
from graddebug import (  # noqa: E402
    ConfigError,
    GradDebugWarning,
    GradientCountError,
    UnknownNameError,
    WatcherStateError,
)
from graddebug_tensorflow.eagerrows import EagerRows  # noqa: E402
from tf_models import batches, relu_mlp, train  # noqa: E402


def test_wrong_gradient_count_names_both_lengths():
    model = relu_mlp(depth=3, width=8)
    with graddebug.watch(model) as dbg, pytest.raises(GradientCountError, match=r"\b2\b.*\b6\b"):
        dbg.step([tf.zeros(1), tf.zeros(1)])


def test_wrong_gradient_count_for_params_names_both_lengths():
    W = tf.Variable(tf.ones((2, 2)))
    with graddebug.watch(params={"W": W}) as dbg, \
            pytest.raises(GradientCountError, match=r"got 3 gradients.*1 params="):
        dbg.step([None, None, None])


@pytest.mark.parametrize("spec", ["fc_1", "dense*", 42])
def test_unknown_layers_name_is_rejected_on_entry(spec):
    model = relu_mlp(depth=3, width=8)
    error = ConfigError if spec == 42 else UnknownNameError
    with pytest.raises(error) as info, graddebug.watch(model, layers=[spec]):
        pass
    if spec == "fc_1":
        assert "fc1" in str(info.value)  # the suggestion


@pytest.mark.parametrize("option", ["keep", "intervene"])
def test_unknown_keep_or_intervene_name_is_reported_on_exit(option):
    model = relu_mlp(depth=3, width=8)
    value = ["fc9"] if option == "keep" else {"fc9": {"scale": 2.0}}
    with pytest.raises(UnknownNameError, match="'fc9'"), \
            graddebug.watch(model, **{option: value}):
        pass


def test_keep_name_matching_a_tap_is_fine():
    W = tf.Variable(tf.ones((2, 2)))
    with graddebug.watch(params={"W": W}, keep=["h"]) as dbg, tf.GradientTape() as tape:
        h = dbg.tap(tf.ones((1, 2)) @ W, "h")
        dbg.step(tape.gradient(tf.reduce_sum(h), [W]))
    np.testing.assert_array_equal(dbg.tensors(0)["h"], np.ones((1, 2)))


def test_params_entry_that_is_not_a_variable():
    with pytest.raises(ConfigError, match=r"params\['h'\].*tap"), \
            graddebug.watch(params={"h": tf.ones(2)}):
        pass


def test_tap_of_a_non_tensor():
    W = tf.Variable(tf.ones(2))
    with graddebug.watch(params={"W": W}) as dbg, pytest.raises(ConfigError, match=r"tf\.Tensor"):
        dbg.tap([1.0, 2.0], "h")


def test_callback_needs_an_active_watcher_and_known_stop_reasons():
    model = relu_mlp(depth=2, width=4)
    with graddebug.watch(model) as dbg, pytest.raises(ConfigError, match=r"'exploding'.*nonfinite"):
        dbg.callback(stop_on=("exploding",))
    with pytest.raises(WatcherStateError):
        dbg.callback()


def broken(*args, **kwargs):
    raise ZeroDivisionError("bug inside graddebug")


def test_a_bug_writing_the_eager_sentinel_rows_fails_open(monkeypatch):
    # The eager sentinel rows are written when the step is read, by dbg.step(), not in a hook.
    keras.utils.set_random_seed(0)
    model = relu_mlp(depth=3, width=8)
    start = model.get_weights()
    data = batches(3, (4, 32))
    train(model, data)
    plain = model.get_weights()
    model.set_weights(start)
    monkeypatch.setattr(EagerRows, "flush", broken)
    with pytest.warns(GradDebugWarning, match="bug inside graddebug") as warned, \
            graddebug.watch(model) as dbg:
        train(model, data, dbg)
    assert len(warned) == 1
    found = dbg.findings()
    assert set(found["issue"]) == {"internal_error"}
    assert "ZeroDivisionError" in found["message"].iloc[0]
    for a, b in zip(plain, model.get_weights(), strict=True):
        assert np.array_equal(a, b)
    assert len(set(dbg.frame()["step"])) == 3  # every step still closed and recorded
