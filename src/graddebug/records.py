"""The one schema: what adapters hand to the core, and what the diagnoses hand back.

Adapters append :class:`Record` rows (one per step and tensor) and :class:`Event` rows
(structural facts, such as "this parameter got no gradient") to the Watcher's buffer. Detectors
turn them into :class:`Finding` rows. This module owns their fields, the pandas dtype of every
column (:data:`RECORD_DTYPES`, :data:`EVENT_DTYPES`, :data:`FINDING_DTYPES`), and the enums of
kinds, events, issues and severities. The DataFrames (:mod:`graddebug.frames`) and the run
files (:mod:`graddebug.runs`) are built from these definitions and nothing else.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import NamedTuple

__all__ = [
    "ALL_RANKS",
    "EVENT_COLUMNS",
    "EVENT_DTYPES",
    "FINDING_COLUMNS",
    "FINDING_DTYPES",
    "RECORD_COLUMNS",
    "RECORD_DTYPES",
    "SEVERED_DETAIL",
    "WEIGHTED_DETAIL",
    "Cause",
    "Event",
    "EventKind",
    "Finding",
    "Issue",
    "Kind",
    "Record",
    "Severity",
    "sums_record",
]


class Kind(str, Enum):
    """What a record's gradient belongs to."""

    ACTIVATION = "activation"
    """The gradient at a layer's output or at a tap."""
    PARAMETER = "parameter"
    """The gradient of a parameter (a weight, a bias, a ``params=`` entry)."""
    OP = "op"
    """The gradient at the output of one operation inside a forward pass (``ops=True``): its
    ``layer`` is the module it ran in, its ``tensor`` names the op site (``op@file:line``)."""
    LOSS = "loss"
    """The step's loss, where graddebug sees it (``dbg.step(loss=...)``, the training
    callbacks): ``layer`` and ``tensor`` are ``"loss"``, ``mean`` holds the value, ``norm`` its
    absolute value, ``numel`` is 1 and ``depth`` -1. Not a gradient: the gradient rules leave
    it out."""


