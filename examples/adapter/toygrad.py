"""toygrad: a small reverse-mode autodiff framework on numpy, and a complete graddebug adapter.

The framework: ``Var`` and its ops, ``Module``, ``Linear``, ``Act``, ``Sequential``, ``SGD``. The
adapter: :class:`ToyAdapter` (:class:`graddebug.adapter.Adapter`, plus one capability,
:class:`graddebug.adapter.StepClock`) and the ``graddebug_adapter`` hook that claims toygrad
objects. Register this module with a plugin manager::

    pm = graddebug.plugins.new_plugin_manager(entry_points=False)
    pm.register(toygrad)
    with graddebug.watch(model, optimizer=opt, plugin_manager=pm) as dbg: ...

A package that ships an adapter declares the module holding its hooks instead, and every
``watch`` finds it (``pyproject.toml``)::

    [project.entry-points.graddebug]
    toygrad = "toygrad"
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import graddebug
from graddebug.adapter import BaseAdapter, StepClock, StepResult, WatchContext, WatchOptions
from graddebug.capture.layers import Intervention, LayerSpec, intervene_fail_open, select_layers
from graddebug.errors import ConfigError, GradientCountError
from graddebug.records import WEIGHTED_DETAIL, Event, EventKind, Kind, Record, sums_record

if TYPE_CHECKING:
    from graddebug.adapter import AdapterFactory

GradHook = Callable[[np.ndarray], "np.ndarray | None"]
ForwardHook = Callable[["Module", "Var", "Var"], "Var | None"]


class Handle:
    """Removes the hook it was returned for."""

    def __init__(self, hooks: list[Any], hook: Any) -> None:
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` over the axes that broadcasting added to an operand of ``shape``."""
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    ones = tuple(i for i, n in enumerate(shape) if n == 1)
    return g.sum(axis=ones, keepdims=True) if ones else g


class Var:
    """A float64 array that remembers the op that made it, for :meth:`backward`.

    Args:
        value: The array.
        requires_grad: A leaf whose ``grad`` :meth:`backward` fills (a parameter).
        parents: The op's inputs (set by the ops).
        backward: Maps the gradient at this Var to one gradient per parent (set by the ops).
    """

    def __init__(self, value: Any, requires_grad: bool = False, parents: tuple[Var, ...] = (),
                 backward: Callable[[np.ndarray], tuple[np.ndarray, ...]] | None = None) -> None:
        self.value = np.asarray(value, dtype=np.float64)
        self.grad: np.ndarray | None = None
        self.requires_grad: bool = requires_grad or any(p.requires_grad for p in parents)
        self._parents, self._backward = parents, backward
        self._hooks: list[GradHook] = []

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def register_hook(self, fn: GradHook) -> Handle:
        """``fn(grad)`` sees the gradient reaching this Var in :meth:`backward`; an array it
        returns replaces that gradient from there on."""
        self._hooks.append(fn)
        return Handle(self._hooks, fn)

    def __matmul__(self, other: Var) -> Var:
        a, b = self.value, other.value
        return Var(a @ b, parents=(self, other), backward=lambda g: (g @ b.T, a.T @ g))

    def __add__(self, other: Var) -> Var:
        sa, sb = self.shape, other.shape
        return Var(self.value + other.value, parents=(self, other),
                   backward=lambda g: (_unbroadcast(g, sa), _unbroadcast(g, sb)))

    def _unary(self, value: np.ndarray, slope: np.ndarray) -> Var:
        return Var(value, parents=(self,), backward=lambda g: (g * slope,))

    def tanh(self) -> Var:
        t = np.tanh(self.value)
        return self._unary(t, 1.0 - t * t)

    def sigmoid(self) -> Var:
        s = 1.0 / (1.0 + np.exp(-self.value))
        return self._unary(s, s * (1.0 - s))

    def relu(self) -> Var:
        on = self.value > 0
        return self._unary(self.value * on, on)

    def sum(self) -> Var:
        return self._unary(self.value.sum(), np.ones_like(self.value))

    def mean(self) -> Var:
        return self._unary(self.value.mean(), np.full_like(self.value, 1.0 / self.value.size))

    def backward(self) -> None:
        """Back-propagate from this Var (seeded with ones), accumulating leaves' ``grad``."""
        order: list[Var] = []
        seen: set[int] = set()
        stack: list[tuple[Var, bool]] = [(self, False)]
        while stack:  # iterative post-order: deep stacks must not hit the recursion limit
            v, done = stack.pop()
            if done:
                order.append(v)
            elif id(v) not in seen:
                seen.add(id(v))
                stack += [(v, True)] + [(p, False) for p in v._parents if p.requires_grad]
        grads = {id(self): np.ones_like(self.value)}
        for v in reversed(order):
            g = grads.pop(id(v))
            for hook in list(v._hooks):
                out = hook(g)
                g = g if out is None else out
            if v._backward is None:
                v.grad = g if v.grad is None else v.grad + g
                continue
            for parent, pg in zip(v._parents, v._backward(g), strict=True):
                if parent.requires_grad:
                    grads[id(parent)] = grads[id(parent)] + pg if id(parent) in grads else pg


