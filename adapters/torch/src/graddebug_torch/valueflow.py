"""Whether the values of a module's differentiable inputs flowed into its outputs.

A module whose output needs no gradient although its input needs one has cut the graph only if
that output was computed from the input's values: ``x.detach() * 2``, a ``no_grad`` block, a
numpy round trip. A rotary or sinusoidal position table, an attention mask or an ``arange``
reads the input only for its shape, dtype or device; its output needs no gradient by design.
Nothing in a finished forward tells the two apart (``x.detach() * 2`` and ``cos(positions)``
are both plain tensors), so :class:`ValueFlow` follows the values while the module runs: a
``TorchFunctionMode`` marks every tensor computed from a marked one, starting from the inputs
that require a gradient. Reading only metadata (``size``, ``dtype``, ``zeros_like``) marks
nothing. Values that leave torch (``.numpy()``, ``.tolist()``, ``.item()``) may come back from
anywhere, so after that every output counts as derived.

The mode runs only inside modules that could cut without owning a trainable parameter of
their own (parameter-free modules defined outside ``torch.nn``); other modules never need it,
so the cost stays off the common path.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from graddebug_torch.outputs import tensors

__all__ = ["ValueFlow", "ValueFlows", "needs_value_flow", "never_cuts"]

# Functions that read a tensor's metadata, not its values.
_METADATA: frozenset[Any] = frozenset({
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.stride, Tensor.element_size,
    Tensor.is_floating_point, Tensor.is_complex, Tensor.get_device, Tensor.__len__,
    Tensor.dtype.__get__, Tensor.shape.__get__, Tensor.device.__get__,  # type: ignore[attr-defined]
    Tensor.ndim.__get__, Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    Tensor.is_cuda.__get__, Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like,
    Tensor.new_zeros, Tensor.new_ones, Tensor.new_empty, Tensor.new_full,
})
# Functions through which values leave torch, to come back as untracked tensors.
_ESCAPES: frozenset[Any] = frozenset({
    Tensor.numpy, Tensor.tolist, Tensor.item, Tensor.__array__, Tensor.__float__,
    Tensor.__int__, Tensor.__index__, Tensor.__bool__,
})


def _torch_own(module: nn.Module) -> bool:
    """Whether ``module`` is of one of torch's own classes (an exact type: a subclass of the
    user's may detach in its ``forward``). Modules of ``torch.nn`` compute from their inputs'
    values or pass them on, and never detach."""
    return type(module).__module__.startswith("torch.")


def never_cuts(module: nn.Module) -> bool:
    """Whether ``module`` and every module under it are torch's own, so that no call of it
    can cut the graph (a container of torch's may run a module of the user's)."""
    return all(_torch_own(m) for m in module.modules())


def needs_value_flow(module: nn.Module) -> bool:
    """Whether a no-gradient output of ``module`` needs :class:`ValueFlow` to be judged.

    A module with a trainable parameter of its own whose output needs no gradient has starved
    that parameter: a cut whatever the values did. A module of torch's own never detaches.
    """
    if _torch_own(module):
        return False
    return not any(p.requires_grad for p in module.parameters(recurse=False))


class ValueFlow(TorchFunctionMode):
    """Follows the values of the differentiable inputs of one module call.

    Args:
        inputs: The module's positional and keyword arguments.
    """

    def __init__(self, inputs: Any) -> None:
        super().__init__()
        self._marked: dict[int, weakref.ref[Tensor]] = {}
        self.escaped = False
        for tensor in tensors(inputs):
            if tensor.requires_grad:
                self._mark(tensor)

    def _mark(self, tensor: Tensor) -> None:
        self._marked[id(tensor)] = weakref.ref(tensor)

    def marked(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` was computed from a differentiable input's values."""
        ref = self._marked.get(id(tensor))
        return ref is not None and ref() is tensor

    def derived(self, output: Any) -> bool:
        """Whether any floating output tensor that needs no gradient carries input values."""
        return any(
            tensor.is_floating_point() and not tensor.requires_grad
            and (self.escaped or self.marked(tensor))
            for tensor in tensors(output)
        )

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _METADATA or not self._marked:
            return result
        if not any(self.marked(t) for t in tensors((args, kwargs))):
            return result
        if func in _ESCAPES:
            self.escaped = True
            return result
        for tensor in tensors(result):
            self._mark(tensor)
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], Tensor) and (name.endswith("_") or name == "__setitem__"):
            self._mark(args[0])  # written in place with marked values
        return result


class ValueFlows:
    """The :class:`ValueFlow` of each call in progress of the modules it follows, and of each
    module's last finished call, for the adapter's forward hook to read."""

    def __init__(self) -> None:
        self._running: dict[int, list[ValueFlow | None]] = {}
        self._finished: dict[int, ValueFlow | None] = {}

    def follow(self, module: nn.Module, active: Callable[[], bool],
               guard: Callable[[], AbstractContextManager[None]]) -> list[RemovableHandle]:
        """Follow input values through ``module``'s calls while ``active()`` says so.

        The exit hook is prepended, so it runs before the adapter's forward hook, and runs
        also when the forward raises, so that no mode is left active.

        Args:
            module: The module.
            active: Whether the current call is recorded.
            guard: The fail-open context of the module's hooks.

        Returns:
            The two hook handles, for the adapter to remove on exit.
        """

        def enter(module: nn.Module, args: Any, kwargs: Any) -> None:
            if torch.compiler.is_compiling():
                return  # a mode inside a traced graph breaks it; compiled.py judges instead
            flow = None
            if active():
                with guard():
                    if any(t.requires_grad for t in tensors((args, kwargs))):
                        flow = ValueFlow((args, kwargs))
                        flow.__enter__()
            self._running.setdefault(id(module), []).append(flow)

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if torch.compiler.is_compiling():
                return
            calls = self._running.get(id(module))
            flow = calls.pop() if calls else None
            self._finished[id(module)] = flow
            if flow is not None:
                with guard():
                    flow.__exit__(None, None, None)

        return [module.register_forward_pre_hook(enter, with_kwargs=True),
                module.register_forward_hook(leave, prepend=True, always_call=True)]

    def finished(self, module: nn.Module) -> ValueFlow | None:
        """The flow of ``module``'s call that just finished (taken: asked once per call)."""
        return self._finished.pop(id(module), None)

    def clear(self) -> None:
        """Forget every call (on detach)."""
        self._running.clear()
        self._finished.clear()