class Record(NamedTuple):
    """Statistics of one gradient tensor at one recorded step.

    Attributes:
        step: Index of the step, counted from 0 by ``Watcher.step()``.
        layer: Torch qualified module name, Keras layer name, tap name, or ``params=`` key.
        tensor: ``"output"`` (``"output.0"``, ``"output.key"`` for tuple or dict outputs) for an
            activation gradient; the parameter's short name (``"weight"``) for a parameter;
            the op site (``"torch.log@model.py:42"``) for an op.
        kind: ``"activation"``, ``"parameter"`` or ``"op"``.
        depth: Forward-order index of the layer (-1 when the layer never ran forward).
        shape: The gradient's shape, as ``str(tuple)``.
        numel: Number of elements.
        norm: L2 norm.
        mean: Mean entry (NaN where not measured: parameter rows without
            ``param_stats="full"``).
        std: Population standard deviation of the entries (NaN where not measured).
        absmax: Largest absolute entry (NaN where not measured).
        zero_frac: Fraction of units (features or channels) whose gradient is zero over the
            whole batch (NaN where the tensor has no unit axis or it was not measured). For
            a 1-D parameter (a bias), whose entries are its units: the share of its gradient's
            entries that are exactly 0, on every recorded step; NaN for other parameters.
        nan: The gradient holds at least one NaN.
        inf: The gradient holds at least one +-Inf (reported as False when NaN is also present
            and the adapter cannot tell).
        pre_norm: L2 norm before an intervention; NaN where none acted.
        rank: The process (``torch.distributed`` rank) or replica (``tf.distribute``) that
            recorded the row; 0 in one process. Rows that combine every rank carry
            :data:`ALL_RANKS`.
        weight_norm: Parameter rows: the L2 norm of the parameter itself at the step. TF,
            JAX and Keras on the JAX backend measure it before the optimizer's update (the
            weights the gradient was computed at); torch and Keras on the torch backend when
            the step closes, which is after the update in an ``opt.step(); dbg.step()``
            loop. NaN elsewhere and where not known.
        update_norm: Parameter rows: the L2 norm of the update the optimizer applied at the
            step, ``||w_after - w_before||``, so that ``update_norm / weight_norm`` is its
            update/weight ratio; NaN elsewhere and where not known (no optimizer step seen).
            Adapters may estimate both from a fixed sample of each tensor's entries.
        clipped_norm: Parameter rows: the L2 norm of the gradient after the host clipped it
            (the Hugging Face Trainer's ``max_grad_norm``, Lightning's ``gradient_clip_val``,
            Keras ``clipnorm``/``global_clipnorm``), which is what the optimizer applied,
            where graddebug knows that a clip acted on it; NaN elsewhere. ``norm`` is then the
            gradient as the backward pass left it, before the clip: the diagnoses judge that.
    """

    step: int
    layer: str
    tensor: str
    kind: str
    depth: int
    shape: str
    numel: int
    norm: float
    mean: float
    std: float
    absmax: float
    zero_frac: float
    nan: bool
    inf: bool
    pre_norm: float = float("nan")
    rank: int = 0
    weight_norm: float = float("nan")
    update_norm: float = float("nan")
    clipped_norm: float = float("nan")

    @classmethod
    def from_sums(
        cls,
        step: int,
        layer: str,
        tensor: str,
        kind: str,
        depth: int,
        shape: str,
        numel: int,
        *,
        norm: float,
        total: float,
        absmax: float,
        zero_frac: float,
        nan: bool,
        inf: bool,
        pre_norm: float = float("nan"),
        rank: int = 0,
        weight_norm: float = float("nan"),
        update_norm: float = float("nan"),
        clipped_norm: float = float("nan"),
    ) -> Record:
        """Build a record from the sums adapters accumulate: the mean is ``total / numel`` and
        the population std follows from the norm and the mean, with no extra pass.

        Args:
            total: Sum of the entries (NaN where not measured).
            norm: L2 norm, i.e. the square root of the sum of squares.
            inf: Reported as False when ``nan`` is True (NaN wins).
            (the others as in the class attributes)
        """
        return sums_record(step, layer, tensor, kind, depth, shape, numel, norm, total, absmax,
                           zero_frac, nan, inf, pre_norm, rank, weight_norm, update_norm,
                           clipped_norm)


def sums_record(step: int, layer: str, tensor: str, kind: str, depth: int, shape: str,
                numel: int, norm: float, total: float, absmax: float, zero_frac: float,
                nan: bool, inf: bool, pre_norm: float = math.nan, rank: int = 0,
                weight_norm: float = math.nan, update_norm: float = math.nan,
                clipped_norm: float = math.nan) -> Record:
    """:meth:`Record.from_sums` with positional arguments, for adapters that close tens of
    thousands of rows a step (a keyword call costs about as much as the arithmetic)."""
    mean = total / numel if numel else math.nan
    # One entry has no spread; the formula would leave the rounding error of norm**2.
    var = (0.0 if numel == 1 else norm * norm / numel - mean * mean) if numel else math.nan
    std = math.sqrt(max(var, 0.0)) if math.isfinite(var) else math.nan
    # tuple.__new__ skips the generated keyword-checking __new__: 3x faster.
    return tuple.__new__(Record, (step, layer, tensor, kind, depth, shape, numel, norm, mean,
                                  std, absmax, zero_frac, nan, inf and not nan, pre_norm, rank,
                                  weight_norm, update_norm, clipped_norm))


ALL_RANKS = -1
"""The ``rank`` of a row or finding that combines every rank of a multi-rank run."""

RECORD_COLUMNS: tuple[str, ...] = (*Record._fields[:-5], "rank", "weight_norm", "update_norm",
                                   "clipped_norm")
"""The frame's columns in contract order; ``pre_norm`` comes before ``rank`` only where an
intervention acted."""

_OBJ, _I64, _F64, _BOOL = "object", "int64", "float64", "bool"

