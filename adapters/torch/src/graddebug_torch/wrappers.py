"""The model behind its wrappers: DDP, FSDP, ``torch.compile`` and activation checkpointing.

Layer and parameter names are those of the unwrapped model, so that a distributed or compiled
run's frames line up with a single-process eager run of the same model.
"""

from __future__ import annotations

from torch import nn

__all__ = ["WRAPPER_PREFIXES", "class_name", "clean_name", "compiled", "unwrap"]

WRAPPER_PREFIXES: tuple[str, ...] = (
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "_orig_mod.",
)
"""Name parts that wrappers nested inside a model add to its qualified names (FSDP1,
``checkpoint_wrapper``, a compiled submodule)."""

_WRAPPED_NAMES = tuple(prefix[:-1] for prefix in WRAPPER_PREFIXES)


_CLASS_WRAPPERS = frozenset({"FSDPModule", "ReplicateModule", "DDP"})
"""Classes that ``fully_shard`` and the composable ``replicate`` mix into a module's class in
place: they make ``FSDP<Name>`` (or ``Replicate<Name>``, ``DDP<Name>``) from ``(wrapper,
<Name>)``."""


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside outer wrappers: ``DistributedDataParallel``, ``DataParallel`` and
    FSDP1's ``FullyShardedDataParallel`` (``.module``) and ``torch.compile``'s
    ``OptimizedModule`` (``._orig_mod``), however nested.

    FSDP2's ``fully_shard`` wraps nothing (it changes the module's class in place, see
    :func:`class_name`), and the name parts of FSDP1 wrappers inside the model are removed by
    :func:`clean_name`.
    """
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = _inner(model)
        if inner is None:
            return model
        model = inner
    return model


def compiled(model: nn.Module) -> bool:
    """Whether ``model`` runs compiled: it is, or wraps, ``torch.compile``'s
    ``OptimizedModule``, or a module on the way was compiled in place (``Module.compile()``)."""
    seen: set[int] = set()
    current: nn.Module | None = model
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if (type(current).__name__ == "OptimizedModule"
                or getattr(current, "_compiled_call_impl", None) is not None):
            return True
        current = _inner(current)
    return False


def _inner(model: nn.Module) -> nn.Module | None:
    kind = type(model).__name__
    if kind in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"):
        inner = getattr(model, "module", None)
    elif kind == "OptimizedModule":
        inner = getattr(model, "_orig_mod", None)
    else:
        return None
    return inner if isinstance(inner, nn.Module) else None


def class_name(module: nn.Module) -> str:
    """The name of ``module``'s own class, under the class that ``fully_shard`` or
    ``replicate`` swapped in (``FSDPSequential`` is a ``Sequential``)."""
    cls = type(module)
    while (len(cls.__bases__) == 2 and cls.__bases__[0].__name__ in _CLASS_WRAPPERS
           and cls.__name__.endswith(cls.__bases__[1].__name__)):
        cls = cls.__bases__[1]
    return cls.__name__


def clean_name(qualified: str) -> str:
    """``qualified`` without the name parts wrappers add inside a model.

    >>> clean_name("layers.0._fsdp_wrapped_module.attn._checkpoint_wrapped_module.proj")
    'layers.0.attn.proj'
    >>> clean_name("_orig_mod")
    ''
    """
    if "_" not in qualified:  # the common case: nothing to remove
        return qualified
    parts = [p for p in qualified.split(".") if p not in _WRAPPED_NAMES]
    return ".".join(parts)
