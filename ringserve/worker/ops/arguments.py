"""What every collective does with its arguments before the ring: checks them, picks the codec,
and makes the buffers its results go to.

Shared by the collectives (collectives.py), their grouped forms (grouped.py), Adasum (adasum.py),
a joined rank's stand-ins (join.py) and the worker's face (ringserve.worker.faces).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringserve import codecs, wire
from ringserve.codecs import Codec
from ringserve.errors import InvalidArgumentError, NonFiniteError
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Coded, Raw

__all__ = ["as_array", "chunk_elems", "codec_for", "non_finite_error", "reduction_values", "result_buffer",
           "scratch"]


def as_array(a: Any) -> np.ndarray:
    """``a`` as a numpy array of a dtype the wire carries.

    Raises:
        InvalidArgumentError: the dtype is not one the wire carries (naming those it does).
    """
    array = np.asarray(a)
    wire.dtype_code(array.dtype)
    return array


def chunk_elems(dtype: np.dtype, chunk_bytes: int) -> int:
    """How many elements of ``dtype`` make a chunk of about ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // dtype.itemsize)


def scratch(session: Session, dtype: np.dtype, count: int) -> np.ndarray:
    """A flat array whose contents the collective overwrites: from the worker's pool (pool.py)."""
    pool = session.pool
    return np.empty(count, dtype=dtype) if pool is None else pool.array(dtype, count)


def result_buffer(session: Session, array: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """The flat result buffer: a new array (or a pooled one nothing else reaches), or ``out``
    (which may be the input itself).

    Raises:
        InvalidArgumentError: ``out`` is not a writeable C-contiguous array of the input's shape and dtype.
    """
    if out is None:
        return scratch(session, array.dtype, array.size)
    if not isinstance(out, np.ndarray) or out.shape != array.shape or out.dtype != array.dtype:
        raise InvalidArgumentError(
            f"out must be an array of the input's shape {array.shape} and dtype {array.dtype}."
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgumentError("out must be a writeable C-contiguous array.")
    return out.reshape(-1)


def reduction_values(src: np.ndarray, buf: np.ndarray, op: str, world: int,
                     coder: Codec | None, residual: np.ndarray | None) -> Raw:
    """How the values of a reduction travel: as they are, or encoded by a codec."""
    if coder is None:
        return Raw(src, buf, op, world)
    return Coded(src, buf, op, world, "", coder, residual)


def codec_for(array: np.ndarray, op: str, compression: str | None, residual: np.ndarray | None) -> Codec | None:
    """The codec called ``compression``, after checking it and ``residual`` against the input.

    Raises:
        InvalidArgumentError: an unknown codec, a codec for an integer array, or a residual that
            is not what error feedback needs (naming what it needs).
    """
    coder = codecs.codec(compression)
    if coder is None:
        if residual is not None:
            raise InvalidArgumentError("residual (error feedback) needs a lossy compression.")
        return None
    if array.dtype.kind != "f":
        raise InvalidArgumentError(f"compression={compression!r} needs a floating point array, not {array.dtype}.")
    if residual is not None:
        acc = codecs.sum_dtype(array.dtype)
        if (not isinstance(residual, np.ndarray) or residual.dtype != acc or residual.size != array.size
                or not residual.flags.c_contiguous or not residual.flags.writeable):
            raise InvalidArgumentError(
                f"residual must be a writeable C-contiguous {acc} array of {array.size} elements."
            )
        if op not in ("sum", "average"):
            raise InvalidArgumentError(f"residual (error feedback) works with op sum or average, not {op!r}.")
    return coder


def non_finite_error(key: str) -> NonFiniteError:
    """What every rank raises when the result of collective ``key`` holds NaN or Inf."""
    return NonFiniteError(
        f"The result of collective {key!r} holds NaN or Inf (every rank holds the same result "
        f"and raises this error)."
    )
