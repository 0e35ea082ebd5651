"""Rendering of DataFrames for the CLI: rich tables and Markdown for terminals, CSV for
spreadsheets.

Layer names, messages and metadata are user strings, and a run directory may come from someone
else: every text cell goes through :func:`graddebug.errors.printable` on the way to a terminal,
and through :func:`csv_text` on the way to a spreadsheet.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from graddebug.errors import printable
from graddebug.frames import format_cell

__all__ = ["CSV_FORMULA_PREFIXES", "csv_text", "frame_table", "markdown_table", "print_frame",
           "terminal_text"]

CSV_FORMULA_PREFIXES: tuple[str, ...] = ("=", "+", "-", "@", "\t", "\r")
"""First characters that make a spreadsheet read a CSV cell as a formula (OWASP, "CSV
Injection"): a text cell starting with one of them gets a leading ``'``."""


def terminal_text(value: object) -> str:
    """A value as rich console text: control characters escaped, no rich markup."""
    return escape(printable(str(value)))


def _cell(value: object) -> str:
    return terminal_text(format_cell(value))  # layer names are text, not markup or controls


def frame_table(frame: pd.DataFrame, title: str, columns: Sequence[str] | None = None,
                row_styles: Sequence[str] | None = None) -> Table:
    """Build a rich Table from ``frame`` (all columns, or ``columns`` in that order).

    Args:
        frame: The rows to show.
        title: The table's title.
        columns: Which columns, in order; all by default.
        row_styles: A rich style per row (``""`` for none).
    """
    cols = list(columns) if columns is not None else list(frame.columns)
    table = Table(title=printable(title), title_justify="left", show_lines=False)
    for col in cols:
        numeric = pd.api.types.is_numeric_dtype(frame[col]) and frame[col].dtype != bool
        table.add_column(col, justify="right" if numeric else "left",
                         overflow="fold", max_width=90 if col == "message" else None)
    styles = list(row_styles) if row_styles is not None else [""] * len(frame)
    for row, style in zip(frame[cols].itertuples(index=False), styles, strict=True):
        table.add_row(*(_cell(v) for v in row), style=style or None)
    return table


def _markdown_cell(value: object) -> str:
    text = printable(format_cell(value))
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")



def markdown_table(frame: pd.DataFrame, columns: Sequence[str] | None = None) -> str:
    """Render ``frame`` as a GitHub-flavoured Markdown table.

    Pipes and backslashes in cells are escaped, and ``<``, ``>``, ``&`` become HTML entities,
    so that a layer name cannot turn into markup where the table is rendered; control
    characters are escaped (:func:`graddebug.errors.printable`).

    Args:
        frame: The rows to render.
        columns: Which columns, in order; all by default.

    Returns:
        The table, ending with a newline; ``"(none)\\n"`` for an empty frame.
    """
    cols = list(columns) if columns is not None else list(frame.columns)
    if frame.empty:
        return "(none)\n"
    numeric = [pd.api.types.is_numeric_dtype(frame[c]) and frame[c].dtype != bool for c in cols]
    lines = ["| " + " | ".join(_markdown_cell(c) for c in cols) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    for row in frame[cols].itertuples(index=False):
        lines.append("| " + " | ".join(_markdown_cell(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def print_frame(console: Console, frame: pd.DataFrame, title: str,
                columns: Sequence[str] | None = None, empty: str = "none") -> None:
    """Print ``frame`` as a table, or a one-line note when it is empty."""
    if frame.empty:
        console.print(f"[bold]{printable(title)}[/bold]: {empty}")
        return
    console.print(frame_table(frame, title, columns))


def _csv_cell(value: object) -> object:
    if not isinstance(value, str):
        return value
    text = printable(value)
    return "'" + text if text.startswith(CSV_FORMULA_PREFIXES) else text


def csv_text(frame: pd.DataFrame) -> str:
    """Render ``frame`` as CSV that a spreadsheet opens without running anything.

    Following OWASP's advice on CSV injection, a text cell that starts with ``=``, ``+``,
    ``-``, ``@``, a tab or a carriage return gets a leading ``'``, so that a layer named
    ``=HYPERLINK(...)`` stays text; control characters in text cells are escaped
    (:func:`graddebug.errors.printable`), since CSV often goes to a terminal. Numbers are
    never changed: ``-0.5`` in a numeric column is a number, not a formula. JSON and Parquet
    output keep every string as it is.

    Args:
        frame: The rows to write.

    Returns:
        The CSV text, header included, without the index.
    """
    text_columns = [c for c in frame.columns if not (
        pd.api.types.is_numeric_dtype(frame[c]) or pd.api.types.is_bool_dtype(frame[c]))]
    if not text_columns:
        return frame.to_csv(index=False)
    safe = frame.copy()
    for column in text_columns:
        safe[column] = safe[column].astype(object).map(_csv_cell)
    return safe.to_csv(index=False)
