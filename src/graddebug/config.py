"""Thresholds of the built-in diagnoses: one typed, validated config with documented defaults."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graddebug.errors import ConfigError, MissingFrameworkError, close_matches

__all__ = ["DISABLE_VARIABLE", "Setting", "Thresholds", "as_number", "disabled", "find_pyproject",
           "settings"]

def as_number(value: object, *, integral: bool = False) -> int | float | None:
    """Return ``value`` as a plain Python number, or None when it is not a real number.

    numpy scalars (``np.int64``, ``np.float32``, ...) count as numbers, so that values read
    from arrays work wherever a literal does; they come back as ``int`` or ``float`` so that
    metadata and JSON files never hold a numpy type. Booleans, strings and tensors (also 0-d
    ones) are not numbers.

    Args:
        value: What the user gave.
        integral: Accept integers only (``5`` and ``np.int64(5)``, not ``5.0``).

    Returns:
        An ``int`` for an integral value, a ``float`` for another real one, else None.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None  # np.bool_ is no numbers.Real; a torch tensor is neither
    if isinstance(value, numbers.Integral):
        return int(value)
    if integral:
        return None
    return float(value)


_COUNTS = {"growth_window": "steps", "overflow_steps": "steps", "history_window": "steps",
           "history_min": "steps", "history_numel": "entries", "history_sustain_steps": "steps"}
"""The thresholds that count something, and must be ints."""


