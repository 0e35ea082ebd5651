"""Layer outputs as torch gives them: which tensors a (nested) output holds and how they are
named, which axis holds the units, and which modules a watch hooks by default."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor, nn

from graddebug.records import SEVERED_DETAIL

__all__ = ["CHANNELS_FIRST", "KEEPS_FINITE", "SEVERED_DETAIL", "WEIGHTED", "any_requires_grad",
           "fits", "flatten", "owns_params", "tensors", "unit_dim", "watched_by_default"]


KEEPS_FINITE: frozenset[type[nn.Module]] = frozenset({
    nn.Identity, nn.Flatten, nn.Unflatten,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.Sigmoid, nn.Tanh,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
})
"""Module types whose output is finite whenever their input is: clamps, monotone squashes,
masks and selections, and reshapes. Their forward finiteness check is dropped (a NaN or Inf
they pass on is named at the module that made it). Exact types: a subclass may override
``forward``. Averages, norms, softmax, exp and log keep theirs."""

WEIGHTED: frozenset[type[nn.Module]] = frozenset({
    nn.Linear, nn.Bilinear,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Embedding, nn.EmbeddingBag,
    nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
})
"""Module types whose output is fixed by their input and their own parameters and buffers
(affine maps, convolutions, lookups, normalisations with an epsilon): from a finite input they
can make Inf only by overflow and NaN not at all, so a NaN there was in their parameters. Exact
types, as for :data:`KEEPS_FINITE`."""

# Modules whose 3-D outputs are (batch, channels, length); other 3-D outputs are
# (batch, sequence, features) and their units lie on the last axis.
CHANNELS_FIRST: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.GroupNorm,
)


def unit_dim(ndim: int, channels_first: bool) -> int | None:
    """The axis of units (features, or channels for channels-first modules); None below 2-D."""
    if ndim < 2:
        return None
    if ndim == 2:
        return 1
    if ndim >= 4 or channels_first:
        return 1
    return ndim - 1


def flatten(value: Any, path: str = "output") -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in a (nested) tuple, list, dict or dataclass
    output; a dataclass field is named like a dict key (``output.field``)."""
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from flatten(item, f"{path}.{i}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from flatten(item, f"{path}.{key}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from flatten(getattr(value, f.name), f"{path}.{f.name}")


def tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor in a (nested) tuple, list or mapping: :func:`flatten` without the names
    and dataclasses, for the per-operation paths (value following, op capture)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(item)


def any_requires_grad(value: Any) -> bool:
    """Whether any tensor in ``value`` requires a gradient."""
    return any(t.requires_grad for _, t in flatten(value))


def owns_params(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters of its own (not only its children's)."""
    # Module._parameters directly: parameters(recurse=False) builds a generator chain per call.
    return any(p is not None for p in module._parameters.values())


def watched_by_default(module: nn.Module) -> bool:
    """Whether ``watch(model)`` without ``layers=`` watches ``module``: a leaf, or a module
    that holds parameters of its own (such as MultiheadAttention, whose out_proj is used
    functionally and never runs forward)."""
    return owns_params(module) or not any(True for _ in module.children())


def fits(out: Any, grad: Tensor) -> bool:
    """Whether an intervention's result can replace ``grad``."""
    return isinstance(out, Tensor) and out.shape == grad.shape
