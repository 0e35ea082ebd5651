"""Exact conversions between the run's DataFrames, record tuples and Arrow tables.

The on-disk schema of a run is a list of ``(column, pandas dtype)`` pairs kept in the run's JSON
file, next to Parquet files that hold plain Arrow types only (no pandas metadata, no extension
types). Reading a run therefore never evaluates anything stored in it: the loader rebuilds every
column from that list, and accepts only the dtypes of :data:`SUPPORTED_DTYPES` or numeric ones.

Object columns hold ``str`` values (stored as Arrow strings) or tuples of ints (stored as Arrow
lists of int64 and read back as tuples), so a ``shape`` column of either kind round-trips.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd

from graddebug.errors import MissingFrameworkError, RunFileError

__all__ = [
    "ColumnSpec",
    "frame_spec",
    "frame_to_table",
    "require_pyarrow",
    "rows_to_table",
    "table_spec",
    "table_to_frame",
]

ColumnSpec = list[tuple[str, str]]
"""``(column name, pandas dtype name)`` for each column of a table, in order."""

SUPPORTED_DTYPES: frozenset[str] = frozenset({"object", "str", "string", "bool"})
"""Dtype names accepted besides numpy's integer and float dtypes."""


def require_pyarrow() -> tuple[ModuleType, ModuleType]:
    """Import pyarrow and pyarrow.parquet on first use.

    Returns:
        The ``pyarrow`` and ``pyarrow.parquet`` modules.

    Raises:
        MissingFrameworkError: pyarrow is not installed.
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingFrameworkError(
            f"writing and reading graddebug runs needs pyarrow ({exc}); "
            "install it with: pip install graddebug[report]"
        ) from exc
    return pa, pq


def _check_dtype(name: str, dtype: str) -> None:
    if dtype in SUPPORTED_DTYPES:
        return
    try:
        kind: str = np.dtype(dtype).kind
    except TypeError:
        kind = ""
    if kind not in ("i", "u", "f"):
        raise RunFileError(
            f"column {name!r} has dtype {dtype!r}, which a graddebug run cannot store; "
            "supported: int, uint, float, bool, str and object columns of str or int tuples."
        )


def frame_spec(frame: pd.DataFrame) -> ColumnSpec:
    """Return the ``(column, dtype)`` list of ``frame``.

    Raises:
        RunFileError: A column has a dtype that cannot be stored.
    """
    spec = [(str(name), str(dtype)) for name, dtype in frame.dtypes.items()]
    for name, dtype in spec:
        _check_dtype(name, dtype)
    return spec


def _object_array(pa: ModuleType, name: str, values: Sequence[Any]) -> Any:
    first = next((v for v in values if v is not None), None)
    try:
        if first is None or isinstance(first, str):
            return pa.array(values, pa.string())
        if isinstance(first, tuple):
            return pa.array([None if v is None else list(v) for v in values],
                            pa.list_(pa.int64()))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        pass  # mixed values: let Arrow infer a type below, or fail with a clear message
    try:
        return pa.array(list(values))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise RunFileError(
            f"column {name!r} holds values of type {type(first).__name__!r} that a graddebug "
            f"run cannot store ({exc}); object columns may hold str or tuples of ints."
        ) from exc


def frame_to_table(frame: pd.DataFrame) -> tuple[Any, ColumnSpec]:
    """Convert a DataFrame to an Arrow table, with the spec that restores it exactly.

    Args:
        frame: A records, events or findings frame (or any frame of supported dtypes).

    Returns:
        The ``pyarrow.Table`` and its column spec.

    Raises:
        RunFileError: A column cannot be stored.
        MissingFrameworkError: pyarrow is not installed.
    """
    pa, _ = require_pyarrow()
    spec = frame_spec(frame)
    arrays = []
    for (name, dtype), column in zip(spec, frame.columns, strict=True):
        series = frame[column]
        if dtype in ("object", "str", "string"):
            values = series.astype(object).where(series.notna(), None).tolist()
            arrays.append(_object_array(pa, name, values))
        else:
            arrays.append(pa.array(series.to_numpy()))
    return pa.table(arrays, names=[name for name, _ in spec]), spec


def rows_to_table(rows: Sequence[tuple[Any, ...]], columns: Sequence[str],
                  types: dict[str, str]) -> Any:
    """Build an Arrow table straight from record tuples, column by column.

    This is the streaming path: it skips pandas, so that a flush costs little.

    Args:
        rows: Tuples such as :class:`graddebug.records.Record`, all of the same length.
        columns: The field names, in tuple order.
        types: The pandas dtype of each field (``"int64"``, ``"float64"``, ``"bool"``,
            ``"object"``).

    Returns:
        A ``pyarrow.Table``.
    """
    pa, _ = require_pyarrow()
    cols: list[Sequence[Any]] = list(zip(*rows, strict=True)) if rows else [()] * len(columns)
    arrays = []
    for name, values in zip(columns, cols, strict=True):
        dtype = types[name]
        if dtype == "object":
            arrays.append(_object_array(pa, name, values))
        else:
            arrays.append(pa.array(values, pa.from_numpy_dtype(np.dtype(dtype))))
    return pa.table(arrays, names=list(columns))


def table_spec(table: Any) -> ColumnSpec:
    """Return the pandas dtypes that the columns of a streamed Arrow table stand for."""
    pa, _ = require_pyarrow()
    spec: ColumnSpec = []
    for field in table.schema:
        kind = field.type
        if pa.types.is_boolean(kind):
            spec.append((field.name, "bool"))
        elif pa.types.is_integer(kind) or pa.types.is_floating(kind):
            spec.append((field.name, np.dtype(kind.to_pandas_dtype()).name))
        else:
            spec.append((field.name, "object"))
    return spec


def _object_values(pa: ModuleType, column: Any) -> np.ndarray:
    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    n = len(column)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        # Few distinct names over many rows: decode each once and share the str objects.
        encoded = column.dictionary_encode()
        names = np.empty(len(encoded.dictionary), dtype=object)
        names[:] = encoded.dictionary.to_pylist()
        indices = encoded.indices
        values: np.ndarray = names[indices.fill_null(0).to_numpy()] if n else np.empty(
            0, dtype=object)
        if indices.null_count:
            values[indices.is_null().to_numpy(zero_copy_only=False)] = None
        return values
    out = np.empty(n, dtype=object)
    listed = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
    for i, value in enumerate(column.to_pylist()):
        out[i] = tuple(value) if listed and value is not None else value
    return out


def table_to_frame(table: Any, spec: ColumnSpec) -> pd.DataFrame:
    """Rebuild a DataFrame from an Arrow table and its column spec.

    Args:
        table: A ``pyarrow.Table`` holding at least the columns of ``spec``.
        spec: The ``(column, dtype)`` list to restore, in order.

    Returns:
        A frame with exactly ``spec``'s columns and dtypes and a RangeIndex.

    Raises:
        RunFileError: A column is missing, has nulls where its dtype allows none, is stored
            with another type than its dtype, or a dtype is not supported.
    """
    pa, _ = require_pyarrow()
    data: dict[str, pd.Series[Any]] = {}
    index = pd.RangeIndex(table.num_rows)
    for name, dtype in spec:
        _check_dtype(name, dtype)
        if name not in table.column_names:
            raise RunFileError(f"column {name!r} is missing; the table has {table.column_names}.")
        column = table.column(name)
        if dtype in ("object", "str", "string"):
            series = pd.Series(_object_values(pa, column), index=index, dtype=object)
            data[name] = series if dtype == "object" else series.astype(pd.StringDtype(
                na_value=np.nan) if dtype == "str" else pd.StringDtype())
            continue
        if column.null_count:
            raise RunFileError(f"column {name!r} ({dtype}) holds {column.null_count} nulls.")
        if column.type != pa.from_numpy_dtype(np.dtype(dtype)):
            # The spec and the file disagree: a cast would silently change the values.
            raise RunFileError(f"column {name!r} is stored as {column.type}, but its spec "
                               f"says {dtype}.")
        values = column.to_numpy() if table.num_rows else np.empty(0)
        data[name] = pd.Series(values.astype(dtype, copy=False), index=index)
    return pd.DataFrame(data, index=index, columns=[name for name, _ in spec])
