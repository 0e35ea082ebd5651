"""The Keras model zoo: ResNet50, MobileNetV2 and EfficientNetB0 from ``keras.applications``
(``weights=None``, 32x32 inputs, softmax heads), 3 SGD steps under ``fit`` and an eager tape
loop.

Each model, in each mode: no finding at initialisation; weights bitwise identical with and
without ``watch`` (after showing that two plain runs are, under the seeds and the op
determinism of :func:`zoo.keras_setup`); every ``layer.call`` restored. In the tape loop, norms
equal ``tape.gradient`` for an early and a late layer. Broken variants of MobileNetV2 are
flagged at the layer that broke. Step times are printed, not asserted.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import zoo  # noqa: E402

pytestmark = pytest.mark.slow

CASES = [pytest.param(case, id=case.name) for case in zoo.KERAS_CASES]
MODES = ["fit", "tape"]


@functools.cache
def _runs(name: str, mode: str) -> tuple[zoo.KerasRun, zoo.KerasRun]:
    """The plain and the watched run of one application in one mode."""
    case = zoo.KERAS_BY_NAME[name]
    return (zoo.train_keras(case, mode=mode, watch=False),
            zoo.train_keras(case, mode=mode, watch=True))


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> list[int]:
    """Indices of the weights that differ (bitwise)."""
    return [i for i, (u, v) in enumerate(zip(a, b, strict=True)) if not np.array_equal(u, v)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_no_finding_at_initialisation(case: zoo.KerasCase, mode: str,
                                      capsys: pytest.CaptureFixture) -> None:
    plain, watched = _runs(case.name, mode)
    with capsys.disabled():
        print("\n" + zoo.overhead_line(f"{case.name} ({mode})", "tf", plain.times,
                                        watched.times))
    findings = watched.watcher.findings()
    assert findings.empty, zoo.findings_text(findings)


@pytest.mark.parametrize("case", CASES)
def test_two_plain_fit_runs_are_bitwise_equal(case: zoo.KerasCase) -> None:
    plain, _ = _runs(case.name, "fit")
    again = zoo.train_keras(case, mode="fit", watch=False)
    assert _equal(plain.weights, again.weights) == []
    init = zoo.build_keras(case).get_weights()
    assert len(_equal(plain.weights, init)) > 0  # the runs trained


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_weights_are_bitwise_identical_with_and_without_watch(case: zoo.KerasCase,
                                                              mode: str) -> None:
    plain, watched = _runs(case.name, mode)
    differ = _equal(plain.weights, watched.weights)
    assert differ == [], f"{len(differ)} of {len(plain.weights)} weights differ"


@pytest.mark.parametrize("case", CASES)
def test_norms_equal_tape_gradient(case: zoo.KerasCase) -> None:
    expected = zoo.keras_reference(case)
    _, watched = _runs(case.name, "tape")
    frame = watched.watcher.frame()
    for (layer, tensor), norm in expected.items():
        rows = frame[(frame["step"] == 0) & (frame["layer"] == layer)
                     & (frame["tensor"] == tensor)]
        assert len(rows) == 1, f"{layer}.{tensor}: {len(rows)} rows"
        assert norm > 0
        assert float(rows["norm"].iloc[0]) == pytest.approx(norm, rel=1e-4), (layer, tensor)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_every_layer_call_is_restored(case: zoo.KerasCase, mode: str) -> None:
    _, watched = _runs(case.name, mode)
    assert not watched.watcher.active
    assert watched.calls_after == watched.calls_before
    assert watched.watcher.frame()["step"].nunique() == zoo.STEPS  # it did watch


# -- broken variants (MobileNetV2, tape loop) ---------------------------------------------------

MOBILENET = zoo.KERAS_BY_NAME["MobileNetV2"]
BLOCK = "block_10_project"  # a projection conv with no residual around it


def _patch_call(layer_name: str, change):
    def mutate(model) -> None:
        layer = model.get_layer(layer_name)
        original = layer.call
        object.__setattr__(layer, "call", lambda *args, **kwargs: change(
            original(*args, **kwargs)))
    return mutate


@pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")  # Keras sees the cut
def test_a_stop_gradient_inside_one_block_is_named() -> None:
    run = zoo.train_keras(MOBILENET, mode="tape", watch=True,
                          mutate=_patch_call(BLOCK, tf.stop_gradient))
    findings = run.watcher.findings()
    cuts = findings[findings["issue"] == "cut_graph"]
    assert BLOCK in set(cuts["layer"]), zoo.findings_text(findings)
    assert set(findings["issue"]) == {"cut_graph"}, zoo.findings_text(findings)


def test_a_huge_weight_is_named_as_the_source() -> None:
    def scale(model) -> None:
        kernel = model.get_layer("predictions").kernel
        kernel.assign(kernel * 1e6)

    run = zoo.train_keras(MOBILENET, mode="tape", watch=True, mutate=scale)
    findings = run.watcher.findings()
    ratio = findings[findings["issue"].isin(["exploding", "vanishing"])]
    assert set(ratio["layer"]) == {"predictions"}, zoo.findings_text(findings)
    assert "exploding" in set(ratio["issue"]), zoo.findings_text(findings)


def test_log_of_a_negative_is_named_where_it_is_born() -> None:
    run = zoo.train_keras(MOBILENET, mode="tape", watch=True,
                          mutate=_patch_call(BLOCK, tf.math.log))
    findings = run.watcher.findings()
    nonfinite = findings[findings["issue"] == "nonfinite"]
    assert not nonfinite.empty, zoo.findings_text(findings)
    assert nonfinite["layer"].iloc[0] == BLOCK, zoo.findings_text(findings)
    assert set(findings["issue"]) == {"nonfinite"}, zoo.findings_text(findings)
