"""Capabilities as data: each adapter class declares the capabilities it has, and the
declaration is checked against the class when the first adapter of it is built, as pluggy's
``_verify_hook`` checks a hook implementation: a missing method, a signature the Watcher cannot
call, and an implemented capability left undeclared each raise a typed error naming the class
and the method."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

import graddebug
from graddebug.adapter import (
    BaseAdapter,
    Distributed,
    GradientSource,
    SessionGraphs,
    StepClock,
    TrainingCallback,
    TrainStep,
)
from graddebug.adapter.capabilities import (
    CAPABILITIES,
    capabilities_of,
    protocol_methods,
    verify_adapter,
)
from graddebug.errors import AdapterContractError, GradDebugError
from graddebug.plugins import new_plugin_manager
from test_adapter_protocol import small_model, tg

ADAPTERS = {
    "torch": ("graddebug_torch.adapter", "TorchAdapter", "torch"),
    "tensorflow": ("graddebug_tensorflow.adapter", "TensorFlowAdapter", "tensorflow"),
    "tf1": ("graddebug_tensorflow.v1graph", "V1GraphAdapter", "tensorflow"),
    "jax": ("graddebug_jax.adapter", "JaxAdapter", "flax.nnx"),
    "keras-torch": ("graddebug_keras.torch_backend", "KerasTorchAdapter", "torch"),
    "keras-jax": ("graddebug_keras.jax_backend", "KerasJaxAdapter", "flax.nnx"),
}


def adapter_class(key: str) -> type:
    module, name, needs = ADAPTERS[key]
    pytest.importorskip(needs)
    cls: type = getattr(importlib.import_module(module), name)
    return cls


@pytest.mark.parametrize("key", list(ADAPTERS))
def test_each_adapter_declares_exactly_what_it_implements(key: str) -> None:
    cls = adapter_class(key)
    declared = verify_adapter(cls)
    assert declared == cls.capabilities  # type: ignore[attr-defined]
    # The declaration is what the runtime protocols find on the class, no more, no less.
    structural = {c for c in CAPABILITIES
                  if all(callable(getattr(cls, m, None)) for m in protocol_methods(c))}
    assert declared == structural


def test_the_two_training_capabilities_are_apart_where_a_framework_has_no_fit_loop() -> None:
    jax_adapter = adapter_class("jax")
    assert TrainStep in capabilities_of(jax_adapter)
    assert TrainingCallback not in capabilities_of(jax_adapter)
    assert not hasattr(jax_adapter, "callback")


def test_the_toy_adapter_declares_its_step_clock() -> None:
    assert capabilities_of(tg.ToyAdapter) == {StepClock}


def _stub(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _toy(name: str, **members: Any) -> type:
    return type(name, (tg.ToyAdapter,), members)


def test_a_declared_capability_without_its_method_names_the_class_and_the_method() -> None:
    cls = _toy("NoSource", capabilities=frozenset({StepClock, GradientSource}))
    with pytest.raises(AdapterContractError, match=r"NoSource declares GradientSource but has "
                                                   r"no method take_gradients\(\)"):
        verify_adapter(cls)


def test_an_implemented_capability_left_undeclared_is_refused() -> None:
    def distribution(self: Any) -> Any:
        return None

    cls = _toy("Undeclared", distribution=distribution)
    with pytest.raises(AdapterContractError,
                       match=r"Undeclared implements distribution\(\) but does not declare "
                             r"Distributed"):
        verify_adapter(cls)
    declared = _toy("Declared", distribution=distribution,
                    capabilities=frozenset({StepClock, Distributed}))
    assert verify_adapter(declared) == {StepClock, Distributed}


@pytest.mark.parametrize(("method", "impl", "why"), [
    ("follow_optimizer", lambda self, optimizer: None, "no parameter 'on_step' at position 2"),
    ("follow_optimizer", lambda self, opt, on_step: None, "no parameter 'optimizer'"),
    ("follow_optimizer", lambda self, optimizer, on_step, lr: None, "requires 'lr'"),
    ("close_step", lambda self, step, grads: None, "no parameter 'record'"),
], ids=["missing", "renamed", "extra", "adapter-protocol"])
def test_a_signature_the_watcher_cannot_call_names_the_method(method: str, impl: Any,
                                                              why: str) -> None:
    cls = _toy("Odd", **{method: impl})
    with pytest.raises(AdapterContractError, match=rf"Odd\.{method} (has )?{why}"):
        verify_adapter(cls)


def test_signatures_the_watcher_can_call_pass() -> None:
    cls = _toy("Loose", follow_optimizer=_stub,
               close_step=lambda self, step, grads, record, extra=None: None)
    assert verify_adapter(cls) == {StepClock}


def test_a_declared_capability_that_is_no_capability_is_refused() -> None:
    cls = _toy("Odd", capabilities=frozenset({StepClock, BaseAdapter}))
    with pytest.raises(AdapterContractError, match=r"Odd declares .*BaseAdapter.*no capability"):
        verify_adapter(cls)


def test_a_declared_option_that_is_no_adapter_option_is_refused() -> None:
    cls = _toy("Odd", watch_options=frozenset({"keep", "every", "opps"}))
    with pytest.raises(AdapterContractError, match=r"\['every', 'opps'\].*no adapter options"):
        verify_adapter(cls)


def test_an_adapter_without_declarations_is_taken_at_its_methods() -> None:
    cls = type("Bare", (), {m: _stub for m in (
        "attach", "detach", "tap", "has_pending", "close_step", "matched_names", "known_names",
        "fetches", "session_hook")})
    assert verify_adapter(cls) == {SessionGraphs}


def test_the_watcher_checks_the_adapter_when_it_is_built() -> None:
    broken = _toy("Broken", capabilities=frozenset({StepClock, TrainStep}))

    class Plugin:
        @graddebug.hookimpl
        def graddebug_adapter(self, target: object) -> Any:
            return broken if isinstance(target, tg.Module) else None

    pm = new_plugin_manager(entry_points=False)
    pm.register(Plugin())
    model = small_model()
    with pytest.raises(AdapterContractError, match=r"Broken declares TrainStep"), \
            graddebug.watch(model, plugin_manager=pm):
        pass
    assert not any(m._forward_hooks for _, m in model.named_modules())
    assert issubclass(AdapterContractError, GradDebugError)
    assert issubclass(AdapterContractError, TypeError)
