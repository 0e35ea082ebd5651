"""The options of ``watch``, checked once on construction and handed to the adapter.

A wrong option is the user's mistake, so each check raises a :class:`ConfigError` that quotes
the value and says what would work, before anything is attached or written. Values that go
into the run's JSON file (``every``, ``flush_every``) are stored as plain Python numbers.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from graddebug.adapter import Adapter, StepResult, WatchOptions
from graddebug.adapter.options import WATCH_OPTIONS, check_option_names
from graddebug.capture.layers import Intervention, is_op_site, parse_interventions
from graddebug.config import (
    DISABLE_VARIABLE,
    Setting,
    Thresholds,
    as_number,
    disabled,
    parse_flag,
    settings,
)
from graddebug.errors import ConfigError, MissingFrameworkError, UnknownNameError, close_matches
from graddebug.records import Issue, Kind
from graddebug.runs.layout import check_run_path

__all__ = ["CONFIGURABLE", "EarlyNames", "build_options", "check_flag", "check_log_dir",
           "check_raise_on", "check_tensorboard", "check_without_model", "configured",
           "unmatched_error", "with_config"]


def _as_list(option: str, value: Any, example: str) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, (str, type)):
        return [value]
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(f"{option}={value!r} must be {example}.")
    return list(value)


def _positive_int(option: str, value: Any, meaning: str) -> int:
    number = as_number(value, integral=True)
    if number is None or number < 1:
        raise ConfigError(f"{option}={value!r} must be a positive int ({meaning}).")
    return int(number)


def check_flag(option: str, value: Any) -> bool:
    """Return ``value`` as a bool, refusing anything that is only truthy.

    ``outputs="no"`` is a non-empty string, so a truth test would read it as True: the
    opposite of what was meant.

    Args:
        option: The option's name, for the message.
        value: What the user gave (``bool`` or ``numpy.bool_``).

    Raises:
        ConfigError: ``value`` is not a bool.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ConfigError(f"{option}={value!r} must be True or False.")


def check_log_dir(log_dir: Any) -> None:
    """Check that ``log_dir`` can become a run directory, before training starts.

    Without this, a path under a regular file fails with ``NotADirectoryError`` on entering,
    and a name that is not valid UTF-8 makes every flush fail, each failure recorded only as
    an internal error.

    Args:
        log_dir: The ``log_dir=`` option (None for none).

    Raises:
        ConfigError: ``log_dir`` is not a ``str`` or path, is not valid UTF-8, or lies under
            a file.
    """
    if log_dir is not None:
        check_run_path(log_dir, "log_dir")


def _check_params(params: Mapping[str, Any] | None) -> None:
    """Check ``params=``: None, or a non-empty mapping of names to tensors or variables.

    Args:
        params: The ``params=`` option.

    Raises:
        ConfigError: ``params`` is not a mapping, or is empty.
    """
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(
            f"params={params!r} must map names to tensors or variables, "
            'for example params={"W": W, "b": b}.'
        )
    if params is not None and not params:
        raise ConfigError("params={} is empty; pass at least one tensor, or leave it out.")


def _keep_names(keep: Sequence[str] | str | None) -> list[str] | None:
    """Check ``keep=`` and return its names as a list.

    Args:
        keep: The ``keep=`` option: a name, a list of names, or None.

    Returns:
        The names, or None when the option was not given.

    Raises:
        ConfigError: ``keep`` is not a name or a list of them, or an entry is not a str.
    """
    kept = _as_list("keep", keep, 'a layer or tap name or a list of names, e.g. keep=["fc1"]')
    for name in kept or ():
        if not isinstance(name, str):
            raise ConfigError(f"keep entry {name!r} must be a layer or tap name (a str).")
    return kept


def _refuse_op_sites(named_by: Iterable[tuple[str, Iterable[str]]]) -> None:
    """Refuse op-site names when op-level capture is off: nothing would ever match them.

    Args:
        named_by: Each option's name and the names it gives.

    Raises:
        ConfigError: An option names an op site; the message shows the call with ``ops=True``.
    """
    for option, names in named_by:
        named = [n for n in names if is_op_site(n)]
        if named:
            raise ConfigError(
                f"{option}= names op site {named[0]!r}, but op sites are captured only with "
                f"ops=True: watch(model, ops=True, {option}=...)."
            )