RECORD_DTYPES: dict[str, str] = {
    "step": _I64, "layer": _OBJ, "tensor": _OBJ, "kind": _OBJ, "depth": _I64, "shape": _OBJ,
    "numel": _I64, "norm": _F64, "mean": _F64, "std": _F64, "absmax": _F64, "zero_frac": _F64,
    "nan": _BOOL, "inf": _BOOL, "pre_norm": _F64, "rank": _I64, "weight_norm": _F64,
    "update_norm": _F64, "clipped_norm": _F64,
}
"""The pandas dtype of every :class:`Record` field, ``pre_norm`` included."""


class EventKind(str, Enum):
    """Structural facts an adapter observes, that statistics alone cannot show."""

    NO_GRAD = "no_grad"
    """A parameter that requires a gradient got none when the step closed."""
    DETACHED_OUTPUT = "detached_output"
    """A layer's output does not require a gradient although one of its inputs does."""
    UNREACHED = "unreached"
    """A layer's output required a gradient in forward, but no gradient reached it."""
    FORWARD_NONFINITE = "forward_nonfinite"
    """A layer's output held NaN or Inf in the forward pass. ``detail`` is ``"NaN"`` or
    ``"Inf"``, followed by ``WEIGHTED_DETAIL`` (``"NaN; weighted"``) for a layer whose output is
    fixed by its input and its own parameters (an affine map, a convolution, a lookup, a
    normalisation): from a finite input, a NaN there was in its parameters."""
    LAYER_INPUT_NONFINITE = "layer_input_nonfinite"
    """A watched layer's input held NaN or Inf in the forward pass, and no recorded output
    gave it that input: code between recorded layers made it (its parent's own forward).
    ``tensor`` is ``"input.<i>"``; ``detail`` as for :attr:`FORWARD_NONFINITE`."""
    INPUT_NONFINITE = "input_nonfinite"
    """The watched model's input held NaN or Inf (``layer`` is ``"input"``, ``tensor`` names the
    argument: ``"args.0"``, ``"kwargs.pixel_values"``): the data, not the model."""
    SKIPPED_STEP = "skipped_step"
    """A loss scaler (``torch.amp.GradScaler``, Keras ``LossScaleOptimizer``) found Inf or NaN
    in the scaled gradients and skipped the optimizer step. ``detail`` is
    ``"scale=<the loss scale of that backward pass>"``; the step's gradients are overflowed
    by design, not a fault of the model, until the overflow persists."""
    OP_NONFINITE = "op_nonfinite"
    """Op-level capture: the first operation of the step, in call order, whose output held NaN
    or Inf in the forward pass (``detail`` is ``"NaN"`` or ``"Inf"``)."""
    OP_GRAD_NONFINITE = "op_grad_nonfinite"
    """Op-level capture: an operation whose backward turned a finite gradient into NaN or Inf:
    the gradient at its output was finite, the one it passed on to an input was not.
    ``detail`` says what appeared and where it went (the input's op site and module)."""
    OP_CUT = "op_cut"
    """Op-level capture: an operation through which the graph was cut (``.detach()``,
    ``.data``, a ``no_grad`` or ``inference_mode`` block, values leaving torch through
    ``.numpy()``), whose result was used downstream. ``detail`` names the cause and the op
    sites on both sides."""


class Event(NamedTuple):
    """One structural fact about one tensor at one step (``rank`` as in :class:`Record`;
    a step-wide event such as :attr:`EventKind.SKIPPED_STEP` has empty ``layer`` and
    ``tensor`` and depth -1). ``source`` is the ``file:line`` of the user's code behind an
    op-level event; empty for the others."""

    step: int
    layer: str
    tensor: str
    depth: int
    event: str
    detail: str = ""
    rank: int = 0
    source: str = ""


EVENT_COLUMNS: tuple[str, ...] = Event._fields

SEVERED_DETAIL = "its input requires a gradient but its output does not"
"""The detail of a :attr:`EventKind.DETACHED_OUTPUT` event: what a layer did whose output needs
no gradient although one of its inputs does (a ``.detach()`` or ``tf.stop_gradient`` inside)."""

WEIGHTED_DETAIL = "; weighted"
"""The suffix of a :attr:`EventKind.FORWARD_NONFINITE` detail from a layer whose output is fixed by
its input and its own parameters."""

