"""Layer outputs hooked: the forward hooks, the tensor hooks they set, and what they record.

A forward hook on each watched module sets a tensor hook on each floating output that needs a
gradient; the tensor hook measures the gradient on the device (or stages a small one, see
:mod:`graddebug_torch.staging`) and applies the layer's intervention. The forward hook also
checks the outputs' finiteness and whether an output was cut from the graph. Everything lands
in the open step's :class:`~graddebug_torch.captures.StepCaptures`, read when it closes.

:class:`OutputWatch` is also the host op-level capture records through
(:class:`graddebug_torch.ops.OpHost`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from graddebug.adapter import WatchContext
from graddebug.capture.layers import (
    FailOpen,
    Intervention,
    LayerSpec,
    intervene_fail_open,
    keep_label,
)
from graddebug.records import Event, EventKind
from graddebug_torch.captures import (
    Capture,
    CollectorPause,
    ForwardChecks,
    GradHook,
    Key,
    StepCaptures,
    kept_array,
    shape_text,
)
from graddebug_torch.compiled import Ran, record_ran, trace_forward, tracing
from graddebug_torch.distributed import is_sharded, local_slice
from graddebug_torch.guards import FUNCTORCH_WARNING, transform_running
from graddebug_torch.outputs import SEVERED_DETAIL, any_requires_grad, fits, flatten
from graddebug_torch.outputs import unit_dim as _unit_dim  # patched by the fail-open tests
from graddebug_torch.sharding import Layouts
from graddebug_torch.staging import SmallGrads
from graddebug_torch.stats import (
    DotSums,
    apply_intervention,
    square_sum,
    unit_extremes,
    whole_absmax,
)
from graddebug_torch.valueflow import ValueFlows

__all__ = ["OutputWatch"]

_DETACHED_OUTPUT = EventKind.DETACHED_OUTPUT.value


class OutputWatch:
    """The hooks on watched layer outputs and taps, and the open step they fill.

    Args:
        context: The Watcher's hook side.
        layers: The adapter's layer table (every watched layer and tap by name).
        take_depth: Hands out the next forward-order depth.
        fail_open: The adapter's fail-open guard for a hook running in ``where``.

    Attributes:
        state: What the hooks captured in the open step.
        staging: Where small gradients are staged until the step closes.
        grad_hooks: The tensor hook of each output, made once and reused every step.
        flows: The value flows of parameter-free modules (:mod:`graddebug_torch.valueflow`).
        compiled_ran: A compiled graph called back from the forward hooks: they must stay
            on the modules, as the graph was traced with them.
        layouts: Where the outputs' layouts among the ranks are learned, in a run of several
            ranks (:mod:`graddebug_torch.sharding`); None in one process.
    """

    def __init__(self, context: WatchContext, layers: Mapping[str, LayerSpec],
                 take_depth: Callable[[], int], fail_open: Callable[[str], FailOpen]) -> None:
        self.context = context
        self.layers = layers
        self._take_depth = take_depth
        self._fail_open = fail_open
        self.staging = SmallGrads()  # gradients
        self._sums = DotSums()
        self._pause = CollectorPause()
        self._forward_staging = SmallGrads()  # outputs, for the forward check
        self.state = self._new_step()
        self.grad_hooks: dict[Key, GradHook] = {}
        self.flows = ValueFlows()
        self.compiled_ran = False
        self.layouts: Layouts | None = None

    def take_depth(self) -> int:
        """The next forward-order depth."""
        return self._take_depth()

    def fail_open(self, where: str) -> FailOpen:
        """The fail-open guard for a hook running in ``where``."""
        return self._fail_open(where)

    # -- the step ----------------------------------------------------------------------------

    def _new_step(self) -> StepCaptures:
        return StepCaptures(forward=ForwardChecks(self._forward_staging, self._sums),
                            inputs=ForwardChecks(self._forward_staging, self._sums),
                            between=ForwardChecks(self._forward_staging, self._sums))

    def drop_step(self) -> None:
        """Forget the open step: its tensor hooks removed, its captures and staging dropped."""
        self._pause.resume()
        state = self.state
        if state.reusable():  # a skipped step's: no object to build again
            state.touched = state.transformed = state.tap_requires_grad = False
        else:
            state.hooks.remove()
            self.state = self._new_step()
        if self.layouts is not None:
            self.layouts.clear()
        self.staging.clear()
        self._forward_staging.clear()

    def release(self) -> None:
        """On exit: drop the step, and the staging buffers with the hooks."""
        self.drop_step()
        self.staging = SmallGrads()

    # -- forward hooks -----------------------------------------------------------------------

    def forward_begins(self, module: nn.Module, args: Any) -> None:
        """The root module's forward starts: pause the collector on recorded steps."""
        if torch.compiler.is_compiling() or not (self.context.recording
                                                 and torch.is_grad_enabled()):
            return
        self._pause.resume()  # a backward pass that raised before its end left it paused
        self._pause.pause()

    def on_model_input(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """The watched model's forward starts: check its floating inputs for NaN/Inf on
        recorded steps (one reduction each, read at the step's sync), so that a NaN the data
        brought is told from one the model made."""
        if torch.compiler.is_compiling() or not (self.context.recording
                                                 and torch.is_grad_enabled()):
            return
        with self._fail_open("model input"):
            state = self.state
            for name, tensor in (*flatten(args, "args"), *flatten(kwargs, "kwargs")):
                if tensor.is_floating_point():
                    state.inputs.check(("input", name), -1, tensor)
                    state.covered[id(tensor)] = weakref.ref(tensor)

    def forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root module's forward returned or raised: resume the collector."""
        if not torch.compiler.is_compiling():
            self._pause.resume()

    def skip_transformed(self) -> None:
        """A forward or a tap inside a ``torch.func`` transform: skipped, with one warning."""
        self.state.transformed = True
        self.context.warn_once("functorch", FUNCTORCH_WARNING)

    def on_forward(self, layer: LayerSpec, module: nn.Module, args: Any, output: Any) -> None:
        """The forward hook of a watched module (bound to its ``layer``).

        Args:
            layer: The module's layer.
            module: The module.
            args: Its positional inputs, or a :class:`~graddebug_torch.compiled.Ran` when a
                compiled graph calls back.
            output: Its output.
        """
        if tracing():
            # Dynamo is tracing this hook into a compiled graph, whose operators call back
            # here (args is then a Ran) and on_grad when it runs: see graddebug_torch.compiled.
            if torch.is_grad_enabled():
                trace_forward(layer, module, args, output)
            return
        ctx = self.context
        if isinstance(args, Ran):  # a compiled forward, calling back as it runs
            self.compiled_ran = True
            if ctx.recording:
                with self._fail_open(layer.name):
                    record_ran(layer, args, self.state, ctx, self._take_depth)
            return
        if not ctx.recording:  # a step every= skips: nothing to do but interventions
            if layer.intervention is not None and not transform_running():
                self.intervene_outputs(layer, output, args)
            return
        flow = self.flows.finished(module)  # left unread on skipped steps: replaced per call
        if transform_running():
            self.skip_transformed()
            return
        if not torch.is_grad_enabled():
            if layer.intervention is not None:
                self.intervene_outputs(layer, output)
            return
        with self._fail_open(layer.name):
            if layer.depth < 0:
                layer.depth = self._take_depth()
            if layer.capture:
                self._check_inputs(layer, args)
            tensors = (("output", output),) if isinstance(output, Tensor) else flatten(output)
            for tname, tensor in tensors:
                if not tensor.is_floating_point():
                    continue
                if layer.capture:
                    self.watch_tensor(layer, tname, tensor, args)
                if tensor.requires_grad or not any_requires_grad(args):
                    continue
                # Without a ValueFlow the module owns trainable parameters (starved by this
                # output) or is a torch.nn module, which never drops a gradient on purpose.
                if flow is None or flow.escaped or flow.marked(tensor):
                    self.state.events.append(
                        Event(ctx.step_index, layer.name, tname, layer.depth,
                              _DETACHED_OUTPUT, SEVERED_DETAIL)
                    )

    def _check_inputs(self, layer: LayerSpec, args: Any) -> None:
        """Check the inputs of ``layer`` that no recorded output gave it: a NaN there was made
        by code between recorded layers (its parent's own forward), which nothing else sees.

        In a chain of watched layers every input is the output before it, and this costs a
        dictionary lookup per input.
        """
        covered = self.state.covered
        for tname, tensor in flatten(args, "input"):
            if not (tensor.requires_grad and tensor.is_floating_point()):
                continue
            ref = covered.get(id(tensor))
            if ref is None or ref() is not tensor:
                self.state.between.check((layer.name, tname), layer.depth, tensor)
                covered[id(tensor)] = weakref.ref(tensor)

    def watch_tensor(self, layer: LayerSpec, tname: str, tensor: Tensor, args: Any = ()) -> None:
        """Check output ``tname`` of ``layer`` (called on ``args``) forward, and hook its
        gradient.

        Raises:
            MaskShapeError: The layer's mask does not broadcast to the output.
        """
        key = (layer.name, tname)
        state = self.state
        spec = layer.intervention
        if self.layouts is not None and tensor.requires_grad:
            self.layouts.learn(key, tensor, args if isinstance(args, tuple) else ())
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            shape = self.layouts.shape(key, tensor) if self.layouts is not None else tensor.shape
            layer.check_mask(spec.mask, tuple(shape), isinstance(spec.mask, Tensor))
        if layer.capture:
            if layer.check_forward:
                # Forward finiteness check: one reduction, read at the step's single sync.
                state.forward.check(key, layer.depth, tensor, layer.weighted)
            # Checked, or finite whenever its (checked) input is.
            state.covered[id(tensor)] = weakref.ref(tensor)
        if not tensor.requires_grad:
            return
        state.expected.setdefault(key, layer.depth)
        hook = self.grad_hooks.get(key)
        if hook is None:  # one per output, reused every step
            hook = self.grad_hooks[key] = functools.partial(self.on_grad, layer, tname)
        state.hooks.add(tensor, hook)

    def intervene_outputs(self, layer: LayerSpec, output: Any, args: Any = ()) -> None:
        """Set the interventions of ``layer`` on an output that is not recorded."""
        for tname, tensor in flatten(output):
            key = (layer.name, tname)
            if self.layouts is not None and tensor.requires_grad:
                self.layouts.learn(key, tensor, args if isinstance(args, tuple) else ())
            self.intervene_unrecorded(tensor, layer.intervention, layer.name, key)

    def intervene_unrecorded(self, tensor: Tensor, spec: Intervention | None,
                             name: str, key: Key | None = None) -> None:
        """Interventions act on every step: on steps ``every=`` skips, alter without recording."""
        if spec is not None and spec.active and tensor.requires_grad:
            hook = functools.partial(self._intervene, spec, name, key=key)
            self.state.hooks.add(tensor, hook)

    # -- tensor hooks ------------------------------------------------------------------------

    def _intervene(self, spec: Intervention, name: str, grad: Tensor,
                   key: Key | None = None) -> Tensor:
        """Apply ``spec`` to ``grad`` (a bug leaves ``grad`` as it is; a mask that does not
        fit raises). The gradient of output ``key`` that is this rank's piece of a tensor
        spread over the ranks (tensor parallelism) is altered as the whole tensor: a clip
        takes the whole tensor's norm, a mask has the whole tensor's shape."""
        layouts = self.layouts
        logical = layouts.logical(key, grad) if layouts is not None and key else grad
        out = intervene_fail_open(spec, name, logical, apply_intervention, fits,
                                  self.context.internal_error)
        if logical is grad or out is logical:
            return out if logical is grad else grad
        return local_slice(out)

    def on_grad(self, layer: LayerSpec, tname: str, grad: Tensor) -> Tensor | None:
        """The tensor hook of output ``tname`` of ``layer``: intervene, then record.

        Returns:
            The gradient the intervention made, or None to leave ``grad`` as it is.
        """
        spec = layer.intervention
        new = None
        if spec is not None and spec.active:
            new = self._intervene(spec, layer.name, grad, (layer.name, tname))
        if not self.context.recording:
            # Only a compiled graph calls this on a step that every= skips: its operators run
            # on every step, where eager hooks are set on recorded steps alone.
            return new
        with self._fail_open(layer.name):
            self._record_grad(layer, tname, grad, new)
        return new

    def _record_grad(self, layer: LayerSpec, tname: str, grad: Tensor,
                     new: Tensor | None) -> None:
        """Measure (or stage) the gradient that reached an output, after any intervention."""
        if not self._pause.paused:
            self._pause.until_backward_ends()
        seen = new if new is not None else grad
        if type(seen) is not Tensor and is_sharded(seen):  # a DTensor: this rank's slice
            if self.layouts is not None:
                self.layouts.learn_grad((layer.name, tname), seen)
            seen = local_slice(seen)
            if new is not None:
                grad, new = local_slice(grad), seen
            else:
                grad = seen
        if seen.is_sparse:
            seen = seen.coalesce().values()
        unit_dim = _unit_dim(seen.dim(), layer.channels_first)
        if new is None and SmallGrads.fits(seen):
            group = self.staging.group(seen, unit_dim)
            capture = Capture.pending(
                group, group.put(seen), shape_text(seen.shape), seen.numel(),
                seen.shape[unit_dim] if unit_dim is not None else 0)
        else:
            # The extremes (absmax, zero_frac) are two passes more: on full steps only.
            full = layer.keep or self.context.full_stats
            extremes = unit_extremes(seen, unit_dim) if full else None
            sq, total = self._sums.sentinel(seen)
            capture = Capture(
                sq=sq,
                total=total,
                extremes=extremes,
                absmax=whole_absmax(seen) if full and extremes is None else None,
                shape=shape_text(seen.shape),
                numel=seen.numel(),
                pre_sq=square_sum(grad) if new is not None else None,
                n_units=0 if extremes is None else extremes[0].numel(),
            )
        before = self.state.add((layer.name, tname), capture)
        if layer.keep:
            label = keep_label(layer.name, tname, before)
            self.state.kept[label] = kept_array(new if new is not None else grad)

    def on_param_grad(self, index: int, param: Tensor) -> None:
        """The post-accumulate hook of watched parameter ``index``: it holds the gradient, so
        that ``step()`` may come after ``zero_grad(set_to_none=True)``.

        Every parameter gradient is measured when the step closes, in one fused pass, as it
        is then: after accumulation, clipping, unscaling or a multi-rank all-reduce. A kernel
        per gradient here, inside the backward pass, cost more than that pass.
        """
        state = self.state
        state.touched = True
        grad = param.grad
        if grad is not None and self.context.recording:
            state.received[index] = grad