def mse(out: Var, target: np.ndarray) -> Var:
    """Mean squared error against a fixed target."""
    d = out.value - target
    return Var((d * d).mean(), parents=(out,), backward=lambda g: (g * 2.0 * d / d.size,))


class Module:
    """A layer: its parameters are its Var attributes that require a gradient."""

    def __init__(self) -> None:
        self.training = True
        self._forward_hooks: list[ForwardHook] = []

    def forward(self, x: Var) -> Var:
        raise NotImplementedError

    def __call__(self, x: Var) -> Var:
        out = self.forward(x)
        for hook in list(self._forward_hooks):
            replaced = hook(self, x, out)
            out = out if replaced is None else replaced
        return out

    def register_forward_hook(self, fn: ForwardHook) -> Handle:
        """``fn(module, input, output)`` runs after each forward; a Var it returns replaces
        the output."""
        self._forward_hooks.append(fn)
        return Handle(self._forward_hooks, fn)

    def children(self) -> dict[str, Module]:
        """The modules it holds, by attribute name."""
        return {n: m for n, m in vars(self).items() if isinstance(m, Module)}

    def own_parameters(self) -> dict[str, Var]:
        """Its own parameters (not its children's), by short name: ``weight``, ``bias``."""
        return {n: v for n, v in vars(self).items() if isinstance(v, Var) and v.requires_grad}

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """Itself (named ``prefix``) and every module below it, by qualified name."""
        yield prefix, self
        for name, child in self.children().items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self) -> Iterator[tuple[str, Var]]:
        for name, module in self.named_modules():
            for short, p in module.own_parameters().items():
                yield (f"{name}.{short}" if name else short), p

    def parameters(self) -> list[Var]:
        return [p for _, p in self.named_parameters()]

    def train(self, mode: bool = True) -> None:
        for _, module in self.named_modules():
            module.training = mode


class Linear(Module):
    """``x @ weight + bias``, weights drawn from N(0, std²), std 1/√n_in by default."""

    def __init__(self, n_in: int, n_out: int, rng: np.random.Generator,
                 std: float | None = None) -> None:
        super().__init__()
        std = 1.0 / math.sqrt(n_in) if std is None else std
        self.weight = Var(rng.normal(0.0, std, (n_in, n_out)), requires_grad=True)
        self.bias = Var(np.zeros(n_out), requires_grad=True)

    def forward(self, x: Var) -> Var:
        return x @ self.weight + self.bias