def build_options(given: Mapping[str, Any]) -> WatchOptions:
    """Check the options of ``watch`` and return them as the Watcher and its adapter read
    them.

    Args:
        given: Every option of :data:`~graddebug.adapter.options.WATCH_OPTIONS` by name, as
            documented on :class:`WatchOptions`; ``keep_steps`` and ``thresholds`` come
            checked already (:func:`graddebug.capture.kept.check_keep_steps`,
            :meth:`Thresholds.coerce`), and the adapter checks that ``scaler`` is a scaler of
            its framework.

    Raises:
        ConfigError: An option has an unusable value, or an entry of ``layers=``, ``keep=``
            or ``intervene=`` names an op site without ``ops=True``.
        MissingFrameworkError: ``log_dir`` was given and pyarrow is missing, or
            ``tensorboard`` was given and tensorboardX is missing.
    """
    options = dict(given)
    options["flush_every"] = _positive_int("flush_every", given["flush_every"], "steps")
    options["every"] = _positive_int("every", given["every"], "1 records every step")
    options["full_stats_every"] = _positive_int(
        "full_stats_every", given["full_stats_every"],
        "1 measures every statistic on every recorded step")
    for flag in ("outputs", "strict", "ops", "escalate"):
        options[flag] = check_flag(flag, given[flag])
    check_log_dir(given["log_dir"])
    if given["param_stats"] not in ("norm", "full"):
        raise ConfigError(f"param_stats={given['param_stats']!r} must be 'norm' or 'full'.")
    _check_params(given["params"])
    (options["layers"], options["op_sites"], options["keep"],
     options["intervene"]) = _names(given["layers"], given["keep"], given["intervene"],
                                    options["ops"])
    options["tensorboard"] = check_tensorboard(given["tensorboard"])
    options["raise_on"] = check_raise_on(given["raise_on"])
    return WatchOptions(**options)


def _names(layers: Sequence[Any] | str | type | None, keep: Sequence[str] | str | None,
           intervene: Mapping[str, Any] | None, ops: bool
           ) -> tuple[list[Any] | None, frozenset[str], frozenset[str], dict[str, Intervention]]:
    """The ``layers=`` entries that are layers, those that are op sites, the ``keep=`` names
    and the interventions by name.

    Raises:
        ConfigError: An entry is unusable, or names an op site without ``ops=True``.
    """
    kept = _keep_names(keep)
    chosen = _as_list("layers", layers, 'a layer name, a glob, a layer type, or a list of '
                      'them, e.g. layers=["encoder.*", torch.nn.Linear]')
    sites = [n for n in chosen or () if is_op_site(n)]
    interventions = parse_interventions(intervene)
    if not ops:
        _refuse_op_sites((("layers", sites), ("keep", kept or ()),
                          ("intervene", interventions)))
    layer_names = [n for n in chosen if not is_op_site(n)] if chosen is not None else None
    return layer_names, frozenset(sites), frozenset(kept or ()), interventions


def check_tensorboard(tensorboard: Any) -> Path | None:
    """Check ``watch(tensorboard=...)``: a directory path, with tensorboardX installed.

    Raises:
        ConfigError: ``tensorboard`` is not a path.
        MissingFrameworkError: tensorboardX is not installed.
    """
    if tensorboard is None:
        return None
    if not isinstance(tensorboard, (str, os.PathLike)) or not str(tensorboard):
        raise ConfigError(f"tensorboard={tensorboard!r} must be a directory path.")
    # Checked here rather than at the first recorded step, so a missing package fails at once.
    if importlib.util.find_spec("tensorboardX") is None:
        raise MissingFrameworkError(
            "watch(tensorboard=...) writes TensorBoard event files with tensorboardX, which is "
            "not installed: pip install graddebug[tensorboard]"
        )
    return Path(tensorboard)


def check_raise_on(raise_on: Any) -> frozenset[str]:
    """Check ``watch(raise_on=...)``: an issue name or several, each one of
    :class:`graddebug.Issue`.

    Raises:
        ConfigError: An entry is not an issue name; the message gives the closest ones.
    """
    known = [issue.value for issue in Issue]
    issues = _as_list("raise_on", raise_on, 'an issue name or a list of them, e.g. '
                      'raise_on=("nonfinite", "exploding")') or []
    for issue in issues:
        if not isinstance(issue, str) or issue not in known:
            raise ConfigError(
                f"raise_on={issue!r} is not an issue.{close_matches(str(issue), known)} "
                f"Issues: {', '.join(known)}.")
    return frozenset(issues)