@dataclass(frozen=True)
class Thresholds:
    """Where each built-in diagnosis starts to fire. All values must be finite and positive.

    ``docs/diagnoses.md`` explains each default and where it comes from.

    The depth-ratio rules compare layers by the root mean square of their gradient entries
    (``norm / sqrt(numel)``), not by norms: norms of tensors of different sizes differ by the
    square root of their sizes. A layer is flagged only where the ratio, spread over the layers
    between it and the last one, is also a steady per-layer factor (``*_gain``): gradients that
    vanish or explode compound layer by layer, while a healthy network's head, pooling and
    normalisation change the scale once. Measured with ``benchmarks/calibrate_thresholds.py
    --zoo`` at initialisation: healthy real networks reach RMS ratios of 477 (Keras
    EfficientNetB0), 84 (Keras ResNet50) and 42 (a transformers ResNet-50) over 175-236 layers,
    at most 1.03 per layer, and transformers GPT-2/Llama 7-10 at 1.09-1.11 per layer; the
    broken scenario-4 networks reach 694-3.6e4 at 1.35-2.6 per layer, and the sigmoid stack
    1.2e-10 at 0.35 per layer.

    Attributes:
        vanishing_ratio: Vanishing when ``rms(first layer) / rms(last layer)`` falls below
            this (AUTOTRAINER's depth ratio, 1e-3) ...
        vanishing_first: ... and the first layer's norm is also below this (AUTOTRAINER, 1e-4)
            ...
        vanishing_gain: ... and the ratio is at most this factor per layer in between
            (``ratio ** (1 / layers)``; 0.8: the sigmoid stack is at 0.35; healthy networks
            reach 0.79-0.89 per layer, but none a ratio below 0.03).
        vanishing_floor: Vanishing when a layer's median norm over steps is positive but below
            this (the TorchLens/DeepDiagnosis absolute rule, 1e-7).
        exploding_norm: Exploding when a gradient's root mean square per entry
            (norm/sqrt(numel)) exceeds this (TorchLens' 1e4, applied per entry: as a norm it
            fires on healthy large tensors by size alone, e.g. 1.9e5 on ResNet50's first
            kernel, whose RMS is 2e3).
        exploding_ratio: Exploding when ``rms(first) / rms(last)`` exceeds this
            (AUTOTRAINER, 70) ...
        exploding_gain: ... and the ratio is at least this factor per layer in between (1.15:
            about the geometric middle between the 1.03 of healthy networks whose ratio
            exceeds 70 and the 1.35 of the mildest broken one).
        source_share: A finding names one layer as the source of a jump or collapse when its
            backward alone accounts for at least this part of the change, in log scale,
            between the last layer and the most extreme one (0.5: a weight a million times
            too large accounts for nearly all of it; a sigmoid layer in a stack of twelve for
            a twelfth). Otherwise it names the layer farthest from the loss.
        growth_factor: Exploding when the smoothed total gradient norm grows by more than this
            factor from the first window of steps to a later one (100).
        growth_window: Steps per smoothing window for the growth rule; the rule needs at least
            two windows of recorded steps (5).
        dead_fraction: Dead when at least this fraction of a layer's units (features or
            channels) got an all-zero gradient over the whole batch, in the median step
            (AUTOTRAINER's gamma, 0.7).
        overflow_steps: A loss scaler's skipped steps are an error, not a warning, from this
            many consecutive recorded steps on (10: each skip halves the scale, and a healthy
            run skips a handful at its start while the scale settles from 65536), or as soon
            as a skipped step's scale is below 1 (the gradients overflow unscaled).
        history_window: The history rules judge each tensor against its last this many
            recorded steps (the median and MAD of its log10 gradient norm, weight norm and
            update/weight ratio; the loss's own); the recent-window ``dead`` rule looks this
            far back (20).
        history_min: A tensor is judged once its history holds this many steps (8; at most
            ``history_window`` count).
        history_factor: A parameter's update/weight ratio jumps or collapses when it lies this
            many times above or below its median, beyond what every ratio did at that step;
            a weight norm changed outside the optimizer when it moved this many times since
            the last recorded step (10) ...
        history_grad_factor: ... and a gradient norm (layer outputs, taps, parameters) when
            it lies this many times above or below its median, beyond what every gradient did
            at that step (100: healthy runs move one tensor's gradient by up to 37x in torch
            and 620x in a Keras attention query during warmup, see ``docs/diagnoses.md``) ...
        history_sigma: ... and at least this many robust standard deviations (1.4826 MAD, in
            log10) from it (6: a tensor that swings a lot from step to step is judged by its
            own spread).
        history_numel: Tensors of fewer entries are left out of the history rules (16: the
            norm of a tiny bias swings by 100x when its entries cross zero).
        history_sustain_grad_factor: A sustained shift: a gradient norm that stays this many
            times above or below the median of its window before the shift (frozen), net of
            each step's common move and beyond ``history_sigma``, for
            ``history_sustain_steps`` recorded steps in a row (50: over the 18 healthy
            references of ``benchmarks/calibrate_history.py`` the largest 3-step streak is
            24x, a Keras GPT's attention query in warmup, and a healthy char GPT trained with
            SGD and momentum 0.9 (lr 0.3, warmup and cosine) held a LayerNorm bias's gradient
            23x below its median for 3 steps in warmup; 50 leaves twice that margin) ...
        history_sustain_factor: ... and an update/weight ratio this many times (6: there the
            largest healthy streak is 3.8x, a Keras GPT's attention query kernel, and 3x a
            Keras CNN head late in the cosine; SGD runs with and without momentum stayed
            under it too) ...
        history_sustain_steps: ... for this many recorded steps (3: the shift is reported
            on its third step; with 4 or 5 steps the healthy largest factors are 8x and 3x).
            A weight norm is also compared with those of this many recorded steps before
            it, for ``history_factor``: a healthy one moves 1.5x in a step at most, 3.4x in
            three.
        stall_floor: ``stalled`` when a parameter's update/weight ratio is at or below this
            (1e-8; an update of exactly 0 while its gradient is not) while the other layers'
            median ratio is at least 1000 times more.
        loss_sigma: ``loss_spike`` when the loss lies this many robust standard deviations
            above the median of its last ``history_window`` steps (6, as OLMo-core's rule) ...
        loss_rise: ... and above it by at least this fraction of the larger of that median
            and the median of the run's first ``history_window`` losses (1.0: a loss that is
            near 0 late in a run triples on a batch with one hard example, which is no spike).
    """

    vanishing_ratio: float = 1e-3
    vanishing_first: float = 1e-4
    vanishing_gain: float = 0.8
    vanishing_floor: float = 1e-7
    exploding_norm: float = 1e4
    exploding_ratio: float = 70.0
    exploding_gain: float = 1.15
    source_share: float = 0.5
    growth_factor: float = 100.0
    growth_window: int = 5
    dead_fraction: float = 0.7
    overflow_steps: int = 10
    history_window: int = 20
    history_min: int = 8
    history_factor: float = 10.0
    history_grad_factor: float = 100.0
    history_sigma: float = 6.0
    history_numel: int = 16
    history_sustain_grad_factor: float = 50.0
    history_sustain_factor: float = 6.0
    history_sustain_steps: int = 3
    stall_floor: float = 1e-8
    loss_sigma: float = 6.0
    loss_rise: float = 1.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            number = as_number(value)
            if number is None:
                raise ConfigError(
                    f"threshold {field.name}={value!r} must be a number, "
                    f"for example {field.default!r}."
                )
            if not math.isfinite(number) or number <= 0:
                raise ConfigError(
                    f"threshold {field.name}={value!r} must be finite and positive; "
                    f"the default is {field.default!r}."
                )
            # Store plain Python numbers: thresholds go into JSON files and messages.
            object.__setattr__(self, field.name, number)
        for name, what in (("dead_fraction", "a fraction of units"),
                           ("source_share", "a share of a jump or collapse")):
            if getattr(self, name) > 1:
                raise ConfigError(
                    f"threshold {name}={getattr(self, name)!r} is {what} and must lie in "
                    f"(0, 1]; the default is {getattr(type(self), name)!r}."
                )
        for name, what in _COUNTS.items():
            if not isinstance(getattr(self, name), int):
                raise ConfigError(
                    f"threshold {name}={getattr(self, name)!r} counts {what} and must be an int."
                )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Return the names of every threshold, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> Thresholds:
        """Return a copy with some thresholds changed.

        Raises:
            ConfigError: A name is not a threshold, or a value is not usable.
        """
        for name in changes:
            if name not in self.names():
                raise ConfigError(
                    f"unknown threshold {name!r}.{close_matches(name, self.names())} "
                    f"Known thresholds: {', '.join(self.names())}."
                )
        return dataclasses.replace(self, **changes)

    @classmethod
    def coerce(cls, value: Thresholds | Mapping[str, Any] | None) -> Thresholds:
        """Build thresholds from ``None`` (the defaults), a mapping, or a Thresholds.

        Raises:
            ConfigError: The value is of another type, or holds an unusable threshold.
        """
        if value is None:
            return cls()
        if isinstance(value, Thresholds):
            return value
        if isinstance(value, Mapping):
            return cls().replace(**dict(value))
        raise ConfigError(
            f"thresholds={value!r} must be a graddebug.Thresholds or a dict of threshold values."
        )

    def as_dict(self) -> dict[str, float]:
        """Return the thresholds as a plain dict (for metadata and reports)."""
        return {name: getattr(self, name) for name in self.names()}


