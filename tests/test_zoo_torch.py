"""The torch model zoo: transformers architectures from tiny configs, random init, 3 SGD steps.

Each model: no finding at initialisation; norms equal ``torch.autograd.grad`` for an early and
a late module; weights bitwise identical with and without ``watch``; no hook left. Broken
variants are flagged at the layer that broke. Step times are printed, not asserted.
"""

from __future__ import annotations

import functools
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import zoo  # noqa: E402

pytestmark = pytest.mark.slow

CASES = [pytest.param(case, id=case.name) for case in zoo.TORCH_CASES]


@functools.cache
def _runs(name: str) -> tuple[zoo.TorchRun, zoo.TorchRun]:
    """The plain and the watched run of one model, shared by the tests below."""
    case = zoo.TORCH_BY_NAME[name]
    return zoo.train_torch(case, watch=False), zoo.train_torch(case, watch=True)


@pytest.mark.parametrize("case", CASES)
def test_no_finding_at_initialisation(case: zoo.TorchCase, capsys: pytest.CaptureFixture) -> None:
    plain, watched = _runs(case.name)
    # Timed again after the first runs warmed up the allocator and the kernels.
    again = zoo.train_torch(case, watch=False), zoo.train_torch(case, watch=True)
    with capsys.disabled():
        print("\n" + zoo.overhead_line(case.name, "torch", plain.times + again[0].times,
                                        watched.times + again[1].times))
    findings = watched.watcher.findings()
    assert findings.empty, zoo.findings_text(findings)


@pytest.mark.parametrize("case", CASES)
def test_norms_equal_autograd(case: zoo.TorchCase) -> None:
    expected = zoo.torch_reference(case)
    frame = zoo.train_torch(case, watch=True, steps=1).watcher.frame()
    for (layer, tensor), norm in expected.items():
        rows = frame[(frame["step"] == 0) & (frame["layer"] == layer)
                     & (frame["tensor"] == tensor)]
        assert len(rows) == 1, f"{layer}.{tensor}: {len(rows)} rows"
        assert float(rows["norm"].iloc[0]) == pytest.approx(norm, rel=1e-4), (layer, tensor)
        assert norm > 0


@pytest.mark.parametrize("case", CASES)
def test_weights_are_bitwise_identical_with_and_without_watch(case: zoo.TorchCase) -> None:
    plain, watched = _runs(case.name)
    before = zoo.build_torch(case).state_dict()
    moved = 0
    for (name, a), b in zip(plain.model.state_dict().items(),
                            watched.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
        moved += not torch.equal(a, before[name])
    assert moved > 0  # the runs trained: the comparison is not between two inits


@pytest.mark.parametrize("case", CASES)
def test_nothing_is_left_behind(case: zoo.TorchCase) -> None:
    _, watched = _runs(case.name)
    assert not watched.watcher.active
    assert zoo.torch_hook_count(watched.model) == watched.hooks_before
    assert watched.model.training


# -- broken variants -----------------------------------------------------------------------------


def _patch_forward(model: torch.nn.Module, name: str, change) -> None:
    module = model.get_submodule(name)
    original = module.forward
    module.forward = lambda *args, **kwargs: change(original(*args, **kwargs))


def _issues_at(findings, issue: str) -> set[str]:
    return set(findings[findings["issue"] == issue]["layer"])


def test_a_detach_inside_one_block_is_named() -> None:
    case = zoo.TORCH_BY_NAME["gpt2"]
    cut = "transformer.h.1.mlp.c_fc"
    run = zoo.train_torch(case, watch=True,
                          mutate=lambda m: _patch_forward(m, cut, lambda out: out.detach()))
    findings = run.watcher.findings()
    assert cut in _issues_at(findings, "cut_graph"), zoo.findings_text(findings)
    # Only the cut is reported: the blocks around it are healthy.
    assert set(findings["issue"]) == {"cut_graph"}, zoo.findings_text(findings)


def test_a_detach_in_a_cnn_is_named() -> None:
    case = zoo.TORCH_BY_NAME["resnet"]
    cut = "resnet.encoder.stages.1.layers.0.layer.0"
    run = zoo.train_torch(case, watch=True,
                          mutate=lambda m: _patch_forward(m, cut, lambda out: out.detach()))
    findings = run.watcher.findings()
    cuts = findings[findings["issue"] == "cut_graph"]
    assert any(cut in str(message) for message in cuts["message"]), zoo.findings_text(findings)


@pytest.mark.parametrize(("model", "culprit"), [
    ("gpt2", "transformer.h.0.mlp.c_proj"),
    ("resnet", "classifier.1"),
])
def test_a_huge_weight_is_named_as_the_source(model: str, culprit: str) -> None:
    case = zoo.TORCH_BY_NAME[model]

    def scale(m: torch.nn.Module) -> None:
        with torch.no_grad():
            m.get_submodule(culprit).weight.mul_(1e6)

    findings = zoo.train_torch(case, watch=True, mutate=scale).watcher.findings()
    ratio = findings[findings["issue"].isin(["exploding", "vanishing"])]
    # One finding names the layer where the norm jumps; the victims are counted in its message.
    assert set(ratio["layer"]) == {culprit}, zoo.findings_text(findings)


def test_log_of_a_negative_is_named_where_it_is_born() -> None:
    case = zoo.TORCH_BY_NAME["gpt2"]
    born = "transformer.h.1.mlp.c_fc"
    run = zoo.train_torch(case, watch=True,
                          mutate=lambda m: _patch_forward(m, born, torch.log))
    findings = run.watcher.findings()
    nonfinite = findings[findings["issue"] == "nonfinite"]
    assert not nonfinite.empty, zoo.findings_text(findings)
    assert nonfinite["layer"].iloc[0] == born, zoo.findings_text(findings)
    assert born in str(nonfinite["message"].iloc[0])
    # No dead or ratio findings from steps that are already non-finite.
    assert set(findings["issue"]) == {"nonfinite"}, zoo.findings_text(findings)
    frame = run.watcher.frame()
    assert frame[frame["layer"] == born]["nan"].any()
    assert math.isnan(float(frame[(frame["layer"] == "lm_head")]["norm"].iloc[0]))
