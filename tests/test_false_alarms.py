"""No cut_graph on modules whose outputs need no gradient by design; cuts are still named.

A module whose output needs no gradient although its input needs one has cut the graph only
when the output was computed from the input's values. The position tables, masks and ranges
below read their input only for its shape, dtype or device.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402


class Rotary(nn.Module):
    """As Llama's and Qwen2's ``rotary_emb``: cos/sin tables from positions, in ``x``'s dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv @ pos).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


class Sinusoidal(nn.Module):
    """A sinusoidal position table sized from ``x``'s shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, dim = x.shape[1], x.shape[2]
        pos = torch.arange(seq, dtype=x.dtype, device=x.device)[:, None]
        rate = torch.exp(torch.arange(0, dim, 2, dtype=x.dtype) * (-math.log(1e4) / dim))
        table = torch.zeros(seq, dim, dtype=x.dtype)
        table[:, 0::2] = torch.sin(pos * rate)
        table[:, 1::2] = torch.cos(pos * rate)
        return table


class MaskBias(nn.Module):
    """An additive attention mask from an integer padding mask, in ``x``'s dtype."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask[:, None, None, :].to(x.dtype)
        return (1.0 - keep) * -1e9


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TinyDecoder(nn.Module):
    """One attention block with rotary positions, a sinusoidal table and a padding mask."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary_emb = Rotary(dim)
        self.positions = Sinusoidal()
        self.mask_bias = MaskBias()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.positions(h)
        position_ids = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
        cos, sin = self.rotary_emb(h, position_ids)
        q, k = self.q(h), self.k(h)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]) + self.mask_bias(h, mask)[:, 0]
        return self.head(torch.softmax(scores, -1) @ self.v(h))


def train_decoder(steps: int = 3):
    torch.manual_seed(0)
    model = TinyDecoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 11, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[:, -2:] = 0
    with graddebug.watch(model) as dbg:
        for _ in range(steps):
            out = model(tokens, mask)
            loss = nn.functional.cross_entropy(out.reshape(-1, 11), tokens.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            dbg.step()
    return dbg


def test_position_tables_and_masks_are_not_cuts():
    dbg = train_decoder()
    assert dbg.findings().empty, dbg.findings().to_string()
    assert not (dbg.events()["event"] == "detached_output").any()


class NoGradInside(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return x * 2


class NumpyInside(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.tanh(x.detach().numpy()))


class ScalarInside(nn.Module):
    """Rebuilds its output from Python floats read out of the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(x.tolist()) * 2


class LinearThenDetach(nn.Module):
    """A module with a trainable weight of its own whose output is detached."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).detach()


@pytest.mark.parametrize("cut", [NoGradInside, NumpyInside, ScalarInside, LinearThenDetach])
def test_a_module_that_computes_from_its_input_values_without_gradient_is_a_cut(cut):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), cut(), nn.Linear(4, 1))
    with graddebug.watch(model) as dbg:
        model(torch.randn(2, 4)).sum().backward()
        dbg.step()
    found = dbg.findings()
    errors = found[(found["issue"] == "cut_graph") & (found["severity"] == "error")]
    assert list(errors["layer"]) == ["1"]


def test_value_flow_does_not_change_the_forward_or_the_gradients():
    torch.manual_seed(0)
    plain = TinyDecoder()
    watched = TinyDecoder()
    watched.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    plain(tokens, mask).square().sum().backward()
    with graddebug.watch(watched) as dbg:
        watched(tokens, mask).square().sum().backward()
        dbg.step()
    for (name, a), b in zip(plain.named_parameters(), watched.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    assert torch._C._len_torch_function_stack() == 0  # every mode entered was left


def test_a_forward_that_raises_leaves_no_mode_behind():
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Boom())
    with graddebug.watch(model), pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(1, 2))
    assert torch._C._len_torch_function_stack() == 0


class MaskedAttention(nn.Module):
    """Scores plus an additive causal mask built by a module of its own, filled with
    ``finfo.min`` as transformers builds them: a float32 sum of that mask overflows to -inf."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mask = CausalMask()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2) + self.mask(x)
        return scores.softmax(-1) @ x


class CausalMask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        full = torch.full((n, n), torch.finfo(x.dtype).min, dtype=x.dtype)
        return torch.triu(full, diagonal=1).expand(x.shape[0], n, n)


def test_a_finfo_min_mask_is_not_a_non_finite_forward() -> None:
    torch.manual_seed(0)
    model = MaskedAttention(8)
    x = torch.randn(4, 64, 8)
    mask = model.mask(x)
    assert torch.isfinite(mask).all()
    assert not torch.isfinite(mask.sum(dtype=torch.float32))  # what a float32 check would see
    with graddebug.watch(model) as dbg:
        model(x).square().mean().backward()
        dbg.step()
    assert dbg.findings().empty, dbg.findings()["message"].tolist()
    assert dbg.events().empty