class Act(Module):
    """An elementwise activation: ``Act("tanh")``, ``Act("sigmoid")`` or ``Act("relu")``."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: Var) -> Var:
        return getattr(x, self.op)()  # type: ignore[no-any-return]


class Sequential(Module):
    """Its layers in order, named ``"0"``, ``"1"``, ..."""

    def __init__(self, *layers: Module) -> None:
        super().__init__()
        self.layers = list(layers)

    def children(self) -> dict[str, Module]:
        return {str(i): m for i, m in enumerate(self.layers)}

    def forward(self, x: Var) -> Var:
        for layer in self.layers:
            x = layer(x)
        return x


class SGD:
    """Plain gradient descent, ``p <- p - lr * grad``, with post-step hooks ``fn(opt)``."""

    def __init__(self, params: Iterable[Var], lr: float) -> None:
        self.params, self.lr = list(params), lr
        self._post_hooks: list[Callable[[SGD], None]] = []

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.value = p.value - self.lr * p.grad
        for hook in list(self._post_hooks):
            hook(self)

    def register_step_post_hook(self, fn: Callable[[SGD], None]) -> Handle:
        self._post_hooks.append(fn)
        return Handle(self._post_hooks, fn)


# -- the graddebug adapter ------------------------------------------------------------------

def _apply(grad: np.ndarray, spec: Intervention) -> np.ndarray:
    """Mask, scale, clip by value, clip by norm (``g * min(1, c / ||g||)``), out of place."""
    out = grad
    if spec.mask is not None:
        out = spec.mask(out) if spec.mask_is_callable else np.where(
            np.asarray(spec.mask, dtype=bool), out, 0.0)
    if spec.scale is not None:
        out = out * spec.scale
    if spec.clip_value is not None:
        out = np.clip(out, -spec.clip_value, spec.clip_value)
    if spec.clip_norm is not None:
        norm = math.sqrt(float(np.vdot(out, out)))
        if norm > spec.clip_norm:
            out = out * (spec.clip_norm / norm)
    return out


def _fits(out: Any, grad: np.ndarray) -> bool:
    return isinstance(out, np.ndarray) and out.shape == grad.shape


class _Capture:
    """Sums of the gradients that reached one output in one step: scalars (and one flag per
    unit), never the gradient itself."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape, self.numel, self.sq, self.total = str(shape), 0, 0.0, 0.0
        self.absmax, self.pre_sq, self.nan, self.inf = math.nan, math.nan, False, False
        self.live: np.ndarray | None = None  # per unit (last axis): any nonzero entry

    def add(self, seen: np.ndarray, before: np.ndarray | None, full: bool) -> None:
        sq = float(np.vdot(seen, seen))
        self.numel += seen.size
        self.sq += sq
        self.total += float(seen.sum())
        if not math.isfinite(sq):  # counted only where the sentinel says something broke
            self.nan |= bool(np.isnan(seen).any())
            self.inf |= bool(np.isinf(seen).any())
        if full:  # the full tier: two more passes
            self.absmax = float(np.fmax(self.absmax, np.abs(seen).max(initial=0.0)))
            if seen.ndim >= 2:
                live = np.any(seen.reshape(-1, seen.shape[-1]) != 0, axis=0)
                self.live = live if self.live is None else self.live | live
        if before is not None:
            pre = float(np.vdot(before, before))
            self.pre_sq = pre if math.isnan(self.pre_sq) else self.pre_sq + pre

    def record(self, step: int, layer: LayerSpec) -> Record:
        zero = float(1.0 - self.live.mean()) if self.live is not None else math.nan
        return sums_record(step, layer.name, "output", Kind.ACTIVATION.value, layer.depth,
                           self.shape, self.numel, math.sqrt(self.sq), self.total, self.absmax,
                           zero, self.nan, self.inf, math.sqrt(self.pre_sq))


