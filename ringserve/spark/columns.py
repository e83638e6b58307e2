"""The estimators' columns as Spark holds them and as a model takes them.

A feature or label column is one of three kinds: a number, an array of numbers, or a Spark ML
vector (``pyspark.ml.linalg.VectorUDT``, dense or sparse, as ``VectorAssembler`` makes). Vectors
never reach Python as vectors: on the JVM side ``vector_to_array`` turns each one, dense or sparse,
into a float32 array, both before ``fit`` writes Parquet and before ``transform`` hands a batch to
the model. A pandas UDF receives a vector column as a dict of its fields (type, size, indices,
values), not as a vector, and cannot give one back; converting first means no vector ever crosses
into Python, and the columns the model does not read never leave the JVM.

The driver checks what it can from the schema before any job starts (kinds, and a vector column's
size when its ML metadata records it, as VectorAssembler's output does). The executors check each
batch (every row's length, no nulls), since only they see the rows; both name the column.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ringserve.errors import InvalidArgumentError

Kind = Literal["number", "array", "vector"]


def column_kind(df: Any, name: str) -> Kind:
    """The kind of ``df``'s column ``name``.

    Raises:
        InvalidArgumentError: the column is missing (the DataFrame's columns are listed), or is not a
            number, an array of numbers or an ML vector.
    """
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    if name not in df.columns:
        raise InvalidArgumentError(f"The DataFrame has no column {name!r} (its columns: {df.columns}).")
    t = df.schema[name].dataType
    if isinstance(t, VectorUDT):
        return "vector"
    if isinstance(t, T.NumericType | T.BooleanType) and not isinstance(t, T.DecimalType):
        return "number"
    if isinstance(t, T.ArrayType) and isinstance(t.elementType, T.NumericType) \
            and not isinstance(t.elementType, T.DecimalType):
        return "array"
    raise InvalidArgumentError(
        f"The column {name!r} is {t.simpleString()}, not numeric: features and labels must be numbers, "
        "arrays of numbers or ML vectors (dense or sparse).")


def check_dataframe(df: Any, columns: list[str], validation: float | str | None) -> list[str]:
    """Checks that the columns exist and are numeric; returns those that are ML vectors.

    Raises:
        InvalidArgumentError: a missing column (with the DataFrame's columns), or one whose type is
            not a number, an array of numbers or an ML vector.
    """
    from pyspark.sql import types as T

    wanted = columns + ([validation] if isinstance(validation, str) else [])
    missing = [c for c in wanted if c not in df.columns]
    if missing:
        raise InvalidArgumentError(f"The DataFrame has no column {', '.join(map(repr, missing))} "
                                   f"(its columns: {df.columns}).")
    vectors = [name for name in columns if column_kind(df, name) == "vector"]
    if isinstance(validation, str):
        t = df.schema[validation].dataType
        if not isinstance(t, T.BooleanType | T.IntegerType | T.LongType | T.ShortType | T.ByteType):
            raise InvalidArgumentError(
                f"The validation column {validation!r} is {t.simpleString()}; it must be boolean (or 0/1).")
    return vectors


def vector_size(df: Any, name: str) -> int | None:
    """A vector column's size as its ML attribute metadata records it (VectorAssembler's does), or None."""
    attrs = df.schema[name].metadata.get("ml_attr", {})
    size = attrs.get("num_attrs")
    return int(size) if isinstance(size, int) and size >= 0 else None


def check_features(df: Any, names: list[str], shapes: list[tuple[int, ...]]) -> list[Kind]:
    """Checks ``df``'s feature columns against the shapes the model was trained on; returns their kinds.

    Raises:
        InvalidArgumentError: a column is missing or of an unsupported type, a number where the model
            takes arrays (or the reverse), or a vector whose recorded size differs from the model's.
    """
    kinds = []
    for name, shape in zip(names, shapes, strict=True):
        kind = column_kind(df, name)
        if kind == "number" and shape:
            raise InvalidArgumentError(f"The column {name!r} holds numbers; the model was trained on "
                                       f"{shape[0]} values per row there (an array or ML vector).")
        if kind != "number" and not shape:
            raise InvalidArgumentError(f"The column {name!r} holds {kind}s; the model was trained on one number "
                                       "per row there.")
        size = vector_size(df, name) if kind == "vector" else None
        if size is not None and size != shape[0]:
            raise InvalidArgumentError(f"The column {name!r} holds vectors of size {size}; the model was trained "
                                       f"on vectors of size {shape[0]}.")
        kinds.append(kind)
    return kinds


def as_array(name: str, kind: Kind) -> Any:
    """The Spark expression a model reads for the column: a vector (dense or sparse) as a float32
    array, computed on the JVM; numbers and arrays as they are."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    col = F.col(quoted(name))
    return vector_to_array(col, "float32") if kind == "vector" else col


def quoted(name: str) -> str:
    """``name`` for ``F.col``, which would read a dot as a struct field."""
    return "`" + name.replace("`", "``") + "`"


def to_numpy(series: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One batch of a column (a pandas Series) as a numpy array of ``(rows, *shape)``.

    Raises:
        InvalidArgumentError: a row is null, or an array's length differs from ``shape``.
    """
    if series.isna().any():
        row = int(np.flatnonzero(series.isna().to_numpy())[0])
        raise InvalidArgumentError(f"The column {name!r} is null in a row (row {row} of a batch); "
                                   "the model needs a value in every row.")
    if not shape:
        return np.asarray(series.to_numpy())
    values = series.to_numpy()
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    bad = np.flatnonzero(lengths != shape[0])
    if bad.size:
        raise InvalidArgumentError(f"The column {name!r} has a row of {lengths[bad[0]]} values; the model was "
                                   f"trained on {shape[0]} values per row there.")
    if not len(values):
        return np.zeros((0, *shape), dtype=np.float32)
    return np.concatenate(values).astype(np.float32, copy=False).reshape(len(values), *shape)


def check_uniform(df: Any, names: list[str]) -> None:
    """Checks, in one Spark pass over ``names`` alone, that each array column (vectors already turned
    into arrays) has no nulls and the same length in every row, as a model's input needs.

    Raises:
        InvalidArgumentError: naming the column, with the lengths found.
    """
    from pyspark.sql import functions as F

    if not names:
        return
    aggs = []
    for i, name in enumerate(names):
        col = F.col(quoted(name))
        aggs += [F.min(F.size(col)).alias(f"lo{i}"), F.max(F.size(col)).alias(f"hi{i}"),
                 F.sum(col.isNull().cast("long")).alias(f"nulls{i}")]
    row = df.agg(*aggs).first()
    if row is None:
        return
    for i, name in enumerate(names):
        lo, hi, nulls = row[f"lo{i}"], row[f"hi{i}"], row[f"nulls{i}"]
        if nulls:
            raise InvalidArgumentError(f"The column {name!r} is null in {nulls} rows; every row needs a value.")
        if lo != hi:
            raise InvalidArgumentError(f"The column {name!r} has rows of {lo} to {hi} values; every row must "
                                       "have the same number (vectors of one size, arrays of one length).")
