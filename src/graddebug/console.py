"""Terminal rendering of DataFrames with rich, for the CLI."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["frame_table", "print_frame"]


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0 or 1e-3 <= abs(value) < 1e4:
            return f"{value:.4g}"
        return f"{value:.2e}"
    return escape(str(value))  # layer names and messages are text, not rich markup


def frame_table(frame: pd.DataFrame, title: str, columns: Sequence[str] | None = None) -> Table:
    """Build a rich Table from ``frame`` (all columns, or ``columns`` in that order)."""
    cols = list(columns) if columns is not None else list(frame.columns)
    table = Table(title=title, title_justify="left", show_lines=False)
    for col in cols:
        numeric = pd.api.types.is_numeric_dtype(frame[col]) and frame[col].dtype != bool
        table.add_column(col, justify="right" if numeric else "left",
                         overflow="fold", max_width=90 if col == "message" else None)
    for row in frame[cols].itertuples(index=False):
        table.add_row(*(_cell(v) for v in row))
    return table


def print_frame(console: Console, frame: pd.DataFrame, title: str,
                columns: Sequence[str] | None = None, empty: str = "none") -> None:
    """Print ``frame`` as a table, or a one-line note when it is empty."""
    if frame.empty:
        console.print(f"[bold]{title}[/bold]: {empty}")
        return
    console.print(frame_table(frame, title, columns))
