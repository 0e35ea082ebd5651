"""Capabilities and options as data: what an adapter class declares, checked against what it
implements.

An adapter class declares the capability protocols it implements and the ``watch`` options it
honours, as two class attributes::

    class ToyAdapter(BaseAdapter):
        capabilities = frozenset({StepClock})
        watch_options = frozenset({"params", "layers", "keep", "intervene", "outputs",
                                   "param_stats", "optimizer", "full_stats_every"})

The Watcher reads them rather than probing the adapter: it asks an adapter only for the
capabilities it declares, and refuses an option the adapter does not declare at ``watch()``
(:func:`graddebug.capture.capabilities.refuse_options`). The documentation's capability
table is generated from them.

The declaration is checked against the class once, when the first adapter of that class is
built, as pluggy's ``_verify_hook`` checks a hook implementation at registration
(:func:`verify_adapter`): a declared capability must have every method of its protocol, with a
signature the Watcher can call; a capability whose methods the class has in full must be
declared; so must the methods of :class:`~graddebug.adapter.protocol.Adapter`. Declaring
rather than deriving keeps the data readable without building an adapter, and the two-way check
keeps it true. A class with no ``capabilities`` attribute at all (an adapter that does not
subclass :class:`~graddebug.adapter.BaseAdapter`) is taken at its methods: its capabilities are
derived from them, and without ``watch_options`` it is not asked about options.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from graddebug.adapter.options import ADAPTER_OPTIONS
from graddebug.adapter.protocol import (
    Adapter,
    CompiledTiers,
    Distributed,
    GradientSource,
    ReadAhead,
    SessionGraphs,
    StepClock,
    TrainingCallback,
    TrainStep,
)
from graddebug.errors import AdapterContractError

__all__ = [
    "CAPABILITIES",
    "capabilities_of",
    "declared_options",
    "has",
    "option_table",
    "protocol_methods",
    "verify_adapter",
]

CAPABILITIES: tuple[type, ...] = (StepClock, GradientSource, Distributed, CompiledTiers,
                                  ReadAhead, TrainStep, TrainingCallback, SessionGraphs)
"""Every optional capability an adapter may declare, in the order the documentation lists
them."""

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


def protocol_methods(protocol: type) -> dict[str, Callable[..., Any]]:
    """The methods a protocol asks for, by name (those of its protocol bases included).

    Args:
        protocol: A protocol class of :mod:`graddebug.adapter.protocol`.

    Returns:
        Each public method's specification (the function defined on the protocol).
    """
    methods: dict[str, Callable[..., Any]] = {}
    for base in reversed(protocol.__mro__):
        if base in (object, Protocol) or not getattr(base, "_is_protocol", False):
            continue
        for name, value in vars(base).items():
            if not name.startswith("_") and inspect.isfunction(value):
                methods[name] = value
    return methods


def _owner(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _mismatch(spec: Callable[..., Any], impl: Any) -> str | None:
    """Why the Watcher could not call ``impl`` as it calls ``spec``; None when it can."""
    try:
        wanted = list(inspect.signature(spec).parameters.values())[1:]
        given = list(inspect.signature(impl).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin or a C method: nothing to read, nothing to refuse
    if isinstance(impl, (staticmethod, classmethod)) or not given:
        return "takes no self"
    given = given[1:]
    var_pos = any(p.kind is _P.VAR_POSITIONAL for p in given)
    var_kw = any(p.kind is _P.VAR_KEYWORD for p in given)
    positional = [p for p in given if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in given if p.kind is not _P.POSITIONAL_ONLY}
    for i, p in enumerate(wanted):
        if p.kind is _P.VAR_KEYWORD and not var_kw:
            return f"takes no **{p.name}"
        open_ended = var_pos and var_kw
        if p.kind in _POSITIONAL and not open_ended and (
                i >= len(positional) or positional[i].name != p.name):
            return f"has no parameter {p.name!r} at position {i + 1}"
        if p.kind is _P.KEYWORD_ONLY and p.name not in by_name and not var_kw:
            return f"takes no keyword {p.name!r}"
    names = {p.name for p in wanted}
    required = [p.name for p in given if p.default is _P.empty and p.name not in names
                and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)]
    if required:
        return f"requires {', '.join(map(repr, required))}, which the Watcher never passes"
    return None


def _shown(spec: Callable[..., Any]) -> str:
    """``name(parameters)`` of a protocol method as an adapter writes it (self left out)."""
    signature = inspect.signature(spec)
    shown = signature.replace(parameters=list(signature.parameters.values())[1:])
    return f"{spec.__name__}{shown}".replace("'", "")  # annotations are strings here


def _check_methods(cls: type, protocol: type, label: str) -> None:
    """Raise for a method of ``protocol`` that ``cls`` lacks or cannot be called as asked."""
    for name, spec in protocol_methods(protocol).items():
        impl = inspect.getattr_static(cls, name, None)
        if impl is None or not callable(getattr(cls, name, None)):
            raise AdapterContractError(
                f"{_owner(cls)} declares {label} but has no method {name}(); implement "
                f"{_shown(spec)} or leave {label} out of its capabilities.")
        why = _mismatch(spec, impl)
        if why is not None:
            raise AdapterContractError(
                f"{_owner(cls)}.{name} {why}: {label} calls it as {_shown(spec)}; give it "
                "that signature.")


def _implements(cls: type, protocol: type) -> bool:
    return all(callable(getattr(cls, name, None)) for name in protocol_methods(protocol))


@functools.cache
def verify_adapter(cls: type) -> frozenset[type]:
    """Check an adapter class's declaration against what it implements; return its
    capabilities.

    Args:
        cls: The adapter class (the type of a built adapter).

    Returns:
        The capabilities of :data:`CAPABILITIES` it has.

    Raises:
        AdapterContractError: A method of the ``Adapter`` protocol or of a declared capability
            is missing or has a signature the Watcher cannot call; a capability is declared
            that is none of :data:`CAPABILITIES`; or the class has every method of a
            capability it does not declare. The message names the class and the method.
    """
    _check_methods(cls, Adapter, "the Adapter protocol")
    declared = getattr(cls, "capabilities", None)
    if declared is None:
        derived = frozenset(c for c in CAPABILITIES if _implements(cls, c))
        for capability in derived:
            _check_methods(cls, capability, capability.__name__)
        return derived
    unknown = [c for c in declared if c not in CAPABILITIES]
    if unknown:
        raise AdapterContractError(
            f"{_owner(cls)} declares {unknown[0]!r}, which is no capability; declare some of "
            f"{', '.join(c.__name__ for c in CAPABILITIES)}.")
    for capability in CAPABILITIES:
        if capability in declared:
            _check_methods(cls, capability, capability.__name__)
        elif _implements(cls, capability):
            methods = ", ".join(f"{m}()" for m in protocol_methods(capability))
            raise AdapterContractError(
                f"{_owner(cls)} implements {methods} but does not declare "
                f"{capability.__name__}: add it to its capabilities, or rename the method.")
    _check_options(cls)
    return frozenset(declared)


def _check_options(cls: type) -> None:
    """Raise for a declared option that is no adapter option of ``watch``."""
    options = getattr(cls, "watch_options", None)
    if options is None:
        return
    unknown = sorted(set(options) - set(ADAPTER_OPTIONS))
    if unknown:
        raise AdapterContractError(
            f"{_owner(cls)} declares watch options {unknown}, which are no adapter options of "
            f"watch(); choose among {', '.join(ADAPTER_OPTIONS)}.")


def capabilities_of(cls: type) -> frozenset[type]:
    """The capabilities an adapter class has (declared and checked, see
    :func:`verify_adapter`)."""
    return verify_adapter(cls)


def has(adapter: object, capability: type) -> bool:
    """Whether a built adapter has ``capability`` (its class declares it, or, for a class with
    no declaration, implements it)."""
    cls: type = type(adapter)
    return capability in verify_adapter(cls)


def declared_options(factory: object) -> frozenset[str] | None:
    """The ``watch`` options an adapter factory (usually its class) declares it honours,
    beside those the Watcher honours itself; None where it declares nothing.

    Args:
        factory: An adapter class, a factory function, or a built adapter.
    """
    options = getattr(factory, "watch_options", None)
    if options is None:
        return None
    return frozenset(options)


def option_table(classes: Iterable[type]) -> dict[str, dict[str, bool]]:
    """For each adapter class, whether it honours each adapter option of ``watch`` (for the
    documentation's tables).

    Args:
        classes: Adapter classes.

    Returns:
        ``{class name: {option: honoured}}``.
    """
    return {cls.__name__: {n: n in (declared_options(cls) or ADAPTER_OPTIONS)
                           for n in ADAPTER_OPTIONS} for cls in classes}