_LOOKALIKE = str.maketrans("oilsz", "01152")
"""Letters typed for the digits they look like: ``keep=["O"]`` for the module ``"0"``."""


def _suggest(name: str, known: Sequence[str]) -> str:
    """A ``" Did you mean ...?"`` suffix for ``name``: the closest names, or those that read
    the same once case and look-alike characters are set aside (``"O"`` for ``"0"``)."""
    close = close_matches(name, known)
    if close:
        return close
    folded = name.lower().translate(_LOOKALIKE)
    same = [k for k in known if k.lower().translate(_LOOKALIKE) == folded]
    return " Did you mean " + ", ".join(repr(k) for k in same[:3]) + "?" if same else ""


def unmatched_error(wanted: Iterable[str], adapter: Adapter | None, when: str
                    ) -> UnknownNameError | None:
    """The error for the ``keep=``/``intervene=`` (and op-site) names that matched no layer and
    no tap, or None when each matched.

    Args:
        wanted: The names asked for.
        adapter: The Watcher's adapter, which knows what matched (None: nothing did).
        when: When the names were checked, for the message (``"during the run"``).
    """
    matched = adapter.matched_names() if adapter is not None else set()
    known = adapter.known_names() if adapter is not None else []
    unmatched = sorted(set(wanted) - matched)
    if not unmatched:
        return None
    details = "; ".join(f"{n!r}{_suggest(n, known)}" for n in unmatched)
    sites = (" Op-site names and globs ('<layer>.<op>@<file>:<line>') match the ops of forward "
             "passes recorded with ops=True; see the tensor column of the frame's op rows."
             if any(is_op_site(n) for n in unmatched) else "")
    return UnknownNameError(
        f"keep=/intervene= names matched no layer and no tap {when}: {details} "
        f"Known names: {', '.join(known[:20]) or 'none'}.{sites}")


class EarlyNames:
    """Checks the ``keep=``/``intervene=`` names at the first ``dbg.step()`` that recorded
    gradients and brought no layer or tap name not seen before: every layer has run by then,
    and a typo must not wait for the end of training (the exit checks again, and checks op
    sites, which ``escalate=True`` captures on a few steps only).

    Args:
        named: The names asked for (:attr:`WatchOptions.named`).
    """

    def __init__(self, named: Iterable[str]) -> None:
        self._wanted: set[str] | None = {n for n in named if not is_op_site(n)} or None
        self._seen: set[str] = set()

    def start(self, adapter: Adapter | None) -> None:
        """Note the names known on entering (a torch model's modules, a Keras model's built
        layers), so that a step that adds none can be the one that checks."""
        if adapter is not None:
            self._seen = set(adapter.known_names())

    def after_step(self, adapter: Adapter | None, result: StepResult, step: int) -> None:
        """Check the names after recorded ``step``, once, when it is the step that can.

        Raises:
            UnknownNameError: A name matched no layer and no tap, with the closest names.
        """
        if self._wanted is None or adapter is None or all(
                r.kind == Kind.LOSS.value for r in result.records):
            return
        known = set(adapter.known_names())
        if known != self._seen:
            self._seen = known
            return
        wanted, self._wanted = self._wanted, None
        error = unmatched_error(wanted, adapter, f"by step {step}, in which every layer and "
                                "tap had run")
        if error is not None:
            raise error


def check_without_model(model: Any, options: WatchOptions) -> None:
    """Refuse the options that need a model when none was given.

    Raises:
        ConfigError: ``optimizer=`` with neither a model nor ``params=``, or ``ops=True`` or
            ``escalate=True`` without a model.
    """
    if model is None and options.params is None and options.optimizer is not None:
        raise ConfigError(
            f"optimizer={type(options.optimizer).__name__} was given with no model and no "
            "params=, so nothing says which adapter records its gradients: "
            "watch(model, optimizer=...), or watch(params={...}, optimizer=...).")
    if model is None and (options.ops or options.escalate):
        option = "ops" if options.ops else "escalate"
        raise ConfigError(
            f"{option}=True captures the operations of a model's forward pass, and no "
            f"model was given: watch(model, {option}=True). Without a model, tap() the "
            "tensors to watch.")


