"""Watched parameters: which tensors, under which names, and their gradients at a step's close."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from graddebug.errors import ConfigError, GradientCountError
from graddebug_torch.distributed import is_sharded
from graddebug_torch.staging import SMALL_NUMEL
from graddebug_torch.wrappers import clean_name

__all__ = ["ParamRow", "TorchParam", "ancestors", "check_optimizer", "given_params",
           "model_params", "number_groups", "param_rows", "release_rows"]


@dataclass(slots=True)
class ParamRow:
    """A watched parameter at the close of a step (``sharded``: its gradient is a ``DTensor``,
    measured whole by :mod:`graddebug_torch.distributed`).

    One row per parameter lives as long as the adapter: each close fills in ``depth`` and
    ``grad`` and empties ``grad`` after (:func:`param_rows`), so that a model of many small
    layers allocates no object per parameter and step. ``group`` numbers the small parameters
    of one shape, dtype and device (-1 for the others), whose norms are taken in one batched
    pass.
    """

    layer: str
    tensor: str
    depth: int
    grad: Tensor | None
    keep: bool
    sharded: bool = False
    group: int = -1


@dataclass
class TorchParam:
    """A watched parameter (or ``params=`` tensor).

    Attributes:
        layer: The owning module's name (or the ``params=`` key).
        tensor: The short name (``"weight"``; the key for ``params=``).
        param: The tensor.
        owner_chain: The owner module's qualified name, then those of its ancestors.
        keep: Its full gradient is kept (``keep=`` names its layer).
        depth: Its depth, once its owner module ran forward (-1 until then).
        sharded: It is a ``DTensor`` (FSDP2's ``fully_shard``): each rank holds a slice, and
            its gradient is measured whole, over the ranks.
    """

    layer: str
    tensor: str
    param: Tensor
    owner_chain: tuple[str, ...]
    keep: bool = False
    depth: int = -1
    sharded: bool = False
    row: ParamRow = field(init=False, repr=False)
    """Its row at each step's close (see :class:`ParamRow`)."""

    def __post_init__(self) -> None:
        self.row = ParamRow(self.layer, self.tensor, -1, None, self.keep, self.sharded)


def ancestors(qualified: str) -> Iterator[str]:
    """``"a.b.c"``, ``"a.b"``, ``"a"``, then ``""`` (the root module)."""
    parts = qualified.split(".") if qualified else []
    for i in range(len(parts), -1, -1):
        yield ".".join(parts[:i])


def model_params(model: nn.Module, name_of: Callable[[str], str],
                 chosen: Collection[str] | None, keep: Collection[str]) -> list[TorchParam]:
    """The parameters of ``model``, or of the modules ``layers=`` chose (and their children).

    Args:
        model: The model.
        name_of: The layer name of a qualified module name (the root has the class name).
        chosen: Names of the selected modules; None for every parameter.
        keep: Layer names whose gradients are kept.
    """
    out = []
    for pname, param in model.named_parameters():
        path, _, short = pname.rpartition(".")
        owner = clean_name(path)
        chain = tuple(ancestors(owner))
        if chosen is not None and not any(name in chosen for name in chain):
            continue
        if is_lazy(param):
            raise ConfigError(
                f"parameter {pname!r} is not initialized yet (a lazy module such as "
                f"{type(model.get_submodule(path)).__name__} makes its parameters at its "
                "first forward); call the model once on a batch before watch(model), so that "
                "graddebug can hook every parameter."
            )
        layer = name_of(owner)
        out.append(TorchParam(layer, short, param, chain, keep=layer in keep,
                              sharded=is_sharded(param)))
    return out


def given_params(params: Mapping[str, Any], keep: Collection[str]) -> list[TorchParam]:
    """The ``params=`` tensors, checked.

    Raises:
        ConfigError: A value is not a leaf tensor that requires a gradient.
    """
    out = []
    for key, value in params.items():
        if not isinstance(value, Tensor):
            raise ConfigError(
                f"params[{key!r}] is a {type(value).__name__}, not a torch.Tensor."
            )
        if not value.is_leaf or not value.requires_grad:
            raise ConfigError(
                f"params[{key!r}] must be a leaf tensor with requires_grad=True, so that "
                f"its .grad is filled; for an intermediate tensor use tap(t, {key!r})."
            )
        out.append(TorchParam(key, key, value, (key,), keep=key in keep,
                              sharded=is_sharded(value)))
    return out


def number_groups(params: Sequence[TorchParam]) -> None:
    """Number the small parameters of one shape, dtype and device alike (``row.group``):
    their gradients' norms are taken in one batched pass a group when a step closes. A
    parameter moved or cast after this (``model.half()`` under ``watch``) only costs that
    pass: a group whose gradients no longer stack is measured one gradient at a time."""
    groups: dict[tuple[torch.Size, torch.dtype, torch.device], int] = {}
    for p in params:
        tensor = p.param
        if not p.sharded and tensor.numel() <= SMALL_NUMEL:
            key = (tensor.shape, tensor.dtype, tensor.device)
            p.row.group = groups.setdefault(key, len(groups))


def check_optimizer(optimizer: Any, params: Sequence[TorchParam]) -> torch.optim.Optimizer:
    """Check that ``optimizer`` is a torch optimizer holding at least one watched parameter.

    Raises:
        ConfigError: It is not, or it holds none of them.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer={optimizer!r} is a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer; pass the optimizer whose step() ends each training step."
        )
    if params:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not any(id(p.param) in held for p in params):
            watched = ", ".join(f"{p.layer}.{p.tensor}" for p in params[:5])
            raise ConfigError(
                f"optimizer={type(optimizer).__name__} holds none of the watched parameters "
                f"({watched}{', ...' if len(params) > 5 else ''}); pass the optimizer built "
                "from this model's parameters, e.g. torch.optim.SGD(model.parameters())."
            )
    return optimizer


def _check_given(position: int, param: TorchParam, grad: Any) -> None:
    """Check one gradient handed to ``step(grads)`` against its parameter.

    Raises:
        GradientCountError: It is not a tensor (nor None), or its shape or dtype differs from
            the parameter's: the list is in the wrong order or belongs to other parameters.
    """
    if grad is None:
        return
    where = f"step() gradient #{position} (for {param.layer}.{param.tensor})"
    if not isinstance(grad, Tensor):
        raise GradientCountError(
            f"{where} is a {type(grad).__name__}, not a torch.Tensor or None; pass the "
            "gradients in named_parameters() order, e.g. [p.grad for p in model.parameters()]."
        )
    expected = (tuple(param.param.shape), param.param.dtype)
    if (tuple(grad.shape), grad.dtype) != expected:
        raise GradientCountError(
            f"{where} has shape {tuple(grad.shape)} and dtype {grad.dtype}, but the parameter "
            f"has shape {expected[0]} and dtype {expected[1]}; the gradients must come in "
            "named_parameters() order (those with requires_grad=True), one per parameter."
        )


def param_rows(params: Sequence[TorchParam], received: Mapping[int, Tensor],
               grads: Sequence[Any] | None,
               depth_of: Callable[[TorchParam], int]) -> list[ParamRow]:
    """Every watched parameter that requires a gradient, with its gradient at the step's close.

    Args:
        params: The watched parameters.
        received: The gradients the post-accumulate hooks held, by index in ``params``: they
            stand in for a ``p.grad`` that ``zero_grad(set_to_none=True)`` cleared before the
            step closed.
        grads: Gradients handed to ``step(grads)``, or None to read ``p.grad``.
        depth_of: The depth of a parameter's layer.

    Returns:
        The parameters' own rows, filled in: :func:`release_rows` empties them after the close.

    Raises:
        GradientCountError: ``grads`` does not line up with the parameters.
    """
    if grads is not None:
        live = [p for p in params if p.param.requires_grad]
        grads = list(grads)
        if len(grads) != len(live):
            raise GradientCountError(
                f"step() got {len(grads)} gradients but {len(live)} parameters are "
                "watched (those with requires_grad=True, in named_parameters() order)."
            )
        for position, (p, g) in enumerate(zip(live, grads, strict=True)):
            _check_given(position, p, g)
        return [_fill(p, depth_of, g) for p, g in zip(live, grads, strict=True)]
    rows = []
    for i, p in enumerate(params):  # one pass: a large model closes tens of thousands a step
        param = p.param
        if not param.requires_grad:
            continue
        grad = param.grad
        rows.append(_fill(p, depth_of, grad if grad is not None else received.get(i)))
    return rows


def _fill(p: TorchParam, depth_of: Callable[[TorchParam], int],
          grad: Tensor | None) -> ParamRow:
    """``p``'s row, filled in for this step's close."""
    row = p.row
    row.depth = p.depth if p.depth >= 0 else depth_of(p)
    row.grad = grad
    return row


def release_rows(rows: Sequence[ParamRow]) -> None:
    """Let go of the gradients a step's rows held (they outlive the step)."""
    for row in rows:
        row.grad = None
