"""The options of ``watch``, checked once on construction and handed to the adapter."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from graddebug.adapter import WatchOptions
from graddebug.capture.layers import parse_interventions
from graddebug.errors import ConfigError, MissingFrameworkError

__all__ = ["build_options", "check_tensorboard"]


def _as_list(value: Any) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, (str, type)):
        return [value]
    return list(value)


def build_options(*, params: Mapping[str, Any] | None, layers: Sequence[Any] | str | type | None,
                  keep: Sequence[str] | str | None, intervene: Mapping[str, Any] | None,
                  every: int, outputs: bool, param_stats: Literal["norm", "full"],
                  optimizer: Any, flush_every: int) -> WatchOptions:
    """Check the options of ``watch`` and return what the adapter reads.

    Args:
        params, layers, keep, intervene, every, outputs, param_stats, optimizer, flush_every:
            As documented on :func:`graddebug.watch`.

    Raises:
        ConfigError: An option has an unusable value.
    """
    if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
        raise ConfigError(f"flush_every={flush_every!r} must be a positive int (steps).")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"every={every!r} must be a positive int (1 records every step).")
    if param_stats not in ("norm", "full"):
        raise ConfigError(f"param_stats={param_stats!r} must be 'norm' or 'full'.")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(
            f"params={params!r} must map names to tensors or variables, "
            'for example params={"W": W, "b": b}.'
        )
    if params is not None and not params:
        raise ConfigError("params={} is empty; pass at least one tensor, or leave it out.")
    return WatchOptions(
        layers=_as_list(layers),
        keep=frozenset(_as_list(keep) or ()),
        intervene=parse_interventions(intervene),
        outputs=outputs,
        param_stats=param_stats,
        optimizer=optimizer,
        every=every,
    )


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
