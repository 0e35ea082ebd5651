"""The options of ``graddebug.watch``, as an adapter receives them: :class:`WatchOptions`, the one
place where each option is documented."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from graddebug.capture.layers import Intervention
from graddebug.config import Thresholds
from graddebug.errors import ConfigError, close_matches

if TYPE_CHECKING:
    import pluggy

__all__ = ["ADAPTER_OPTIONS", "WATCHER_OPTIONS", "WATCH_OPTIONS", "WatchOptions",
           "check_option_names", "options_set"]


@dataclass(frozen=True)
class WatchOptions:
    """The options of ``graddebug.watch`` (and of :class:`~graddebug.capture.watcher.Watcher`),
    validated by the core and read by the Watcher and its adapter. This docstring is where the
    options are documented; ``watch``, the docs and the callbacks that take watch options
    point here. Their names are its fields (:data:`WATCH_OPTIONS`); an adapter declares which
    of :data:`ADAPTER_OPTIONS` it honours, and ``watch`` refuses the others when they are set
    (:class:`~graddebug.errors.UnsupportedOptionError`). Options with plain values can also be
    set outside the code, by ``GRADDEBUG_<OPTION>`` or ``[tool.graddebug]`` in
    ``pyproject.toml`` (the argument wins; see ``docs/options.md``).

    Attributes:
        params: ``{"W": W, ...}``: tensors (torch) or variables (TF) recorded as parameters,
            for code without a model; None with a model.
        layers: Names, globs (``"encoder.*"``) or layer types to capture; None for the default
            (every leaf module and every module that owns parameters in torch, every leaf
            layer in Keras). With ``ops=True`` it also takes op-site names or globs, kept in
            :attr:`op_sites`.
        keep: Layer or tap names whose full gradients are kept as dense numpy arrays
            (``dbg.tensors(step)``); bfloat16 and float16 gradients as float32.
        keep_steps: How many recorded steps of ``keep=`` gradients are held, the latest (10);
            None holds every step. A warning fires once they pass 1 GiB.
        intervene: ``{name: {"clip_norm": 1.0, "clip_value":, "mask":, "scale":}}``: changes to
            the gradient at a layer output or tap, by name, applied in flight in the order
            mask, scale, clip by value, clip by norm; the rows record ``pre_norm`` too.
        every: Record one step in ``every`` (steps 0, every, 2*every, ...); interventions act
            on every step.
        outputs: Capture the gradient at layer outputs (False records parameters only, the
            cheapest mode).
        param_stats: ``"norm"`` (default) computes only the norm of parameter gradients (one
            fused pass); ``"full"`` adds mean, std and absmax.
        optimizer: The user's optimizer. torch: each of its steps closes a graddebug step, so
            the loop needs no ``dbg.step()``. Keras: the gradients it applies are recorded, so
            ``dbg.step()`` needs none.
        scaler: The loss scaler of mixed-precision training (``torch.amp.GradScaler``), or
            None: statistics are divided by its scale, and the steps it skips on overflow are
            marked (``skipped_step`` events, an ``overflow`` finding), not taken for NaN
            faults. Keras needs none: a ``LossScaleOptimizer`` is found through the model's or
            ``optimizer=``'s optimizer.
        thresholds: The diagnoses' thresholds (given as a :class:`graddebug.Thresholds` or a
            dict of overrides).
        strict: Raise on a bug inside a graddebug hook instead of recording it as an
            ``internal_error`` finding.
        log_dir: A new (or empty) directory to stream the run to while it trains (Parquet
            parts and a JSON file; :func:`graddebug.load` reads it, also after a crash). Only
            rows not yet written stay in memory; ``frame()`` reads the run back.
        flush_every: With ``log_dir``, write a part every this many recorded steps (and at
            least every 30 s).
        plugin_manager: The pluggy manager whose adapters and detectors serve the Watcher;
            None for the process-wide one (built-in plugins and installed entry points).
        tensorboard: A directory to stream TensorBoard event files to while it trains
            (per-tensor norms as scalars, norms over layers as histograms); needs
            ``pip install graddebug[tensorboard]``.
        ops: Op-level capture on every recorded step: the operation and source line behind
            NaN/Inf and cut graphs (the ``source`` column of ``nonfinite`` and ``cut_graph``
            findings); torch also records the gradient at the output of every operation of the
            forward pass (rows of kind ``"op"``, ``tensor`` the op site
            ``<layer>.<op>@<file>:<line>``). ``layers=``, ``keep=`` and ``intervene=`` then
            also take op-site names or globs (``"block.torch.log@*"``).
        escalate: Op-level capture for one recorded step only, the one after a layer-level
            ``nonfinite`` or ``cut_graph`` finding (once per issue and layer;
            :attr:`WatchContext.capture_ops` says when), so that a recurring problem gets its
            source line without paying for ``ops=True`` on every step.
        full_stats_every: One recorded step in this many (10) measures the per-unit extremes
            of layer-output gradients (``absmax``, ``zero_frac``); so do the step after a
            NaN/Inf or a 10x jump in a layer output's norm, and every recorded step when
            ``every`` > 1. The others leave those two columns NaN; 1 measures everything on
            every recorded step. See :mod:`graddebug.capture.tiers` (the Watcher decides,
            :attr:`WatchContext.full_stats` tells the adapter).
        raise_on: Issues (``"nonfinite"``, ``"exploding"``, ... any of
            :class:`graddebug.Issue`) at which ``dbg.step()`` raises
            :class:`graddebug.FindingError`, carrying the findings' rows, at the step where a
            finding of one of them is first reported (as ``detect_anomaly`` stops at a NaN):
            a ``nonfinite`` at the step it happens, the rules judged over many steps as soon as
            the live findings report them. Empty (the default) never raises. The training
            callbacks stop training with their ``stop_on=`` instead.
        op_sites: The op-site names or globs that ``layers=`` asks for, besides its layers
            (derived from ``layers=``, not an option of its own).
    """

    params: Mapping[str, Any] | None = None
    layers: Sequence[Any] | None = None
    keep: frozenset[str] = frozenset()
    keep_steps: int | None = 10
    intervene: Mapping[str, Intervention] = field(default_factory=dict)
    every: int = 1
    outputs: bool = True
    param_stats: Literal["norm", "full"] = "norm"
    optimizer: Any = None
    scaler: Any = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    strict: bool = False
    log_dir: str | os.PathLike[str] | None = None
    flush_every: int = 100
    plugin_manager: pluggy.PluginManager | None = None
    tensorboard: Path | None = None
    ops: bool = False
    escalate: bool = False
    full_stats_every: int = 10
    raise_on: frozenset[str] = frozenset()
    op_sites: frozenset[str] = field(default=frozenset(), metadata={"derived": True})

    @property
    def named(self) -> set[str]:
        """The names that ``keep=`` and ``intervene=`` ask for, and the op sites ``layers=``
        asks for: each must match something by the end of the run."""
        return set(self.keep) | set(self.intervene) | set(self.op_sites)


WATCH_OPTIONS: tuple[str, ...] = tuple(
    f.name for f in fields(WatchOptions) if not f.metadata.get("derived"))
"""The keyword options of ``watch`` and ``Watcher``, in signature order (everything after
``model``), read from the fields of :class:`WatchOptions`: every list of option names is this
one. Callers that pass options on to ``watch`` (``check``, the training callbacks) check names
against it; ``tests/test_options.py`` holds ``Watcher.__init__``'s signature to it."""

