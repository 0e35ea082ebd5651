"""Terminal rendering of DataFrames with rich, for the CLI."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from graddebug.frames import format_cell

__all__ = ["frame_table", "markdown_table", "print_frame"]


def _cell(value: object) -> str:
    return escape(format_cell(value))  # layer names and messages are text, not rich markup


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
    table = Table(title=title, title_justify="left", show_lines=False)
    for col in cols:
        numeric = pd.api.types.is_numeric_dtype(frame[col]) and frame[col].dtype != bool
        table.add_column(col, justify="right" if numeric else "left",
                         overflow="fold", max_width=90 if col == "message" else None)
    styles = list(row_styles) if row_styles is not None else [""] * len(frame)
    for row, style in zip(frame[cols].itertuples(index=False), styles, strict=True):
        table.add_row(*(_cell(v) for v in row), style=style or None)
    return table


def _markdown_cell(value: object) -> str:
    text = format_cell(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")



def markdown_table(frame: pd.DataFrame, columns: Sequence[str] | None = None) -> str:
    """Render ``frame`` as a GitHub-flavoured Markdown table.

    Pipes and backslashes in cells are escaped, and ``<``, ``>``, ``&`` become HTML entities,
    so that a layer name cannot turn into markup where the table is rendered.

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
        console.print(f"[bold]{title}[/bold]: {empty}")
        return
    console.print(frame_table(frame, title, columns))
