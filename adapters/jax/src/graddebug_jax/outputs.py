"""Layer outputs and taps: a ``jax.custom_vjp`` identity on each watched array, whose backward
rule sees (and may alter) the cotangent, and the token chain that batches their rows.

Every identity takes the array and a token, a ``(CAPACITY, len(ACT_COLUMNS))`` float32 array
of zeros threaded through the identities of one trace in forward order, and returns both
unchanged. In the backward pass the token's cotangent flows through the same identities in
reverse: each writes its row (:func:`~.stats.activation_row`) into its slot and passes the
token's cotangent on. The first identity of the chain, whose token input is a constant, is its
*sink*: its backward rule hands the whole chain's rows to the :class:`~.transport.Transport`, which
sends them to the host with the step's other statistics (the optimizer update's), or alone
where no update follows in the same trace. So a backward pass costs one host transfer at most,
however many layers it crosses.

The identities use ``symbolic_zeros=True``: the forward rule learns whether the array needs a
gradient at all (an output behind ``jax.lax.stop_gradient`` does not), and the backward rule
learns whether any cotangent reached it (a symbolic zero means the graph is cut downstream of
it), which are the cut-graph events.

How the rows reach the host: see :mod:`.transport`. One host callback per chain costs less
than one per tap, and most of the difference to a plain step is the reductions themselves (the
Performance page has the timings).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from graddebug.capture.layers import Intervention, LayerSpec, intervene_fail_open
from graddebug_jax.model import path_name
from graddebug_jax.stats import ACT_COLUMNS, activation_row, forward_code
from graddebug_jax.transport import Parcel, Transport

__all__ = [
    "CAPACITY",
    "Chains",
    "Site",
    "apply_intervention",
    "check_inputs",
    "post_with",
    "probe",
    "probe_args",
    "watch_leaves",
]

CAPACITY = 128
"""Slots of one token chain; a trace with more identities starts another chain (and another
host transfer)."""

_WIDTH = len(ACT_COLUMNS)

Deliver = Callable[[list["Site"], np.ndarray], None]
"""Where a chain's rows go on the host: ``deliver(sites, rows)``."""


@dataclass
class Site:
    """One identity: a watched array in one trace.

    Attributes:
        layer: The layer or tap it belongs to.
        tensor: The ``tensor`` value of its rows (``"output"``, ``"output.0"``).
        shape: The array's shape.
        needs_grad: The array needed a gradient in the forward pass.
        upstream_grad: Something upstream of it in the chain needed a gradient.
        inputs_need_grad: An input of its module needed a gradient (module outputs only).
    """

    layer: LayerSpec
    tensor: str
    shape: tuple[int, ...]
    needs_grad: bool = False
    upstream_grad: bool = False
    inputs_need_grad: bool = False

    def __post_init__(self) -> None:
        self.numel = int(np.prod(self.shape)) if self.shape else 1
        """Number of entries."""
        self.shape_text = str(self.shape)
        """The ``shape`` cell of its rows."""


def apply_intervention(grad: jax.Array, spec: Intervention) -> jax.Array:
    """``spec`` applied to ``grad`` in the documented order: mask, scale, clip by value, clip
    by norm (``g * min(1, clip_norm / ||g||)``, no epsilon)."""
    out = grad
    if spec.mask is not None:
        out = spec.mask(out) if callable(spec.mask) else jnp.where(
            jnp.asarray(spec.mask).astype(bool), out, jnp.zeros_like(out))
    if spec.scale is not None:
        out = out * jnp.asarray(spec.scale, out.dtype)
    if spec.clip_value is not None:
        out = jnp.clip(out, -spec.clip_value, spec.clip_value)
    if spec.clip_norm is not None:
        norm = jnp.sqrt(jnp.sum(out * out))
        out = out * jnp.minimum(jnp.asarray(1.0, out.dtype), spec.clip_norm / norm)
    return out