# -- configuration without code: the environment and pyproject.toml ---------------------------

DISABLE_VARIABLE = "GRADDEBUG_DISABLE"
"""Set to ``1`` (``true``, ``yes``, ``on``), every ``watch`` records nothing and attaches
nothing."""

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Setting:
    """A value set outside the code, and where it was set (for messages).

    Attributes:
        value: The value: a TOML value, or the text of an environment variable.
        source: ``"GRADDEBUG_EVERY"``, or ``"/path/pyproject.toml [tool.graddebug]"``.
        text: Whether ``value`` is the text of an environment variable, still to be parsed.
    """

    value: Any
    source: str
    text: bool


def parse_flag(text: str, source: str) -> bool:
    """An environment variable's text as a bool (``1``/``0``, ``true``/``false``, ...).

    Raises:
        ConfigError: Any other text; the message names the variable.
    """
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ConfigError(f"{source}={text!r} must be 1 or 0 (true/false, yes/no, on/off).")


def disabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``GRADDEBUG_DISABLE`` switches graddebug off.

    Raises:
        ConfigError: The variable holds something other than a yes or a no.
    """
    text = (os.environ if environ is None else environ).get(DISABLE_VARIABLE)
    return text is not None and parse_flag(text, DISABLE_VARIABLE)


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest ``pyproject.toml``, from ``start`` (the current directory) upwards, as
    pytest, ruff and mypy find theirs; None when there is none."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def _table(path: Path) -> dict[str, Any]:
    """``[tool.graddebug]`` of ``path``, empty when it has none (the file is parsed only when
    it mentions the table).

    Raises:
        ConfigError: The file is not valid TOML, or the table is not a table.
        MissingFrameworkError: Python 3.10 without tomli, and the file has the table.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read for [tool.graddebug]: {exc}") from exc
    if b"[tool.graddebug" not in data:
        return {}
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[import-not-found,no-redef]
        except ModuleNotFoundError as exc:
            raise MissingFrameworkError(
                f"{path} holds [tool.graddebug], and reading it on Python 3.10 needs tomli: "
                "pip install tomli") from exc
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read as TOML for [tool.graddebug]: {exc}") from exc
    table = document.get("tool", {}).get("graddebug", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.graddebug] must be a table, not {table!r}.")
    return table


def settings(options: tuple[str, ...], environ: Mapping[str, str] | None = None,
             start: Path | None = None) -> tuple[dict[str, Setting], dict[str, Setting]]:
    """The ``watch`` options and the thresholds set outside the code: each
    ``GRADDEBUG_<NAME>`` environment variable, over ``[tool.graddebug]`` (options) and
    ``[tool.graddebug.thresholds]`` of the nearest ``pyproject.toml``.

    Args:
        options: The option names that may be set this way.
        environ: The environment (``os.environ``).
        start: Where the search for ``pyproject.toml`` starts (the current directory).

    Returns:
        The options and the thresholds that are set, by name.

    Raises:
        ConfigError: The file is not valid TOML, or names an option or threshold that does
            not exist (with the closest names).
    """
    environ = os.environ if environ is None else environ
    found: tuple[dict[str, Setting], dict[str, Setting]] = ({}, {})
    path = find_pyproject(start)
    table = _table(path) if path is not None else {}
    thresholds = table.pop("thresholds", {})
    for names, given, section, into in ((options, table, "[tool.graddebug]", found[0]),
                                        (Thresholds.names(), thresholds,
                                         "[tool.graddebug.thresholds]", found[1])):
        if not isinstance(given, dict):
            raise ConfigError(f"{path}: {section} must be a table, not {given!r}.")
        for name, value in given.items():
            if name not in names:
                raise ConfigError(
                    f"{path} {section} sets {name!r}, which is not one that can be set "
                    f"there.{close_matches(name, names)} Those are: {', '.join(names)}.")
            into[name] = Setting(value, f"{path} {section}", text=False)
        for name in names:
            variable = f"GRADDEBUG_{name.upper()}"
            if variable in environ:
                into[name] = Setting(environ[variable], variable, text=True)
    return found
