"""The estimators' data: Parquet in the store, described once, and each rank's shard read with pyarrow.

``fit(df)`` writes the DataFrame once (Spark's writer, one file per task); every rank then reads
its own rows and nothing else: the row count of each file and row group is in the Parquet footer,
so a rank finds which row groups hold its rows from the footers alone and reads only those.

Shards are contiguous and equal: rank r of N takes rows ``[r*k, (r+1)*k)`` with ``k = rows // N``
(the last ``rows % N`` rows are left out, fewer than N), so that every rank takes the same number
of steps per epoch, which a ring needs. Validation rows are split the same way but kept whole:
evaluation has no collective per step, so ranks may take different numbers of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ringserve.bindings import require
from ringserve.errors import InvalidArgumentError
from ringserve.spark.store import Store


@dataclass(frozen=True)
class Column:
    """One column as the model sees it: the shape of one row's value and its numpy dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Dataset:
    """A Parquet dataset in the store, with what the ranks need to read it."""

    path: str
    rows: int
    columns: dict[str, Column]


def _pa() -> tuple[Any, Any]:
    pa = require("pyarrow", "spark")
    pq = require("pyarrow.parquet", "spark")
    return pa, pq


def _files(store: Store, path: str) -> list[str]:
    found = [p for p in store.fs.find(path) if p.endswith(".parquet")]
    if not found:
        raise InvalidArgumentError(f"No Parquet files under {path!r} in {store!r}.")
    return sorted(found)


def _numeric(t: Any) -> bool:
    pa, _ = _pa()
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def describe(store: Store, path: str, names: list[str]) -> Dataset:
    """Reads the footers (and one row, for array lengths) of the dataset at ``path``.

    Raises:
        InvalidArgumentError: a column is missing or not numeric (a number, or an array of numbers
            of one length).
    """
    pa, pq = _pa()
    files = _files(store, path)
    rows = 0
    schema = None
    for f in files:
        with store.fs.open(f, "rb") as handle:
            meta = pq.ParquetFile(handle).metadata
        rows += meta.num_rows
        if schema is None:
            schema = meta.schema.to_arrow_schema()
    assert schema is not None
    missing = [n for n in names if n not in schema.names]
    if missing:
        raise InvalidArgumentError(f"The columns {missing} are not in the data at {path!r} (it has {schema.names}).")
    columns: dict[str, Column] = {}
    first: dict[str, Any] | None = None
    for name in names:
        t = schema.field(name).type
        if _numeric(t):
            columns[name] = Column(name, (), np.dtype(t.to_pandas_dtype()).name)
            continue
        listed = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
        if listed and _numeric(t.value_type):
            if first is None:
                first = _first_row(store, files, [n for n in names if n in schema.names])
            value = first.get(name)
            length = len(value) if value is not None else 0
            columns[name] = Column(name, (length,), np.dtype(t.value_type.to_pandas_dtype()).name)
            continue
        raise InvalidArgumentError(f"The column {name!r} is {t}, not numeric: a model takes numbers or arrays of numbers.")
    return Dataset(path, rows, columns)


def _first_row(store: Store, files: list[str], names: list[str]) -> dict[str, Any]:
    _, pq = _pa()
    for f in files:
        with store.fs.open(f, "rb") as handle:
            pf = pq.ParquetFile(handle)
            if pf.metadata.num_rows:
                table = pf.read_row_group(0, columns=names).slice(0, 1)
                return {n: table.column(n)[0].as_py() for n in names}
    return {}


def shard_bounds(rows: int, rank: int, size: int, *, even: bool) -> tuple[int, int]:
    """Rank's rows ``[start, stop)``: ``rows // size`` each when even, else the first ranks take one
    more, so that every row is read once."""
    if even:
        k = rows // size
        return rank * k, (rank + 1) * k
    k, extra = divmod(rows, size)
    start = rank * k + min(rank, extra)
    return start, start + k + (1 if rank < extra else 0)


def read_shard(store: Store, dataset: Dataset, rank: int, size: int, *, even: bool = True) -> dict[str, np.ndarray]:
    """This rank's rows of every column of ``dataset``, as numpy arrays of (rows, *shape).

    Only the row groups that hold the rank's rows are read.
    """
    pa, pq = _pa()
    start, stop = shard_bounds(dataset.rows, rank, size, even=even)
    names = list(dataset.columns)
    pieces = []
    offset = 0
    for f in _files(store, dataset.path):
        with store.fs.open(f, "rb") as handle:
            pf = pq.ParquetFile(handle)
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                lo, hi = max(start, offset), min(stop, offset + n)
                if lo < hi:
                    pieces.append(pf.read_row_group(g, columns=names).slice(lo - offset, hi - lo))
                offset += n
    table = pa.concat_tables(pieces) if pieces else None
    return {name: _to_numpy(table, col, stop - start) for name, col in dataset.columns.items()}


def _to_numpy(table: Any, col: Column, rows: int) -> np.ndarray:
    if table is None or rows == 0:
        return np.zeros((0, *col.shape), dtype=col.dtype)
    chunked = table.column(col.name)
    if not col.shape:
        return np.asarray(chunked.to_numpy(), dtype=col.dtype)
    values = np.concatenate([c.flatten().to_numpy(zero_copy_only=False) for c in chunked.chunks])
    if values.size != rows * int(np.prod(col.shape)):
        raise InvalidArgumentError(f"The arrays of column {col.name!r} are not all of length {col.shape[0]}.")
    return values.reshape(rows, *col.shape).astype(col.dtype, copy=False)
