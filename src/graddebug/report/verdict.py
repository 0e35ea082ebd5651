"""A test verdict on a Report: ``Report.assert_healthy`` and the plain-text findings table.

``ignore=`` entries name what a test accepts:

- an issue name, ``"dead"``: that issue, at every layer;
- ``"issue:glob"``, ``"vanishing:embed*"``: that issue at the layers the glob matches
  (``fnmatch`` rules, case-sensitive; ``.`` is literal);
- ``"*:glob"``, ``"*:encoder.*"``: every issue at the matching layers.

Issue names are checked, so a typo raises instead of silencing nothing: an issue must be one of
:class:`graddebug.Issue` or appear in the findings (issues that third-party detectors add).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from graddebug.errors import ConfigError, close_matches, printable
from graddebug.frames import format_cell, with_rank
from graddebug.records import FINDING_COLUMNS, Issue

if TYPE_CHECKING:
    import pandas as pd

    class Report(Protocol):
        """What the verdict reads of a :class:`graddebug.Report`. Not imported: the Report
        imports this module, and the import graph has no cycle, not even through
        type-checking imports."""

        def rediagnose(self, **thresholds: float) -> pd.DataFrame: ...

__all__ = ["IgnoreRule", "assert_healthy", "findings_table", "parse_ignore", "unignored"]

TABLE_COLUMNS: tuple[str, ...] = tuple(c for c in FINDING_COLUMNS if c != "rank")
"""Columns of the findings table, in order; ``message`` comes last and is never cut. ``rank``
follows ``step`` in a multi-rank run (:func:`graddebug.frames.with_rank`)."""

MAX_ROWS = 40
"""Rows shown in the table; the rest are counted in its last line."""


@dataclass(frozen=True)
class IgnoreRule:
    """One ``ignore=`` entry: an issue name (or ``"*"``) and a layer glob (``"*"`` for all)."""

    issue: str
    layer: str = "*"

    def matches(self, issue: str, layer: str) -> bool:
        """Whether a finding of ``issue`` at ``layer`` is ignored by this rule."""
        return (self.issue in ("*", issue)) and fnmatch.fnmatchcase(layer, self.layer)

    def __str__(self) -> str:
        return self.issue if self.layer == "*" else f"{self.issue}:{self.layer}"


def parse_ignore(ignore: Iterable[str] | str) -> list[IgnoreRule]:
    """Parse ``ignore=`` entries (see the module docstring) without checking issue names.

    Args:
        ignore: One entry or an iterable of entries.

    Returns:
        The rules, in the order given.

    Raises:
        ConfigError: An entry is not a non-empty string, or has an empty issue or layer part.
    """
    entries = [ignore] if isinstance(ignore, str) else ignore
    try:
        items = list(entries)
    except TypeError as exc:
        raise ConfigError(
            f"ignore={ignore!r} must be issue names or 'issue:layer-glob' strings, "
            "for example ignore=('dead', 'vanishing:embed*')."
        ) from exc
    rules = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(
                f"ignore entry {item!r} must be an issue name such as 'dead', or "
                "'issue:layer-glob' such as 'vanishing:encoder.*' ('*' for any issue)."
            )
        issue, sep, layer = item.partition(":")
        if not issue or (sep and not layer):
            raise ConfigError(
                f"ignore entry {item!r} has an empty part; write 'issue:layer-glob', "
                "for example 'dead:fc*' or '*:encoder.*'."
            )
        rules.append(IgnoreRule(issue, layer if sep else "*"))
    return rules


def _check_issues(rules: Sequence[IgnoreRule], seen: Iterable[str]) -> None:
    known = [i.value for i in Issue]
    known += [s for s in dict.fromkeys(seen) if s not in known]
    for rule in rules:
        if rule.issue != "*" and rule.issue not in known:
            raise ConfigError(
                f"ignore entry {str(rule)!r} names an unknown issue "
                f"{rule.issue!r}.{close_matches(rule.issue, known)} "
                f"Known issues: {', '.join(known)} ('*' for any)."
            )


def unignored(findings: pd.DataFrame, rules: Sequence[IgnoreRule]) -> pd.DataFrame:
    """Return the findings that no rule ignores.

    Args:
        findings: A findings frame.
        rules: Parsed ``ignore=`` entries (:func:`parse_ignore`).

    Returns:
        The rows of ``findings`` that no rule matches.

    Raises:
        ConfigError: A rule names an issue that is neither built in nor among ``findings``.
    """
    _check_issues(rules, findings["issue"])
    if not rules or findings.empty:
        return findings
    keep = [
        not any(rule.matches(str(issue), str(layer)) for rule in rules)
        for issue, layer in zip(findings["issue"], findings["layer"], strict=True)
    ]
    return findings[keep]


def _cell(value: object) -> str:
    # One line per finding, whatever it holds; no control character reaches the terminal.
    text = " ".join(printable(format_cell(value)).split())
    return text or "-"


def findings_table(findings: pd.DataFrame, max_rows: int = MAX_ROWS) -> str:
    """Render findings as a plain-text table, one line per finding, the message last.

    Args:
        findings: A findings frame (``Report.findings()``).
        max_rows: Rows to show; the remainder is counted on a last line.

    Returns:
        The table, without a trailing newline; ``"no findings"`` when the frame is empty.
        Control characters in cells are escaped (:func:`graddebug.errors.printable`).
    """
    if findings.empty:
        return "no findings"
    shown = findings.head(max_rows)
    columns = with_rank(findings, TABLE_COLUMNS)
    rows = [[_cell(v) for v in row] for row in shown[columns].itertuples(index=False)]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    lines = []
    rule = ["-" * w for w in widths[:-1]] + ["-" * len(columns[-1])]
    for cells in [columns, rule, *rows]:
        padded = [c.ljust(w) for c, w in zip(cells[:-1], widths, strict=False)]
        lines.append("  ".join([*padded, cells[-1]]).rstrip())
    if len(findings) > len(shown):
        lines.append(f"... and {len(findings) - len(shown)} more findings (Report.findings()).")
    return "\n".join(lines)


def assert_healthy(report: Report, ignore: Iterable[str] | str = (), **thresholds: float) -> None:
    """Raise an ``AssertionError`` whose message is the findings table, unless none remain.

    Args:
        report: The Report to judge.
        ignore: Issue names or ``"issue:layer-glob"`` entries to accept (module docstring).
        **thresholds: Overrides of :class:`graddebug.Thresholds` fields; the findings are
            recomputed under them with ``Report.rediagnose``.

    Raises:
        AssertionError: At least one finding is not ignored.
        ConfigError: An ``ignore=`` entry is malformed or names an unknown issue, or a
            threshold is unknown or unusable.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this frame
    rules = parse_ignore(ignore)
    findings = report.rediagnose(**thresholds)
    remaining = unignored(findings, rules)
    if remaining.empty:
        return
    count = len(remaining)
    head = f"graddebug found {count} problem{'s' if count != 1 else ''} in the gradients"
    notes = []
    if len(findings) > count:
        notes.append(f"{len(findings) - count} more ignored by {[str(r) for r in rules]}")
    if thresholds:
        notes.append("thresholds " + ", ".join(f"{k}={v!r}" for k, v in thresholds.items()))
    if notes:
        head += " (" + "; ".join(notes) + ")"
    raise AssertionError(printable(f"{head}:\n{findings_table(remaining)}"))