# -- options set outside the code ---------------------------------------------------------------

CONFIGURABLE: dict[str, str] = {
    "every": "int", "full_stats_every": "int", "flush_every": "int", "keep_steps": "int",
    "outputs": "flag", "strict": "flag", "ops": "flag", "escalate": "flag",
    "param_stats": "text", "tensorboard": "text", "raise_on": "names"}
"""The ``watch`` options that ``GRADDEBUG_<OPTION>`` and ``[tool.graddebug]`` may set, and how
an environment variable's text is read: a whole number, a flag (``1``/``0``), text, or names
separated by commas. The others belong in the code: a model's layer names, objects, and
``log_dir``, which must be a new directory for each run (one set for every Watcher of a
process would refuse the second)."""


def _value(setting: Setting, kind: str) -> Any:
    """A setting's value, its text parsed as ``kind`` when it came from the environment."""
    if not setting.text:
        return setting.value
    text = str(setting.value).strip()
    if kind == "flag":
        return parse_flag(text, setting.source)
    if kind == "names":
        return [n.strip() for n in text.split(",") if n.strip()]
    if kind == "int" or (kind == "number" and text.lstrip("+-").isdigit()):
        try:
            return int(text)
        except ValueError as exc:
            raise ConfigError(f"{setting.source}={text!r} must be a whole number.") from exc
    if kind == "number":
        try:
            return float(text)
        except ValueError as exc:
            raise ConfigError(f"{setting.source}={text!r} must be a number.") from exc
    return text


def _defaults() -> dict[str, Any]:
    """Every option at its default, as :func:`build_options` takes them."""
    defaults = {}
    for f in fields(WatchOptions):
        factory: Any = f.default_factory
        if not f.metadata.get("derived"):
            defaults[f.name] = factory() if f.default is MISSING else f.default
    return defaults


def with_config(given: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a ``watch``: those given, then ``GRADDEBUG_<OPTION>`` variables, then
    ``[tool.graddebug]`` of the nearest ``pyproject.toml``, then the defaults; thresholds
    likewise, one by one (``thresholds=`` as a :class:`Thresholds` is complete and wins).

    Raises:
        ConfigError: A value set outside the code is unusable; the message names the variable
            or the file.
    """
    options, thresholds = settings(tuple(CONFIGURABLE))
    merged = dict(given)
    for name, setting in options.items():
        if name in given:
            continue
        value = _value(setting, CONFIGURABLE[name])
        try:
            if name == "keep_steps":
                _positive_int(name, value, "recorded steps of keep= gradients to hold")
            build_options({**_defaults(), name: value})
        except ConfigError as exc:
            raise ConfigError(f"{setting.source}: {exc}") from exc
        merged[name] = value
    chosen = given.get("thresholds")
    if thresholds and (chosen is None or isinstance(chosen, Mapping)):
        values = {}
        for name, setting in thresholds.items():
            values[name] = _value(setting, "number")
            try:
                Thresholds().replace(**{name: values[name]})
            except ConfigError as exc:
                raise ConfigError(f"{setting.source}: {exc}") from exc
        merged["thresholds"] = {**values, **(chosen or {})}
    return merged


P = ParamSpec("P")
W = TypeVar("W")
log = logging.getLogger("graddebug")


def configured(init: Callable[Concatenate[W, P], None]) -> Callable[Concatenate[W, P], None]:
    """Wrap the Watcher's ``__init__``: option names checked (``evry=`` raises
    :class:`ConfigError` with the closest names, not a bare ``TypeError``), options set outside
    the code filled in (:func:`with_config`), and under ``GRADDEBUG_DISABLE=1`` nothing written
    (``log_dir=`` and ``tensorboard=`` dropped)."""
    @functools.wraps(init)
    def wrapper(self: W, /, *args: P.args, **kwargs: P.kwargs) -> None:
        check_option_names(kwargs, "watch()", ("model", *WATCH_OPTIONS))
        options = with_config(kwargs)
        if disabled():
            options = {k: v for k, v in options.items() if k not in ("log_dir", "tensorboard")}
            log.warning("graddebug: %s is set: this watch() attaches nothing and records "
                        "nothing.", DISABLE_VARIABLE)
        init(self, *args, **options)
    return wrapper