def check_inputs(args: tuple[Any, ...], kwargs: dict[str, Any],
                 deliver: Callable[[Sequence[str], np.ndarray], None]) -> Parcel | None:
    """Check a model's floating array arguments, ``args.<i>`` and ``kwargs.<name>``, for
    NaN/Inf in the forward pass, inside the trace: each one's :func:`~.stats.forward_code`
    (one reduction), as a parcel that reaches ``deliver`` with the labels (None where no
    argument is a floating array). Post it with :func:`post_with` once the model has run."""
    named = [*((f"args.{i}", a) for i, a in enumerate(args)),
             *((f"kwargs.{k}", v) for k, v in kwargs.items())]
    floating = [(label, a) for label, a in named if _floating(a)]
    if not floating:
        return None
    codes = jnp.stack([forward_code(a) for _, a in floating])
    names = [label for label, _ in floating]
    return Parcel([codes], lambda values: deliver(names, values[0]), rows=False)


def _floating(x: Any) -> bool:
    return isinstance(x, jax.Array) and bool(jnp.issubdtype(x.dtype, jnp.floating))


def post_with(out: Any, parcel: Parcel, transport: Transport) -> Any:
    """Post ``parcel`` (made in a forward pass) to ``transport`` from the forward rule of an
    identity on ``out``'s first floating leaf, and return ``out`` (the same values).

    A forward pass that is differentiated runs with the differentiation's trace current, but
    the rule runs with the compiled step's, where the carrier gathers the trace's parcels
    (:mod:`.transport`); undifferentiated, the primal runs and posts. An eager parcel, or an
    ``out`` with no floating leaf, is posted at once."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    at = next((i for i, leaf in enumerate(leaves) if _floating(leaf)), None)
    if at is None or not parcel.traced:
        transport.post(parcel)
        return out

    @jax.custom_vjp
    def ident(x: Any) -> Any:
        transport.post(parcel)
        return x

    def fwd(x: Any) -> tuple[Any, None]:
        transport.post(parcel)
        return x, None

    def bwd(_: None, ct: Any) -> tuple[Any]:
        return (ct,)

    ident.defvjp(fwd, bwd)
    leaves[at] = ident(leaves[at])
    return jax.tree_util.tree_unflatten(treedef, leaves)


def probe_args(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[list[bool]]]:
    """``args`` with each floating array passed through :func:`probe`, and the flags that
    say, once the module has run, whether that input needed a gradient."""
    flags: list[list[bool]] = []
    probed = []
    for arg in args:
        if _floating(arg):
            arg, flag = probe(arg)
            flags.append(flag)
        probed.append(arg)
    return tuple(probed), flags


def watch_leaves(chains: Chains, layer: LayerSpec, out: Any, inputs_need_grad: bool) -> Any:
    """``out`` with each floating leaf passed through ``chains``' identities, labelled
    ``"output"`` (one array), ``"output.0"`` or ``"output.key"`` (a pytree)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(out)
    leaves = []
    for path, leaf in with_paths:
        label = "output" if not path else f"output.{path_name(path)}"
        leaves.append(chains.watch(leaf, layer, label, inputs_need_grad)
                      if _floating(leaf) else leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _fits(out: Any, grad: Any) -> bool:
    return hasattr(out, "shape") and tuple(out.shape) == tuple(grad.shape)


@dataclass
class _Chain:
    """The identities of one trace that share a token."""

    trace: Any
    token: Any
    sites: list[Site] = field(default_factory=list)


class Chains:
    """Builds the identities of watched arrays and the chains that batch their rows.

    Args:
        deliver: Where a chain's rows go on the host.
        on_bug: Records a bug caught inside a backward rule.
        transport: Takes each complete chain's rows to the host (:mod:`.transport`).
    """

    def __init__(self, deliver: Deliver, on_bug: Callable[[BaseException, str], None],
                 transport: Transport) -> None:
        self._deliver = deliver
        self._on_bug = on_bug
        self._transport = transport
        self._chain: _Chain | None = None

    def reset(self) -> None:
        """Forget the open chain (on detach: its token belongs to a finished trace)."""
        self._chain = None

    def _current(self) -> _Chain:
        trace = jax.extend.core.get_opaque_trace_state(convention="nnx")
        chain = self._chain
        if chain is None or chain.trace != trace or len(chain.sites) >= CAPACITY:
            chain = self._chain = _Chain(trace, jnp.zeros((CAPACITY, _WIDTH), jnp.float32))
        return chain

    def watch(self, x: jax.Array, layer: LayerSpec, tensor: str,
              inputs_need_grad: bool = False) -> jax.Array:
        """Pass ``x`` through an identity that records the cotangent reaching it.

        Raises:
            MaskShapeError: The layer's mask does not broadcast to ``x``.
        """
        spec = layer.intervention if layer.intervention is not None and \
            layer.intervention.active else None
        if spec is not None and spec.mask is not None and not spec.mask_is_callable:
            layer.check_mask(spec.mask, tuple(x.shape),
                             isinstance(spec.mask, (jax.Array, np.ndarray)))
        chain = self._current()
        site = Site(layer, tensor, tuple(int(d) for d in x.shape),
                    inputs_need_grad=inputs_need_grad)
        slot = len(chain.sites)
        chain.sites.append(site)
        ident = self._identity(chain, site, slot, spec, layer.check_forward)
        y: jax.Array
        y, chain.token = ident(x, chain.token)
        return y

    def _identity(self, chain: _Chain, site: Site, slot: int, spec: Intervention | None,
                  check_forward: bool) -> Any:
        deliver, on_bug, transport = self._deliver, self._on_bug, self._transport
        sites = chain.sites

        @jax.custom_vjp
        def ident(x: Any, token: Any) -> tuple[Any, Any]:
            return x, token

        def fwd(x: Any, token: Any) -> tuple[tuple[Any, Any], Any]:
            site.needs_grad, site.upstream_grad = bool(x.perturbed), bool(token.perturbed)
            bad = forward_code(x.value) if check_forward else jnp.zeros((), jnp.float32)
            return (x.value, token.value), (bad, bool(token.perturbed))

        def bwd(res: Any, cts: tuple[Any, Any]) -> tuple[Any, Any]:
            bad, token_perturbed = res
            ct_x, ct_token = cts
            grad = None if isinstance(ct_x, SymbolicZero) else ct_x
            pre = None
            if grad is not None and spec is not None:
                pre = grad
                grad = intervene_fail_open(spec, site.layer.name, grad, apply_intervention,
                                           _fits, on_bug)
            if isinstance(ct_token, SymbolicZero):
                ct_token = jnp.zeros((CAPACITY, _WIDTH), jnp.float32)
            ct_token = ct_token.at[slot].set(activation_row(grad, pre, bad))
            out_x = grad if site.needs_grad else None
            if token_perturbed:
                return out_x, ct_token
            # The sink: the chain's rows are complete once its first identity is reached.
            used = list(sites)
            transport.sink(Parcel([ct_token[: len(used)]],
                               lambda values: deliver(used, values[0]), chain=True))
            return out_x, None

        ident.defvjp(fwd, bwd, symbolic_zeros=True)
        return ident


def probe(x: jax.Array) -> tuple[jax.Array, list[bool]]:
    """Pass ``x`` through an identity that only learns whether it needs a gradient: the flag
    is set while the caller's forward pass is traced, and stays False where nothing is
    differentiated. The cotangent passes unchanged."""
    flag = [False]

    @jax.custom_vjp
    def ident(v: Any) -> Any:
        return v

    def fwd(v: Any) -> tuple[Any, None]:
        flag[0] = bool(v.perturbed)
        return v.value, None

    def bwd(_: None, ct: Any) -> tuple[Any]:
        return (None if isinstance(ct, SymbolicZero) else ct,)

    ident.defvjp(fwd, bwd, symbolic_zeros=True)
    return ident(x), flag
