"""Stopping training on a finding: what training callbacks (Keras, Lightning) share."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from graddebug.adapter.options import WATCH_OPTIONS, check_option_names
from graddebug.errors import ConfigError, close_matches
from graddebug.records import EventKind, Issue, Record

if TYPE_CHECKING:
    import pandas as pd

    from graddebug.adapter import StepResult

__all__ = ["STOP_ON", "check_watch_options", "nonfinite", "parse_stop_on", "stop_reason"]

STOP_ON: tuple[str, ...] = (Issue.NONFINITE.value,)
"""Issues a callback can stop on at the step they appear. The others are judged over many
steps, so they are read from ``findings()`` after training."""


def parse_stop_on(stop_on: Iterable[str] | str, where: str) -> frozenset[str]:
    """Validate ``stop_on=``.

    Args:
        stop_on: An issue name or several.
        where: The callback's name, for the message.

    Raises:
        ConfigError: An issue that cannot stop training.
    """
    issues = [stop_on] if isinstance(stop_on, str) else list(stop_on)
    for issue in issues:
        if issue not in STOP_ON:
            raise ConfigError(
                f"stop_on={issue!r} is not supported.{close_matches(str(issue), STOP_ON)} "
                f"{where} stops on: {', '.join(STOP_ON)}; issues judged over many steps are in "
                "findings() after training."
            )
    return frozenset(issues)


def _bad(record: Record) -> bool:
    return bool(record.nan or record.inf) or not math.isfinite(record.norm)


def nonfinite(result: StepResult) -> bool:
    """Whether a closed step holds a NaN/Inf gradient or a non-finite forward output.

    A step a loss scaler skipped overflowed in backward by design and left the weights alone:
    only a NaN/Inf in its forward pass counts then.
    """
    events = {e.event for e in result.events}
    forward = EventKind.FORWARD_NONFINITE.value in events
    if EventKind.SKIPPED_STEP.value in events:
        return forward
    return forward or any(_bad(r) for r in result.records)


def stop_reason(findings: pd.DataFrame, step: int, result: StepResult) -> str:
    """Why training stops at ``step``: the nonfinite finding's message, which names the layer
    where NaN/Inf was born, or else the first non-finite gradient in backward order."""
    here = findings[(findings["issue"] == Issue.NONFINITE.value) & (findings["step"] == step)]
    if not here.empty:
        reason = str(here["message"].iloc[0])
    else:
        first = min((r for r in result.records if _bad(r)), key=lambda r: -r.depth, default=None)
        where = f"{first.layer}.{first.tensor}" if first is not None else "a forward output"
        reason = f"non-finite gradient at {where!r}."
    return f"graddebug stopped training at step {step}: {reason}"


def check_watch_options(options: Mapping[str, Any], where: str, own: Sequence[str]) -> None:
    """Reject names that are options neither of ``watch`` nor of the caller, early.

    Args:
        options: The keyword options to pass on to ``watch``.
        where: The caller, for the message (``"check()"``).
        own: The caller's own options, listed in the message.

    Raises:
        ConfigError: An unknown name, with the closest known ones.
    """
    # The optimizer is never passed on: check() takes it as its own option, and a callback
    # takes the trainer's.
    check_option_names(options, where, [n for n in WATCH_OPTIONS if n != "optimizer"], own)
