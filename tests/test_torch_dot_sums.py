"""The sums behind every recorded step's sentinel and forward check, taken as a BLAS ``dot``
with a ones vector on CPU where ATen would split them over threads, against numpy in float64."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
import graddebug_torch.stats as torch_stats  # noqa: E402
from graddebug_torch.stats import DotSums, finiteness  # noqa: E402


@pytest.fixture
def dot_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sum by ``dot`` from 9 to 1024 entries, as if torch ran two threads."""
    monkeypatch.setattr(torch_stats, "PARALLEL_GRAIN", 8)
    monkeypatch.setattr(torch_stats, "DOT_SUM_LIMIT", 1024)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def _reference(t: torch.Tensor) -> tuple[float, float]:
    values = t.detach().double().numpy()
    return float(np.sum(values * values)), float(np.sum(values))


@pytest.mark.parametrize("window", [True, False], ids=["dot", "as-set"])
@pytest.mark.parametrize("make", [
    lambda: torch.randn(16, 32),
    lambda: torch.randn(128, 512),
    lambda: torch.randn(7, 3, 5, dtype=torch.float64),
    lambda: torch.randn(64, 96).t(),  # not contiguous: sum and vector_norm
    lambda: torch.randn(33, 17).half(),  # no BLAS dot for half: sum, accumulated in float32
    lambda: torch.randn(1),
], ids=["float32", "float32-64k", "float64", "transposed", "float16", "one-entry"])
def test_sentinel_and_total_match_numpy(make, window: bool,  # type: ignore[no-untyped-def]
                                        request: pytest.FixtureRequest) -> None:
    if window:
        request.getfixturevalue("dot_window")
    t = make()
    sums = DotSums()
    sq, total = sums.sentinel(t)
    ref_sq, ref_total = _reference(t)
    assert sq.dim() == total.dim() == 0
    assert sq.dtype == total.dtype == (torch.float64 if t.dtype == torch.float64
                                       else torch.float32)
    assert float(sq) == pytest.approx(ref_sq, rel=1e-5)
    # The sum cancels: compare against the scale of the entries, not the sum itself.
    scale = float(np.sum(np.abs(t.double().numpy())))
    assert abs(float(total) - ref_total) <= 1e-5 * scale
    assert abs(float(sums.total(t)) - ref_total) <= 1e-5 * scale


@pytest.mark.usefixtures("dot_window")
def test_only_sums_inside_the_window_go_through_the_ones_buffer() -> None:
    sums = DotSums()
    for n in (8, 1025):  # below the grain, above the limit: sum
        t = torch.randn(n)
        assert float(sums.total(t)) == pytest.approx(float(t.double().sum()), abs=1e-4)
    assert not sums._buffers
    t = torch.randn(1024)
    assert float(sums.total(t)) == pytest.approx(float(t.double().sum()), abs=1e-4)
    assert [b.numel() for b in sums._buffers.values()] == [1024]


def test_one_thread_sums_never_use_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_stats, "PARALLEL_GRAIN", 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    sums = DotSums()
    sums.sentinel(torch.randn(100))
    assert not sums._buffers


@pytest.mark.usefixtures("dot_window")
def test_the_ones_buffer_grows_by_powers_of_two_and_drops_stale_views() -> None:
    sums = DotSums()
    sums.total(torch.randn(10))
    assert sums._buffers[torch.float32].numel() == 16  # the next power of two
    first = sums._views[torch.float32, 10]
    sums.total(torch.randn(10))
    assert sums._views[torch.float32, 10] is first  # reused, no view made per call
    sums.total(torch.randn(1000))
    assert sums._buffers[torch.float32].numel() == 1024
    assert set(sums._views) == {(torch.float32, 1000)}  # views of the old buffer went
    sums.total(torch.randn(10, dtype=torch.float64))
    assert sums._buffers[torch.float64].numel() == 16  # one buffer per dtype
    assert sums._buffers[torch.float32].numel() == 1024
    t = torch.arange(1000, dtype=torch.float32)
    assert float(sums.total(t)) == 999 * 1000 / 2


@pytest.mark.usefixtures("dot_window")
@pytest.mark.parametrize("entry, sq_finite, total_finite", [
    (float("nan"), False, False),
    (float("inf"), False, False),
    (1e30, False, True),  # finite entries whose squares overflow float32
])
def test_non_finite_entries_reach_both_numbers(entry: float, sq_finite: bool,
                                               total_finite: bool) -> None:
    t = torch.randn(16, 64)
    t[3, 7] = entry
    sq, total = DotSums().sentinel(t)
    assert bool(torch.isfinite(sq)) is sq_finite
    assert bool(torch.isfinite(total)) is total_finite
    if entry != entry:  # NaN
        assert bool(torch.isnan(sq)) and bool(torch.isnan(total))


@pytest.mark.usefixtures("dot_window")
def test_forward_check_with_dot_sums_is_finite_exactly_when_the_output_is() -> None:
    sums = DotSums()
    out = torch.randn(16, 64, requires_grad=True) * 1.0
    assert bool(torch.isfinite(finiteness(out, sums)))
    assert float(finiteness(out, sums)) == pytest.approx(float(out.detach().double().sum()),
                                                         abs=1e-3)
    assert sums._buffers  # through the dot
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = out.detach().clone()
        broken[5, 5] = bad
        assert not bool(torch.isfinite(finiteness(broken.requires_grad_(), sums)))


@pytest.mark.parametrize("threads", [1, 2])
def test_recorded_mean_and_norm_match_the_gradient_from_autograd(
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on a layer wide enough for the in-hook path (32k+ entries, inside the real
    window on two threads): the mean and norm of the output's gradient in the frame equal
    those of ``torch.autograd.grad``."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 1))
    x = torch.randn(128, 64)
    hidden = model[1](model[0](x))
    (ref,) = torch.autograd.grad(model[2](hidden).square().mean(), hidden)
    with graddebug.watch(model) as dbg:
        model(x).square().mean().backward()
        dbg.step()
    row = dbg.frame().set_index(["layer", "tensor"]).loc[("1", "output")]
    values = ref.double().numpy()
    assert row["norm"] == pytest.approx(float(np.sqrt(np.sum(values ** 2))), rel=1e-5)
    assert row["mean"] == pytest.approx(float(values.mean()), abs=1e-6 * np.abs(values).max())
