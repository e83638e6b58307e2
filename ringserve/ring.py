"""The ring schedule, segment and chunk bounds, and reduce ops: pure code, no sockets, no loop.

Ring allreduce over ``world`` ranks runs a reduce-scatter phase, after which rank ``r`` owns the
fully reduced segment ``r``, then an allgather phase that passes each owner's segment around the
ring unchanged. Each segment is reduced once per rank, in a fixed order, so every rank ends with
bit-identical bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ringserve.errors import InvalidArgumentError

Bounds = tuple[int, int]

REDUCE_OPS = ("sum", "average", "min", "max", "product")
# Bitwise ops, for integer (and boolean) arrays only: torch.distributed's BAND, BOR and BXOR.
BITWISE_OPS = ("band", "bor", "bxor")


def segment_bounds(units: int, world: int, granule: int = 1) -> list[Bounds]:
    """Splits ``units`` granules into ``world`` contiguous segments of elements.

    The first ``units % world`` segments get one granule more, as ``numpy.array_split`` and
    Horovod's reducescatter do. Segments may be empty when there are fewer units than ranks.

    Args:
        units: number of granules (rows for reduce_scatter, elements for allreduce).
        world: number of ranks.
        granule: elements per granule.

    Returns:
        ``world`` half-open (start, stop) element bounds that tile ``[0, units * granule)``.
    """
    base, extra = divmod(units, world)
    bounds = []
    start = 0
    for r in range(world):
        stop = start + (base + (1 if r < extra else 0)) * granule
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_bounds(start: int, stop: int, chunk_elems: int) -> list[Bounds]:
    """Splits ``[start, stop)`` into chunks of at most ``chunk_elems``; an empty range is one empty chunk.

    An empty range still yields one (empty) chunk, so every ring step carries at least one frame:
    that frame is what lets a rank check its predecessor's arguments.
    """
    if stop <= start:
        return [(start, start)]
    return [(a, min(a + chunk_elems, stop)) for a in range(start, stop, chunk_elems)]


def reduce_scatter_step(rank: int, world: int, step: int) -> tuple[int, int]:
    """(segment to send, segment to receive) at reduce-scatter step ``0 <= step < world - 1``.

    After the last step, rank ``r`` holds the full reduction of segment ``r``.
    """
    return (rank - step - 1) % world, (rank - step - 2) % world


def allgather_step(rank: int, world: int, step: int) -> tuple[int, int]:
    """(block to send, block to receive) at allgather step ``0 <= step < world - 1``.

    Rank ``r`` starts with block ``r`` and forwards at each step the block it received last.
    """
    return (rank - step) % world, (rank - step - 1) % world


def successor(rank: int, world: int) -> int:
    return (rank + 1) % world


def predecessor(rank: int, world: int) -> int:
    return (rank - 1) % world


def check_op(op: str, dtype: np.dtype | None = None) -> str:
    """Returns ``op`` if it is a known reduce op (for ``dtype``, when given), else raises
    InvalidArgumentError."""
    if op not in REDUCE_OPS and op not in BITWISE_OPS:
        raise InvalidArgumentError(
            f"The reduce op {op!r} is not supported; use one of {', '.join(REDUCE_OPS + BITWISE_OPS)}."
        )
    if op in BITWISE_OPS and dtype is not None and np.dtype(dtype).kind not in "iub":
        raise InvalidArgumentError(f"The reduce op {op!r} needs an integer array, not one of {np.dtype(dtype)}.")
    return op


_COMBINE: dict[str, Callable[..., object]] = {
    "sum": np.add,
    "average": np.add,
    "min": np.minimum,
    "max": np.maximum,
    "product": np.multiply,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}


def combine_into(acc: np.ndarray, incoming: np.ndarray, op: str, out: np.ndarray | None = None) -> None:
    """out <- op(acc, incoming), where out defaults to acc; numpy releases the GIL for the loop.

    Writing into a separate ``out`` lets the ring reduce a rank's own input with what arrived
    without first copying the input into the result.
    """
    _COMBINE[op](acc, incoming, out=acc if out is None else out)


def finish_into(segment: np.ndarray, op: str, world: int) -> None:
    """Applies the last part of an op to a fully combined segment (the division of average).

    Integer averages round toward negative infinity, as ``numpy.floor_divide`` does.
    """
    if op != "average" or world == 1:
        return
    if segment.dtype.kind == "f":
        np.divide(segment, segment.dtype.type(world), out=segment)
    else:
        np.floor_divide(segment, world, out=segment)
