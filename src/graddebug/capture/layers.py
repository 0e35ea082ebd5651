"""What every adapter shares about the layers it watches: which layers (``layers=``), what is
known of each (:class:`LayerSpec`), the labels of kept gradients, the interventions and their
mask check, and the one fail-open rule for hooks.

Adapters apply an :class:`Intervention` in a fixed, documented order: mask, then scale, then
clip by value, then clip by norm. Clipping by norm rescales the gradient ``g`` to
``g * min(1, clip_norm / ||g||)``, with no epsilon, so the result can be checked exactly.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from graddebug.config import as_number
from graddebug.errors import (
    ConfigError,
    GradDebugError,
    MaskShapeError,
    UnknownNameError,
    close_matches,
)

__all__ = [
    "FailOpen",
    "Intervention",
    "LayerSpec",
    "display_path",
    "fail_open",
    "intervene_fail_open",
    "is_op_site",
    "keep_label",
    "op_site_matches",
    "parse_interventions",
    "select_layers",
]

OnBug = Callable[[BaseException, str], None]
"""``on_bug(exc, where)``: records a bug caught inside a hook (``WatchContext.internal_error``)."""


class FailOpen:
    """The fail-open rule of every hook, as a context manager.

    A bug of graddebug's (any ``Exception`` that is not a :class:`GradDebugError`) must never
    stop the user's training: it is handed to ``on_bug`` and swallowed, and the hook's caller
    goes on. A :class:`GradDebugError` is the user's mistake (a mask that does not fit, a wrong
    gradient count) and propagates, as do ``KeyboardInterrupt`` and other non-``Exception``
    errors.

    Args:
        on_bug: Where a caught bug goes.
        where: The hook or layer, for the finding's message.
    """

    __slots__ = ("_on_bug", "_where")

    def __init__(self, on_bug: OnBug, where: str) -> None:
        self._on_bug = on_bug
        self._where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is None or isinstance(exc, GradDebugError) or not isinstance(exc, Exception):
            return False
        self._on_bug(exc, self._where)
        return True


fail_open = FailOpen
"""``with fail_open(on_bug, where): ...``: see :class:`FailOpen`."""


@dataclass
class LayerSpec:
    """A watched layer, tap or ``params=`` entry, and what is known of it.

    Attributes:
        name: The ``layer`` value of its rows.
        channels_first: Its outputs are (batch, channels, ...), so units lie on axis 1.
        keep: Its full gradients are kept (``keep=``).
        intervention: What to do to the gradient at its output, if anything.
        capture: Record the gradient at its outputs (False: its parameters only).
        depth: Forward-order index, set at its first forward (-1 until then).
        mask_checked: The intervention's mask was checked against an output already.
        check_forward: Check its outputs for NaN/Inf in the forward pass. False for layers
            that cannot make a non-finite value from finite inputs (ReLU, dropout, max
            pooling, reshapes): a NaN or Inf they pass on is named at the layer that made it.
        weighted: Its output is fixed by its input and its own parameters (an affine map, a
            convolution, a lookup, a normalisation): a NaN it makes from a finite input was in
            its parameters.
    """

    name: str
    channels_first: bool = False
    keep: bool = False
    intervention: Intervention | None = None
    capture: bool = True
    depth: int = -1
    mask_checked: bool = False
    check_forward: bool = True
    weighted: bool = False

    def check_mask(self, mask: Any, target: Sequence[int | None], is_tensor: bool) -> None:
        """Check, at the first forward, that a mask tensor broadcasts to the output's gradient.

        Args:
            mask: The mask given in ``intervene=`` or ``tap(mask=...)``.
            target: The output's shape (None for a dimension known only at run time).
            is_tensor: Whether ``mask`` is a tensor type the framework accepts.

        Raises:
            MaskShapeError: It does not fit; the message names the layer and both shapes.
        """
        if self.mask_checked:
            return
        shape = tuple(getattr(mask, "shape", ()))
        if not is_tensor or not _broadcasts(shape, tuple(target)):
            raise MaskShapeError(
                f"the mask for {self.name!r} has shape {shape} but the gradient there has "
                f"shape {tuple(target)}; give a tensor that broadcasts to it (e.g. shape "
                "(1, features)) or a callable grad -> grad."
            )
        self.mask_checked = True


def _broadcasts(shape: tuple[Any, ...], target: tuple[Any, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without changing it."""
    if len(shape) > len(target):
        return False
    return all(have in (1, want) or want is None
               for have, want in zip(reversed(shape), reversed(target), strict=False))


