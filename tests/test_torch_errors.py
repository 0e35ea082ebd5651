"""Bad input gets a typed error that names the problem. That graddebug's own bugs fail open (an
internal_error and one warning; strict=True raises) is checked for every adapter by
tests/conformance."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402
from graddebug import (  # noqa: E402
    ConfigError,
    GradDebugError,
    GradDebugInternalError,
    GradientCountError,
    NoAdapterError,
    UnknownNameError,
    WatcherStateError,
)
from torch_models import ResCNN, relu_mlp  # noqa: E402


class NotAModel:
    pass


def test_non_model_object_lists_installed_adapters_and_install_hint() -> None:
    from graddebug.plugins import new_plugin_manager
    from graddebug_torch import plugin as torch_plugin

    pm = new_plugin_manager(entry_points=False)
    pm.register(torch_plugin, name="torch")
    with pytest.raises(NoAdapterError) as info, graddebug.watch(NotAModel(), plugin_manager=pm):
        pass
    text = str(info.value)
    assert "test_torch_errors.NotAModel" in text
    assert "Installed adapters: torch." in text
    assert "pip install graddebug[tensorflow]" in text  # the adapter this manager lacks
    assert isinstance(info.value, TypeError)


def test_step_outside_the_with_block() -> None:
    model = relu_mlp(depth=2, width=4)
    dbg = graddebug.watch(model)
    with pytest.raises(WatcherStateError, match="outside"):
        dbg.step()
    with dbg:
        pass
    with pytest.raises(WatcherStateError, match="outside"):
        dbg.step()


def test_tap_outside_the_with_block() -> None:
    with pytest.raises(WatcherStateError, match="'h'"):
        graddebug.watch().tap(torch.ones(2), "h")


@pytest.mark.parametrize("spec", ["block1.conv3", "blok1.*", nn.LSTM])
def test_unknown_layers_name_is_rejected_on_entry_with_suggestions(spec) -> None:
    model = ResCNN()
    with pytest.raises(UnknownNameError) as info, graddebug.watch(model, layers=[spec]):
        pytest.fail("must raise on entering")
    text = str(info.value)
    assert "matches no module" in text
    if spec == "block1.conv3":
        assert "Did you mean 'block1.conv1'" in text or "'block1.conv2'" in text
    assert hook_free(model)


def hook_free(model: nn.Module) -> bool:
    return all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("option", ["keep", "intervene"])
def test_unknown_keep_or_intervene_name_is_reported_on_exit_with_suggestions(option) -> None:
    model = relu_mlp(depth=2, width=4)
    value = ["fc1"] if option == "keep" else {"fc1": {"clip_norm": 1.0}}
    with pytest.raises(UnknownNameError, match="'fc1'") as info, \
            graddebug.watch(model, **{option: value}) as dbg:
        model(torch.randn(2, 32)).sum().backward()
        dbg.step()
    assert "Known names" in str(info.value)
    assert hook_free(model)


def test_keep_name_matching_a_tap_is_fine() -> None:
    x = torch.ones(3, requires_grad=True)
    with graddebug.watch(keep=["h"]) as dbg:
        h = dbg.tap(x * 2, "h")
        h.sum().backward()
        dbg.step()
    assert dbg.tensors(0)["h"].tolist() == [1.0, 1.0, 1.0]


def test_unknown_intervention_option() -> None:
    with pytest.raises(ConfigError, match="clip_norm"):
        graddebug.watch(relu_mlp(), intervene={"0": {"clip_nrm": 1.0}})


@pytest.mark.parametrize("bad", [{"exploding_norm": -1.0}, {"dead_fraction": 0}])
def test_negative_threshold(bad) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        graddebug.watch(relu_mlp(), thresholds=bad)


@pytest.mark.parametrize("options", [{"every": 0}, {"param_stats": "all"},
                                     {"params": [1, 2]}, {"params": {}}])
def test_bad_options(options) -> None:
    with pytest.raises(ConfigError):
        graddebug.watch(**options)


def test_non_leaf_params_entry() -> None:
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ConfigError, match="tap"), graddebug.watch(params={"h": x * 2}):
        pass


def test_wrong_gradient_count_names_both_lengths() -> None:
    model = relu_mlp(depth=2, width=4)
    with graddebug.watch(model) as dbg:
        model(torch.randn(2, 32)).sum().backward()
        with pytest.raises(GradientCountError, match=r"got 1 gradients but 4 parameters"):
            dbg.step([torch.zeros(1)])


def test_tensors_without_keep() -> None:
    model = relu_mlp(depth=2, width=4)
    with graddebug.watch(model) as dbg:
        model(torch.randn(2, 32)).sum().backward()
    with pytest.raises(WatcherStateError, match="keep="):
        dbg.tensors()


def test_all_errors_share_the_base_class() -> None:
    for cls in (ConfigError, NoAdapterError, UnknownNameError, WatcherStateError,
                GradientCountError, GradDebugInternalError):
        assert issubclass(cls, GradDebugError)


def test_a_lazy_module_not_yet_run_is_refused_and_watched_once_initialized() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"'0\.weight'.*LazyLinear.*once on a batch"):
        graddebug.watch(model).__enter__()
    x = torch.randn(3, 5)
    model(x)  # materializes the lazy parameters
    with graddebug.watch(model) as dbg:
        model(x).sum().backward()
        dbg.step()
    rows = dbg.frame().query("kind == 'parameter'").set_index(["layer", "tensor"])["norm"]
    assert rows[("0", "weight")] == pytest.approx(model[0].weight.grad.norm().item(), rel=1e-6)