class ToyAdapter(BaseAdapter):
    """graddebug's adapter for toygrad: gradient hooks on layer outputs (set from forward
    hooks) and taps, parameter gradients from ``p.grad`` at the close, and the optimizer's
    post-step hooks as a step clock.

    Raises:
        ConfigError: ``model`` is not a toygrad Module, or a ``params=`` value is not a Var
            that requires a gradient.
    """

    name = "toygrad"
    capabilities = frozenset({StepClock})
    watch_options = frozenset({"params", "layers", "keep", "intervene", "outputs", "param_stats",
                               "optimizer", "full_stats_every"})

    def __init__(self, context: WatchContext, model: Any, params: Mapping[str, Any] | None,
                 options: WatchOptions) -> None:
        super().__init__(context, options)
        if model is not None and not isinstance(model, Module):
            raise ConfigError(f"the toygrad adapter watches toygrad Modules, not "
                              f"{type(model).__name__}; pass params={{'name': var}} or tap().")
        self._model = model
        self._named: dict[str, Module] = {}
        self._modules: dict[str, Module] = {}
        self._params: list[tuple[LayerSpec, str, Var]] = []  # owner, short name, parameter
        self._handles: list[Handle] = []  # removed on detach
        self._step_handles: list[Handle] = []  # output hooks, removed when the step closes
        self._was_training: bool | None = None
        self._captures: dict[str, _Capture] = {}
        self._expected: dict[str, int] = {}  # outputs hooked this step: name -> depth
        self._lost: set[str] = set()  # outputs whose capture a bug broke this step
        self._events: list[Event] = []
        self._kept: dict[str, np.ndarray] = {}
        self._touched = False
        if model is not None:
            owner = type(model).__name__
            self._named = {name or owner: m for name, m in model.named_modules()}
            selected = ({n: m for n, m in self._named.items() if not m.children()}
                        if options.layers is None else
                        select_layers(self._named, options.layers, noun="module", owner=owner))
            # every toygrad module with parameters of its own is an affine map
            self._modules = self._add_layers(self._named, selected, lambda m: False,
                                             weighted=lambda m: bool(m.own_parameters()))
            self._params = [(self._layers[n], short, p) for n, m in self._modules.items()
                            for short, p in m.own_parameters().items()]
        for key, var in (params or {}).items():
            if not isinstance(var, Var) or not var.requires_grad:
                raise ConfigError(f"params[{key!r}] must be a toygrad Var with "
                                  f"requires_grad=True; for another Var use tap(v, {key!r}).")
        if params:
            self._add_param_keys(params)
            self._params += [(self._layers[k], k, v) for k, v in params.items()]

    def _model_layer_names(self) -> Iterable[str]:
        return self._named

    # -- Adapter ------------------------------------------------------------------------

    def attach(self) -> None:
        """One forward hook per watched module, one gradient hook per parameter."""
        if self._model is not None:
            self._was_training = self._model.training
        for name, module in self._modules.items():
            hook = functools.partial(self._on_forward, self._layers[name])
            self._handles.append(module.register_forward_hook(hook))
        self._handles += [p.register_hook(self._on_param_grad) for _, _, p in self._params]

    def detach(self) -> None:
        """Remove every hook and restore ``model.training``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._model is not None and self._was_training is not None:
            self._model.train(self._was_training)
        self._clear()

    def tap(self, tensor: Any, name: str, intervention: Intervention | None) -> Any:
        """Hook ``tensor`` so that the gradient reaching it is recorded (and altered)."""
        if not isinstance(tensor, Var):
            raise ConfigError(f"tap({type(tensor).__name__}, {name!r}): the toygrad adapter "
                              "taps toygrad Vars only.")
        layer = self._tap_layer(name, intervention)
        self._watch(layer, tensor)
        return tensor

    def has_pending(self) -> bool:
        """Whether a gradient reached a watched output, tap or parameter in the open step."""
        return self._touched or bool(self._captures)

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Rows for the step's captures and every parameter, then a fresh step."""
        if grads is not None and len(grads) != len(self._params):
            raise GradientCountError(f"step() got {len(grads)} gradients for the "
                                     f"{len(self._params)} watched parameters.")
        result = StepResult()
        if record:
            result.records = [c.record(step, self._layers[n]) for n, c in self._captures.items()
                              if n not in self._lost]
            self._events += [Event(step, name, "output", depth, EventKind.UNREACHED.value)
                             for name, depth in self._expected.items()
                             if name not in self._captures and name not in self._lost]
            full = self._options.param_stats == "full"
            for i, (layer, short, p) in enumerate(self._params):
                g = p.grad if grads is None else np.asarray(grads[i], dtype=np.float64)
                if g is None:
                    self._events.append(Event(step, layer.name, short, layer.depth,
                                              EventKind.NO_GRAD.value))
                    continue
                norm = math.sqrt(float(np.vdot(g, g)))
                broken = not math.isfinite(norm)
                result.records.append(sums_record(
                    step, layer.name, short, Kind.PARAMETER.value, layer.depth, str(g.shape),
                    g.size, norm, float(g.sum()) if full else math.nan,
                    float(np.abs(g).max()) if full else math.nan, math.nan,
                    broken and bool(np.isnan(g).any()), broken and bool(np.isinf(g).any())))
            result.events, result.kept = self._events, self._kept
        self._clear()
        return result

    # -- StepClock ----------------------------------------------------------------------

    def follow_optimizer(self, optimizer: Any, on_step: Callable[[], None]) -> None:
        """Call ``on_step`` after each ``optimizer.step()``, until :meth:`detach`.

        Raises:
            ConfigError: ``optimizer`` is not a toygrad SGD or holds no watched parameter.
        """
        watched = {id(p) for _, _, p in self._params}
        if not isinstance(optimizer, SGD) or not watched & {id(p) for p in optimizer.params}:
            raise ConfigError(f"optimizer={optimizer!r} must be a toygrad SGD holding some of "
                              "the watched parameters.")
        self._handles.append(optimizer.register_step_post_hook(lambda opt: on_step()))

    # -- hooks --------------------------------------------------------------------------

    def _on_forward(self, layer: LayerSpec, module: Module, x: Var, out: Var) -> None:
        with self._fail_open(layer.name):
            self._watch(layer, out, cut=x.requires_grad)
            if self._ctx.recording and layer.check_forward:
                self._check_forward(layer, out)

    def _check_forward(self, layer: LayerSpec, out: Var) -> None:
        """A ``forward_nonfinite`` event where ``out`` holds NaN or Inf: the nonfinite
        diagnosis names the first such layer in forward order as where the NaN was born."""
        if np.isfinite(out.value).all():
            return
        detail = "NaN" if np.isnan(out.value).any() else "Inf"
        self._events.append(Event(self._ctx.step_index, layer.name, "output", layer.depth,
                                  EventKind.FORWARD_NONFINITE.value,
                                  detail + (WEIGHTED_DETAIL if layer.weighted else "")))

    def _watch(self, layer: LayerSpec, out: Var, cut: bool = True) -> None:
        """Hook ``out``; without a gradient to receive, it is a cut when ``cut``."""
        if layer.depth < 0:
            layer.depth = self._take_depth()
        spec = layer.intervention
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            layer.check_mask(spec.mask, out.shape, isinstance(spec.mask, np.ndarray))
        if not out.requires_grad:
            if cut:
                self._events.append(Event(self._ctx.step_index, layer.name, "output",
                                          layer.depth, EventKind.DETACHED_OUTPUT.value,
                                          "no gradient reaches it"))
        elif (layer.capture and self._ctx.recording) or (spec is not None and spec.active):
            hook = functools.partial(self._on_grad, layer)
            self._step_handles.append(out.register_hook(hook))
            if layer.capture and self._ctx.recording:
                self._expected[layer.name] = layer.depth

    def _on_grad(self, layer: LayerSpec, grad: np.ndarray) -> np.ndarray | None:
        spec, new = layer.intervention, None
        if spec is not None and spec.active:  # interventions act on every step
            new = intervene_fail_open(spec, layer.name, grad, _apply, _fits,
                                      self._ctx.internal_error)
        if layer.capture and self._ctx.recording and layer.name not in self._lost:
            recorded = False
            with self._fail_open(layer.name):
                self._record(layer, grad, new)
                recorded = True
            if not recorded:  # its sums may be half-added: no row rather than a wrong one
                self._lost.add(layer.name)
        return new

    def _record(self, layer: LayerSpec, grad: np.ndarray, new: np.ndarray | None) -> None:
        seen = grad if new is None else new
        capture = self._captures.get(layer.name)
        if capture is None:
            capture = self._captures[layer.name] = _Capture(seen.shape)
        capture.add(seen, None if new is None else grad, layer.keep or self._ctx.full_stats)
        if layer.keep:
            self._kept[layer.name] = np.array(seen)  # keep_label() of an output: its layer

    def _on_param_grad(self, grad: np.ndarray) -> None:
        with self._fail_open("parameters"):
            self._touched = True

    def _clear(self) -> None:
        for handle in self._step_handles:
            handle.remove()
        self._step_handles, self._captures, self._events, self._kept = [], {}, [], {}
        self._expected, self._lost = {}, set()
        self._touched = False


