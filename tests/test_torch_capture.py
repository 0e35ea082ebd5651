"""Captured gradients against torch.autograd.grad, and the adapter's edge cases."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from torch_models import ResCNN, batches, relu_mlp, tiny_transformer, train  # noqa: E402


def leaf_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if n and (not list(m.children()) or list(m.parameters(recurse=False)))]


def reference(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, np.ndarray]:
    """dL/d(output) of each named module, by autograd.grad, with no graddebug involved."""
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = []
    for name in names:
        def hook(module, args, out, name=name):
            if isinstance(out, tuple):
                out = out[0]
                key = f"{name}.output.0"
            else:
                key = name
            outputs[key] = out
        handles.append(modules[name].register_forward_hook(hook))
    try:
        loss = model(x).square().mean()
        keys = [k for k, t in outputs.items() if t.requires_grad]
        grads = torch.autograd.grad(loss, [outputs[k] for k in keys], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return {k: g.detach().numpy().copy() for k, g in zip(keys, grads, strict=True)
            if g is not None}


def captured(model: nn.Module, x: torch.Tensor, names: list[str]):
    with graddebug.watch(model, keep=names) as dbg:
        model(x).square().mean().backward()
        dbg.step()
    return dbg


MODELS = {
    "mlp": (lambda: relu_mlp(depth=4, width=16), (8, 32)),
    "cnn_bn": (ResCNN, (4, 3, 8, 8)),
    "transformer": (tiny_transformer, (3, 6, 32)),
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_activation_gradients_equal_autograd_grad(kind: str) -> None:
    build, shape = MODELS[kind]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(*shape)
    names = leaf_names(model)
    ref = reference(model, x, names)
    dbg = captured(model, x, names)
    kept = dbg.tensors(0)
    activations = {k: v for k, v in kept.items() if not k.endswith((".weight", ".bias"))
                   and "proj_" not in k}
    assert len(ref) >= 5
    assert set(ref) <= set(activations)
    for key, expected in ref.items():
        np.testing.assert_allclose(activations[key], expected, rtol=1e-6, atol=0, err_msg=key)
    frame = dbg.frame().set_index(["layer", "tensor"])
    for key, expected in ref.items():
        layer, _, part = key.partition(".output.")
        tensor = f"output.{part}" if part else "output"
        row = frame.loc[(layer, tensor)]
        flat = expected.astype(np.float64).ravel()
        assert row["norm"] == pytest.approx(np.linalg.norm(flat), rel=1e-5)
        assert row["mean"] == pytest.approx(flat.mean(), rel=1e-4, abs=1e-9)
        assert row["absmax"] == pytest.approx(np.abs(flat).max(), rel=1e-6)
        assert row["numel"] == flat.size


def test_frame_columns_follow_the_contract() -> None:
    model = relu_mlp(depth=2, width=4)
    with graddebug.watch(model) as dbg:
        model(torch.randn(2, 32)).sum().backward()
        dbg.step()
    assert list(dbg.frame().columns) == [
        "step", "layer", "tensor", "kind", "depth", "shape", "numel", "norm", "mean", "std",
        "absmax", "zero_frac", "nan", "inf", "rank", "weight_norm", "update_norm",
        "clipped_norm"]
    assert list(dbg.findings().columns) == [
        "step", "layer", "tensor", "issue", "severity", "value", "threshold", "message", "rank",
        "source", "cause"]
    assert set(dbg.frame()["rank"]) == {0}  # one process
    depths = dbg.frame().drop_duplicates("layer").set_index("layer")["depth"]
    assert list(depths.sort_values().index) == ["0", "1", "2"]  # forward order


@pytest.mark.parametrize("every", [1, 3])  # 3: hooks taken off and put back between steps
def test_no_observer_effect_bitwise_identical_weights(every: int) -> None:
    torch.manual_seed(0)
    base = relu_mlp(depth=4, width=32, inplace=True)
    plain, watched = copy.deepcopy(base), copy.deepcopy(base)
    data = batches(20, (16, 32))
    train(plain, data)
    with graddebug.watch(watched, every=every) as dbg:
        train(watched, data, dbg)
    assert len(dbg.frame()) > 0
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def hook_count(model: nn.Module) -> int:
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        n += len(p._backward_hooks or {})
    return n


def test_everything_is_removed_on_exit_also_after_an_exception() -> None:
    model = relu_mlp(depth=3, width=8)
    model.train()
    assert hook_count(model) == 0
    out = None
    with pytest.raises(RuntimeError, match="boom"), graddebug.watch(model) as dbg:
        model.eval()
        out = model(torch.randn(2, 32))
        assert hook_count(model) > 0
        assert out._backward_hooks
        raise RuntimeError("boom")
    assert hook_count(model) == 0
    assert not out._backward_hooks
    assert model.training  # restored
    assert not dbg.active
    with graddebug.watch(model) as again:  # a second watch works
        model(torch.randn(2, 32)).sum().backward()
        again.step()
    assert len(again.frame()) > 0
    assert hook_count(model) == 0


def test_inplace_relu_gives_the_pre_activation_gradient() -> None:
    torch.manual_seed(0)
    inplace = relu_mlp(depth=3, width=8, inplace=True)
    plain = relu_mlp(depth=3, width=8)
    plain.load_state_dict(inplace.state_dict())
    x = torch.randn(6, 32)
    names = leaf_names(plain)
    ref = reference(plain, x, names)
    kept = captured(inplace, x, names).tensors(0)
    for key, expected in ref.items():
        np.testing.assert_allclose(kept[key], expected, rtol=1e-6, err_msg=key)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(torch.tanh(self.shared(x))))


def test_module_called_twice_pools_both_calls_into_one_row() -> None:
    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(3, 4)
    # Independent reference: run the same computation by hand.
    a = model.shared(x)
    b = model.shared(torch.tanh(a))
    ga, gb = torch.autograd.grad(model.head(b).sum(), [a, b])
    with graddebug.watch(model, keep=["shared"]) as dbg:
        model(x).sum().backward()
        dbg.step()
    row = dbg.frame().query("layer == 'shared' and kind == 'activation'")
    assert len(row) == 1
    expected = np.sqrt(ga.square().sum().item() + gb.square().sum().item())
    assert row["norm"].item() == pytest.approx(expected, rel=1e-5)
    assert row["numel"].item() == 24
    kept = dbg.tensors(0)
    # backward visits the second call first
    np.testing.assert_allclose(kept["shared"], gb.numpy(), rtol=1e-6)
    np.testing.assert_allclose(kept["shared#1"], ga.numpy(), rtol=1e-6)


class Multi(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = SplitLayer()
        self.dicty = DictLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(x)
        d = self.dicty(a)
        return (d["left"] * 2 + d["right"] * 3).sum() + b.sum()


class SplitLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 6)

    def forward(self, x):
        y = self.lin(x)
        return y[:, :3], y[:, 3:]


class DictLayer(nn.Module):
    def forward(self, x):
        return {"left": x * 1.0, "right": x * 1.0, "mask": x > 0}


def test_tuple_and_dict_outputs_get_one_row_per_tensor() -> None:
    model = Multi()
    x = torch.randn(4, 3)
    with graddebug.watch(model, layers=["split", "dicty"]) as dbg:
        model(x).backward()
        dbg.step()
    acts = dbg.frame().query("kind == 'activation'")
    tensors = set(zip(acts["layer"], acts["tensor"], strict=True))
    assert tensors == {("split", "output.0"), ("split", "output.1"),
                       ("dicty", "output.left"), ("dicty", "output.right")}
    norms = acts.set_index("tensor")["norm"]
    assert norms["output.left"] == pytest.approx(2 * np.sqrt(12))
    assert norms["output.right"] == pytest.approx(3 * np.sqrt(12))
    assert norms["output.1"] == pytest.approx(np.sqrt(12))


def test_frozen_layers_and_no_grad_regions() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=3, width=8)
    for p in model[0].parameters():
        p.requires_grad_(False)
    with graddebug.watch(model) as dbg:
        with torch.no_grad():
            model(torch.randn(2, 32))  # evaluation: records nothing
        model(torch.randn(2, 32)).sum().backward()
        dbg.step()
    frame = dbg.frame()
    params = frame[frame["kind"] == "parameter"]
    assert "0" not in set(params["layer"])  # frozen: not a watched parameter
    assert set(params["layer"]) == {"2", "4"}
    # the frozen first layer's output does not require grad: no activation row, no finding
    assert "0" not in set(frame["layer"])
    assert dbg.findings().empty
    assert dbg.events().empty


def test_gradient_accumulation_pools_micro_batches_and_reads_accumulated_params() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=2, width=4)
    xs = [torch.randn(3, 32) for _ in range(3)]
    with graddebug.watch(model) as dbg:
        for x in xs:
            model(x).sum().backward()
        dbg.step()
    frame = dbg.frame()
    assert frame["step"].unique().tolist() == [0]
    weight = frame.query("layer == '0' and tensor == 'weight'")["norm"].item()
    assert weight == pytest.approx(model[0].weight.grad.norm().item(), rel=1e-5)
    out_rows = frame.query("layer == '2' and tensor == 'output'")
    assert len(out_rows) == 1
    assert out_rows["numel"].item() == 3 * 3 * 10  # three micro-batches


def test_retain_graph_backward_twice() -> None:
    model = relu_mlp(depth=2, width=4)
    with graddebug.watch(model) as dbg:
        loss = model(torch.randn(3, 32)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        dbg.step()
    row = dbg.frame().query("layer == '2' and tensor == 'output'")
    # d(sum)/d(out) is all ones, twice
    assert row["norm"].item() == pytest.approx(np.sqrt(2 * 30))


def test_eval_mode_and_step_after_zero_grad() -> None:
    model = relu_mlp(depth=2, width=4).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graddebug.watch(model) as dbg:
        model(torch.randn(3, 32)).sum().backward()
        expected = model[0].weight.grad.norm().item()
        opt.step()
        opt.zero_grad()  # set_to_none: p.grad is None before step()
        dbg.step()
    assert not model.training
    row = dbg.frame().query("layer == '0' and tensor == 'weight'")
    assert row["norm"].item() == pytest.approx(expected, rel=1e-5)
    assert dbg.findings().empty


def test_every_n_records_one_step_in_n() -> None:
    model = relu_mlp(depth=2, width=4)
    with graddebug.watch(model, every=3) as dbg:
        train(model, batches(7, (4, 32)), dbg)
    assert sorted(dbg.frame()["step"].unique()) == [0, 3, 6]


def test_layers_by_name_glob_and_type() -> None:
    model = ResCNN()
    x = torch.randn(2, 3, 8, 8)

    def layers_of(spec):
        with graddebug.watch(model, layers=spec, outputs=True) as dbg:
            model(x).sum().backward()
            dbg.step()
        return set(dbg.frame().query("kind == 'activation'")["layer"])

    assert layers_of(["head"]) == {"head"}
    assert layers_of("block1.*") == {"block1.conv1", "block1.bn1", "block1.relu",
                                     "block1.conv2", "block1.bn2"}
    assert layers_of([nn.Conv2d]) == {"stem", "block1.conv1", "block1.conv2",
                                      "block2.conv1", "block2.conv2"}
    assert layers_of(["block2"]) == {"block2"}  # a container's own output


def test_outputs_false_records_parameters_only() -> None:
    model = relu_mlp(depth=3, width=8)
    with graddebug.watch(model, outputs=False) as dbg:
        model(torch.randn(2, 32)).sum().backward()
        dbg.step()
    frame = dbg.frame()
    assert set(frame["kind"]) == {"parameter"}
    assert list(frame.drop_duplicates("layer")["depth"]) == [0, 2, 4]


def test_exit_closes_an_open_step() -> None:
    model = relu_mlp(depth=2, width=4)
    with graddebug.watch(model) as dbg:
        model(torch.randn(2, 32)).sum().backward()
    assert set(dbg.frame()["step"]) == {0}
    assert (dbg.frame()["kind"] == "parameter").any()


def test_zero_frac_counts_dead_units_not_entries() -> None:
    lin = nn.Linear(4, 6)
    with torch.no_grad():
        lin.bias.copy_(torch.tensor([-100.0, -100.0, -100.0, -100.0, 0.0, 0.0]))
        lin.weight.mul_(0.01)
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(6, 1))
    with graddebug.watch(model) as dbg:
        model(torch.randn(16, 4)).sum().backward()
        dbg.step()
    row = dbg.frame().query("layer == '0' and tensor == 'output'")
    assert row["zero_frac"].item() == pytest.approx(4 / 6)


def test_float64_models_are_captured_in_float64() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=2, width=4).double()
    x = torch.randn(3, 32, dtype=torch.float64)
    names = leaf_names(model)
    ref = reference(model, x, names)
    dbg = captured(model, x, names)
    assert dbg.findings().empty
    frame = dbg.frame().set_index(["layer", "tensor"])
    for key, expected in ref.items():
        np.testing.assert_array_equal(dbg.tensors(0)[key], expected)
        assert frame.loc[(key, "output"), "norm"] == pytest.approx(
            np.linalg.norm(expected), rel=1e-12)


def test_gradient_clipped_in_place_before_step_keeps_its_norm_before_the_clip() -> None:
    torch.manual_seed(0)
    model = relu_mlp(depth=2, width=4)
    with graddebug.watch(model) as dbg:
        model(torch.randn(3, 32)).sum().mul(100).backward()
        before = {name: p.grad.norm().item() for name, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        after = {name: p.grad.norm().item() for name, p in model.named_parameters()}
        dbg.step()
    params = dbg.frame().query("kind == 'parameter'")
    got = {f"{r.layer}.{r.tensor}": r.norm for r in params.itertuples()}
    clipped = {f"{r.layer}.{r.tensor}": r.clipped_norm for r in params.itertuples()}
    assert got == pytest.approx(before, rel=1e-5)
    assert clipped == pytest.approx(after, rel=1e-5)
    assert sum(v**2 for v in clipped.values()) == pytest.approx(0.25, rel=1e-4)


def test_parameter_gradients_are_read_as_they_are_when_the_step_closes() -> None:
    # A change through .data bumps no version counter that autograd or a hook could see;
    # the rows still hold the gradients as step() finds them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4))
    with graddebug.watch(model) as dbg:
        model(torch.randn(8, 128)).square().sum().backward()
        before = {name: p.grad.norm().item() for name, p in model.named_parameters()}
        for p in model.parameters():
            p.grad.data.mul_(0.25)
        expected = {name: torch.linalg.vector_norm(p.grad).item()
                    for name, p in model.named_parameters()}
        dbg.step()
    params = dbg.frame().query("kind == 'parameter'")
    got = {f"{r.layer}.{r.tensor}": r.norm for r in params.itertuples()}
    assert got == pytest.approx(expected, rel=1e-5)
    assert got["0.weight"] == pytest.approx(before["0.weight"] / 4, rel=1e-5)


def test_the_default_selection_is_leaves_and_modules_that_own_parameters():
    from graddebug_torch.outputs import watched_by_default

    attention = nn.MultiheadAttention(8, 2)  # holds in_proj_weight; out_proj never runs forward
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    model = nn.ModuleDict({"attention": attention, "block": block})
    picked = {name for name, m in model.named_modules() if watched_by_default(m)}
    assert picked == {"attention", "attention.out_proj", "block.0", "block.1"}