WATCHER_OPTIONS: frozenset[str] = frozenset({
    "keep_steps", "every", "thresholds", "strict", "log_dir", "flush_every", "plugin_manager",
    "tensorboard", "raise_on"})
"""The options the Watcher honours itself, whatever the adapter: the steps it records, its
diagnoses, its files and its plugins. An adapter declares none of them."""

ADAPTER_OPTIONS: tuple[str, ...] = tuple(n for n in WATCH_OPTIONS if n not in WATCHER_OPTIONS)
"""The options an adapter honours or not, each declared in its ``watch_options``: the Watcher
refuses one set to another value than its default when the adapter does not declare it."""


def options_set(options: WatchOptions) -> list[str]:
    """The options of ``options`` that differ from their default, in signature order.

    A collection counts as set when it is not empty, and an object whose default is None when
    it is not None; nothing is compared by value that could be a tensor.

    Args:
        options: Validated options.

    Returns:
        Their names.
    """
    given = []
    for f in fields(options):
        if f.metadata.get("derived"):
            continue
        value = getattr(options, f.name)
        factory: Any = f.default_factory
        default = factory() if f.default is MISSING else f.default
        if default is None:
            changed = value is not None
        elif isinstance(default, (frozenset, dict)):
            changed = len(value) > 0
        else:
            changed = bool(value != default)
        if changed:
            given.append(f.name)
    return given


def check_option_names(options: Iterable[str], where: str, known: Sequence[str],
                       own: Sequence[str] = ()) -> None:
    """Reject option names that are neither ``known`` nor the caller's ``own``, early: the
    one check behind ``watch()``, ``check()`` and the training callbacks, so that a typo
    (``evry=``) gets the same typed answer everywhere instead of Python's bare ``TypeError``.

    Args:
        options: The keyword names given.
        where: The caller, for the message (``"watch()"``, ``"check()"``).
        known: The ``watch`` options the caller passes on (:data:`WATCH_OPTIONS`, or some).
        own: The caller's own options, accepted and listed in the message.

    Raises:
        ConfigError: An unknown name, with the closest known ones.
    """
    every = [*own, *known]
    for name in options:
        if name not in every:
            raise ConfigError(
                f"{where} got an unknown option {name!r}.{close_matches(name, every)} "
                f"Options: {', '.join(every)}."
            )