@graddebug.hookimpl
def graddebug_adapter(target: object) -> AdapterFactory | None:
    """Claim toygrad Modules and Vars.

    An adapter package apart from its framework decides by type without importing it:
    ``toy = sys.modules.get("toygrad")``, None when absent. Here both share one module.
    """
    return ToyAdapter if isinstance(target, (Module, Var)) else None


def main(steps: int = 5, seed: int = 0) -> graddebug.Watcher:
    """Train a 3-layer tanh MLP for ``steps`` SGD steps under ``watch``; return the Watcher."""
    rng = np.random.default_rng(seed)
    model = Sequential(Linear(4, 16, rng), Act("tanh"), Linear(16, 16, rng), Act("tanh"),
                       Linear(16, 1, rng))
    opt = SGD(model.parameters(), lr=0.05)
    x = Var(rng.normal(size=(32, 4)))
    y = np.sin(x.value.sum(axis=1, keepdims=True))
    pm = graddebug.plugins.new_plugin_manager(entry_points=False)
    pm.register(sys.modules[__name__])
    with graddebug.watch(model, optimizer=opt, plugin_manager=pm) as dbg:
        for _ in range(steps):  # opt.step() closes each step: no dbg.step()
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
    return dbg


if __name__ == "__main__":
    dbg = main()
    print(dbg.frame().to_string())
    print(dbg.findings().to_string())