EVENT_DTYPES: dict[str, str] = {
    "step": _I64, "layer": _OBJ, "tensor": _OBJ, "depth": _I64, "event": _OBJ, "detail": _OBJ,
    "rank": _I64, "source": _OBJ,
}
"""The pandas dtype of every :class:`Event` field."""


class Issue(str, Enum):
    """What a finding is about."""

    VANISHING = "vanishing"
    EXPLODING = "exploding"
    NONFINITE = "nonfinite"
    CUT_GRAPH = "cut_graph"
    DEAD = "dead"
    OVERFLOW = "overflow"
    """A loss scaler skipped steps because the scaled gradients overflowed."""
    STALLED = "stalled"
    """A parameter's update/weight ratio collapsed against its own history, or sits at zero,
    while the other layers learn: it has stopped learning."""
    UPDATE_TOO_LARGE = "update_too_large"
    """A parameter's update/weight ratio jumped far above its own history."""
    LOSS_SPIKE = "loss_spike"
    """The loss jumped far above its own recent history."""
    INTERNAL_ERROR = "internal_error"


class Cause(str, Enum):
    """Where to look first for the reason behind a finding (its ``cause`` column)."""

    DATA = "data"
    """The model's input held NaN or Inf: the batch, not the model."""
    OPTIMIZER = "optimizer"
    """Every layer changed together: the learning rate or the optimizer, not one layer."""
    LAYER = "layer"
    """One layer's weights or its code (an initialisation, a weight far too large or small,
    a saturating activation)."""
    NUMERICS = "numerics"
    """An operation made NaN or Inf (or overflowed) from finite inputs: its formula needs an
    epsilon, a clamp or a stable form."""
    GRAPH = "graph"
    """The gradient stops flowing: a ``detach()``, ``stop_gradient`` or numpy round trip."""


class Severity(str, Enum):
    """How bad a finding is. ``error`` findings make ``graddebug report`` exit with 1."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @classmethod
    def rank(cls, value: str) -> int:
        """How bad a severity is, for sorting: 3 for ``error`` down to 1 for ``info``, and 0
        for a value a third-party detector made up."""
        return _SEVERITY_RANK.get(value, 0)


_SEVERITY_RANK: dict[str, int] = {Severity.ERROR.value: 3, Severity.WARNING.value: 2,
                                  Severity.INFO.value: 1}


class Finding(NamedTuple):
    """One diagnosis.

    Attributes:
        step: First step at which the problem was seen.
        layer: The guilty layer (or tap, or parameter owner).
        tensor: The tensor within the layer (``"output"``, ``"weight"``, ...); ``""`` if none.
        issue: An :class:`Issue` value (plugins may add others).
        severity: A :class:`Severity` value.
        value: The measured value the threshold was compared with (NaN if none applies).
        threshold: The threshold it crossed (NaN if none applies).
        message: A sentence that names the layer and says what to try.
        rank: The rank whose rows show the problem: for a ``nonfinite`` finding the rank
            where the NaN or Inf was born. 0 in one process; :data:`ALL_RANKS` where a
            multi-rank run's combined rows show it.
        source: ``file:line`` of the operation behind a ``nonfinite`` or ``cut_graph``
            finding, where op-level capture saw it (``ops=True``, or ``escalate=True``); else
            empty.
        cause: A :class:`Cause` value, where to look first; empty where no cause applies
            (``internal_error``, a third-party detector that names none, runs written before
            the column existed).
    """

    step: int
    layer: str
    tensor: str
    issue: str
    severity: str
    value: float
    threshold: float
    message: str
    rank: int = 0
    source: str = ""
    cause: str = ""


FINDING_COLUMNS: tuple[str, ...] = Finding._fields

FINDING_DTYPES: dict[str, str] = {
    "step": _I64, "layer": _OBJ, "tensor": _OBJ, "issue": _OBJ, "severity": _OBJ,
    "value": _F64, "threshold": _F64, "message": _OBJ, "rank": _I64, "source": _OBJ,
    "cause": _OBJ,
}
"""The pandas dtype of every :class:`Finding` field."""
