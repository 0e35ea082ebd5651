"""Naming an op's site: the user's frame behind each torch call, and the rows' names.

An op site is one call site of one operation in one module. Its rows carry ``layer`` = the
module it ran in, and ``tensor`` = ``<op>@<file>:<line>``, where the file and line are the
user's: the first frame outside torch and graddebug, taken once per site and cached. Two sites
that would share a name (two ``torch.add`` on one line) get ``:2``, ``:3`` appended. Sites are
told apart by the code object and instruction of their caller, so a loop over one site is one
site. torch's own dispatch frames, other modes' ``__torch_function__`` and graddebug's own
hooks are not user code: calls from graddebug pass through unrecorded.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import resolve_name

from graddebug.adapter import WatchOptions
from graddebug.capture.layers import (
    LayerSpec,
    display_path,
    is_op_site,
    keep_label,
    op_site_matches,
)

__all__ = ["CALLER", "DISPATCH", "OWN", "PASS_THROUGH", "OpSite", "Running", "SiteTable"]

# What a frame of the call stack is, for naming an op's site.
CALLER, DISPATCH, OWN = 0, 1, 2

PASS_THROUGH: frozenset[Any] = frozenset({
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.stride, Tensor.element_size,
    Tensor.is_floating_point, Tensor.is_complex, Tensor.get_device, Tensor.__len__,
    Tensor.is_contiguous, Tensor.data_ptr, Tensor.register_hook,
    Tensor.dtype.__get__, Tensor.shape.__get__, Tensor.device.__get__,  # type: ignore[attr-defined]
    Tensor.ndim.__get__, Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    Tensor.is_cuda.__get__, Tensor.layout.__get__,  # type: ignore[attr-defined]
    Tensor.is_nested.__get__, Tensor.is_sparse.__get__,  # type: ignore[attr-defined]
    Tensor._version.__get__, Tensor.grad_fn.__get__,  # type: ignore[attr-defined, union-attr]
})
"""Functions that name no op site: they read metadata only, or are what graddebug's own hooks
call most. The mode passes them through before any other work (they are most of the calls a
forward pass makes under a mode)."""


def _package_dir(name: str) -> str:
    """The folder of package ``name``, found without importing it (the core's path)."""
    spec = importlib.util.find_spec(name)
    origin = spec.origin if spec is not None else None
    return os.path.dirname(origin or "") + os.sep


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIRS = (_package_dir("graddebug"), _package_dir("graddebug_torch"))
# torch's files that only dispatch a call to the mode (Python wrappers of torch functions).
_DISPATCH_FILES = frozenset(os.path.join(_TORCH_DIR, f) for f in (
    "overrides.py", "_tensor.py", "functional.py", "_jit_internal.py",
    os.path.join("nn", "functional.py"),
))


@functools.cache
def _op_name(func: Callable[..., Any]) -> str:
    """``torch.log``, ``torch.Tensor.add``, ``torch.nn.functional.gelu``, ``torch.Tensor.data``."""
    own = getattr(func, "__name__", None)
    name = resolve_name(func) or (
        f"{getattr(func, '__module__', None) or 'torch'}."
        f"{getattr(func, '__qualname__', None) or own or 'op'}")
    where, _, last = name.rpartition(".")
    if own and last != own and where:  # an alias: torch.mm is also listed as torch.spmm
        name = f"{where}.{own}"
    return name.removesuffix(".__get__")


def _frame_kind(code: CodeType) -> int:
    """Whether a frame is the caller of an op, torch's dispatch, or graddebug's own code."""
    filename = code.co_filename
    if code.co_name == "__torch_function__" or filename in _DISPATCH_FILES:
        return DISPATCH
    if filename.startswith(_OWN_DIRS):
        return OWN
    return CALLER


def _is_library(code: CodeType) -> bool:
    """Whether a frame belongs to torch or graddebug rather than to the user's code."""
    return code.co_filename.startswith((_TORCH_DIR, *_OWN_DIRS)) or (
        code.co_name == "__torch_function__")


@dataclass(eq=False, slots=True)
class OpSite:
    """One call site of one operation in one module, with what its rows carry.

    Attributes:
        spec: Its layer entry for the adapter's hooks: ``name`` is the module it ran in,
            ``keep`` and ``intervention`` come from ``keep=`` and ``intervene=``.
        tensor: The ``tensor`` of its rows, ``<op>@<file>:<line>``.
        op: The operation, as torch names it (``torch.nn.functional.linear``).
        source: ``file:line`` of the user's code that ran it.
        depth: Forward-order index, from the adapter's shared count.
        captured: Whether its gradients are recorded (``layers=`` may leave it out).
    """

    spec: LayerSpec
    tensor: str
    op: str
    source: str
    depth: int
    captured: bool

    @property
    def key(self) -> tuple[str, str]:
        """The ``(layer, tensor)`` of its rows."""
        return self.spec.name, self.tensor

    def describe(self) -> str:
        """``torch.log in 'block' (model.py:42)``, for event details."""
        return f"{self.op} in {self.spec.name!r} ({self.source})"


# The module an op runs in: its name, whether ops in it are recorded, whether its outputs put
# units on axis 1.
Running = tuple[str, bool, bool]


class SiteTable:
    """The op sites of one watch, each named once and reused for every later call.

    Args:
        options: The ``watch`` options (``keep=``, ``intervene=`` and ``op_sites``).
        matched: The adapter's set of ``keep=``/``intervene=`` names that matched something;
            a new site adds the op-site names it matches.
        take_depth: Hands out the next forward-order depth, shared with the layers.

    Attributes:
        frames: What each code object seen on the stack is (:data:`CALLER`,
            :data:`DISPATCH` or :data:`OWN`), cached.
    """

    def __init__(self, options: WatchOptions, matched: set[str],
                 take_depth: Callable[[], int]) -> None:
        self._options = options
        self._matched = matched
        self._take_depth = take_depth
        self.frames: dict[CodeType, int] = {}
        self._sites: dict[tuple[str, Any, CodeType, int], OpSite] = {}
        self._taken: set[tuple[str, str]] = set()

    def caller(self, frame: FrameType | None) -> FrameType | None:
        """The frame that called the op, past torch's dispatch frames; None for graddebug.

        Args:
            frame: The frame that called into the op mode.

        Returns:
            The caller's frame, or None where graddebug's own code made the call.
        """
        kinds = self.frames
        while frame is not None:
            code = frame.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = kinds[code] = _frame_kind(code)
            if kind == CALLER:
                return frame
            if kind == OWN:
                return None
            frame = frame.f_back
        return None

    def site(self, func: Any, caller: FrameType, running: Running) -> OpSite:
        """The site of ``func`` called from ``caller`` in module ``running``.

        Args:
            func: The operation.
            caller: Its caller's frame (from :meth:`caller`).
            running: The module it runs in.

        Returns:
            The site, named at its first call.
        """
        key = (running[0], func, caller.f_code, caller.f_lasti)
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = self._new_site(func, caller, *running)
        return site

    def _new_site(self, func: Any, caller: FrameType, module: str, in_scope: bool,
                  channels_first: bool) -> OpSite:
        """Name a site: the user's file and line, the ``keep=``/``intervene=`` it matches."""
        user: FrameType | None = caller
        while user is not None and _is_library(user.f_code):
            user = user.f_back
        where = user if user is not None else caller
        filename, line = where.f_code.co_filename, where.f_lineno
        op = _op_name(func)
        tensor = f"{op}@{os.path.basename(filename)}:{line}"
        if (module, tensor) in self._taken:
            n = 2
            while (module, f"{tensor}:{n}") in self._taken:
                n += 1
            tensor = f"{tensor}:{n}"
        self._taken.add((module, tensor))
        options = self._options
        label = keep_label(module, tensor)
        keep = op_site_matches(label, [k for k in options.keep if is_op_site(k)])
        intervene = op_site_matches(label, [k for k in options.intervene if is_op_site(k)])
        chosen = op_site_matches(label, options.op_sites)
        self._matched.update(keep, intervene, chosen)
        spec = LayerSpec(name=module, channels_first=channels_first, keep=bool(keep),
                         intervention=options.intervene[intervene[0]] if intervene else None,
                         depth=self._take_depth())
        return OpSite(spec, tensor, op, f"{display_path(filename)}:{line}", spec.depth,
                      captured=in_scope or bool(chosen or keep or intervene))