def keep_label(layer: str, tensor: str, call: int = 0) -> str:
    """The key of a kept gradient in ``Watcher.tensors()``.

    ``"fc1"`` for a layer output, ``"fc1.output.0"`` for part of a tuple output,
    ``"fc1.weight"`` for a parameter; the second call of a layer in one step adds ``"#1"``.
    """
    label = layer if tensor == "output" else f"{layer}.{tensor}"
    return f"{label}#{call}" if call else label


OP_SITE_MARK = "@"
"""What sets an op site's name apart from a layer's: the op site of ``torch.log`` called at line
42 of ``model.py`` in module ``block`` is named ``block.torch.log@model.py:42`` (its rows have
``layer="block"`` and ``tensor="torch.log@model.py:42"``)."""


@functools.cache
def display_path(filename: str) -> str:
    """A source file as an op site's ``source`` shows it: relative to the working directory
    when it lies under it, else as given."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if relative.startswith(os.pardir) else relative


def is_op_site(name: object) -> bool:
    """Whether a ``layers=``, ``keep=`` or ``intervene=`` entry names op sites, not layers."""
    return isinstance(name, str) and OP_SITE_MARK in name


def op_site_matches(label: str, patterns: Iterable[str]) -> list[str]:
    """The op-site names or globs among ``patterns`` that match the op site ``label``
    (``block.torch.log@model.py:42``, see :func:`keep_label`)."""
    return [p for p in patterns if p == label or fnmatch.fnmatchcase(label, p)]


@dataclass(frozen=True)
class Intervention:
    """What to do to one gradient before it flows on.

    Attributes:
        clip_value: Clamp every entry to ``[-clip_value, clip_value]``.
        clip_norm: Rescale so that the L2 norm is at most ``clip_norm``.
        mask: A boolean or 0/1 tensor that broadcasts to the gradient (entries where it is
            False/0 are zeroed), or a callable ``grad -> grad`` of the same shape.
        scale: Multiply the gradient by this factor.
    """

    clip_value: float | None = None
    clip_norm: float | None = None
    mask: Any = None
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("clip_value", "clip_norm", "scale"):
            value = getattr(self, name)
            if value is None:
                continue
            number = as_number(value)
            positive = name != "scale"
            if number is None or not math.isfinite(number) or (positive and number <= 0):
                kind = "a positive finite number" if positive else "a finite number"
                raise ConfigError(f"{name}={value!r} must be {kind}.")
            # A plain float: numpy scalars (np.float32) would change the dtype of the
            # framework's arithmetic, and the value goes into the run's JSON file.
            object.__setattr__(self, name, float(number))

    @property
    def active(self) -> bool:
        """Whether this intervention changes anything."""
        return any(v is not None for v in (self.clip_value, self.clip_norm, self.mask, self.scale))

    @property
    def mask_is_callable(self) -> bool:
        """Whether ``mask`` is a function of the gradient rather than a tensor."""
        return callable(self.mask)


_FIELDS = ("clip_value", "clip_norm", "mask", "scale")


def parse_interventions(spec: Mapping[str, Any] | None) -> dict[str, Intervention]:
    """Validate ``intervene={name: {"clip_norm": 1.0, ...}}`` into Intervention objects.

    Args:
        spec: Mapping from a layer or tap name to a dict of intervention options, or to an
            :class:`Intervention`.

    Returns:
        A dict from name to Intervention.

    Raises:
        ConfigError: The spec is not a mapping, an option is unknown, or a value is unusable.
    """
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"intervene={spec!r} must map layer names to options, "
            'for example {"fc1": {"clip_norm": 1.0}}.'
        )
    out: dict[str, Intervention] = {}
    for name, options in spec.items():
        if isinstance(options, Intervention):
            out[name] = options
            continue
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"intervene[{name!r}]={options!r} must be a dict such as {{'clip_norm': 1.0}}."
            )
        for key in options:
            if key not in _FIELDS:
                raise ConfigError(
                    f"unknown intervention {key!r} for {name!r}.{close_matches(key, _FIELDS)} "
                    f"Known: {', '.join(_FIELDS)}."
                )
        out[name] = Intervention(**dict(options))
    return out


G = TypeVar("G")


def intervene_fail_open(
    spec: Intervention,
    name: str,
    grad: G,
    apply: Callable[[G, Intervention], G],
    fits: Callable[[Any, G], bool],
    on_bug: Callable[[BaseException, str], None],
) -> G:
    """Apply ``spec`` to ``grad`` with the policy every adapter follows.

    A bug of graddebug's lets the gradient flow on unaltered and is handed to ``on_bug``
    (fail-open). A mask callable is the user's code: its exception propagates, and a result
    that does not fit the gradient raises.

    Args:
        spec: The intervention.
        name: The layer or tap, for messages.
        grad: The gradient.
        apply: The framework's implementation, ``apply(grad, spec)``.
        fits: Whether a result has the gradient's type and shape, ``fits(out, grad)``.
        on_bug: Records a bug caught here (``WatchContext.internal_error``).

    Raises:
        MaskShapeError: The mask callable returned something of another shape.
    """
    if spec.mask_is_callable:
        out = apply(grad, spec)  # the user's own mask function: its failure is theirs to see
    else:
        applied: list[G] = []
        with FailOpen(on_bug, name):
            applied.append(apply(grad, spec))
        if not applied:  # graddebug's bug: the gradient flows on unaltered
            return grad
        out = applied[0]
    if not fits(out, grad):
        got = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
        raise MaskShapeError(
            f"the mask callable for {name!r} returned {got} for a gradient of shape "
            f"{tuple(getattr(grad, 'shape', ()))}; it must return a tensor of the same shape."
        )
    return out


T = TypeVar("T")


def select_layers(named: Mapping[str, T], layers: Sequence[Any], *, noun: str,
                  owner: str) -> dict[str, T]:
    """The entries of ``named`` that ``layers=`` asks for, in the order asked.

    Args:
        named: Every layer of the model by its name.
        layers: Names, globs (``"encoder.*"``) or types.
        noun: What a layer is called in this framework (``"module"``, ``"layer"``).
        owner: The model's class name, for messages.

    Raises:
        UnknownNameError: An entry matches nothing; the message lists close names.
        ConfigError: An entry is neither a string nor a type.
    """
    selected: dict[str, T] = {}
    for spec in layers:
        if isinstance(spec, type):
            hits = {n: layer for n, layer in named.items() if isinstance(layer, spec)}
            what = f"layers= type {spec.__name__}"
        elif isinstance(spec, str) and any(c in spec for c in "*?["):
            hits = {n: layer for n, layer in named.items() if fnmatch.fnmatchcase(n, spec)}
            what = f"layers= pattern {spec!r}"
        elif isinstance(spec, str):
            hits = {spec: named[spec]} if spec in named else {}
            what = f"layers= name {spec!r}"
        else:
            raise ConfigError(
                f"layers= entry {spec!r} must be a {noun} name, a glob or a {noun} type."
            )
        if not hits:
            hint = close_matches(spec, named) if isinstance(spec, str) else ""
            raise UnknownNameError(
                f"{what} matches no {noun} of {owner}.{hint} "
                f"{noun.capitalize()}s: {', '.join(list(named)[:20])}."
            )
        selected.update(hits)
    return selected
