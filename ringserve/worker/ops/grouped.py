"""Grouped allgather and grouped reduce-scatter: a list of arrays as one collective each.

Horovod's ``grouped_allgather`` and ``grouped_reducescatter`` promise one negotiation and one fused
transfer for the whole list. Here:

- a grouped allgather is one ring allgather (programs.allgather_blocks) of one byte block per rank:
  a header with the rank's row count for each array, then each array's bytes, each part starting
  on a 16-byte boundary. Arrays of any dtypes mix in one collective, and each rank's row counts
  travel with its data, so nothing is exchanged beforehand;
- a grouped reduce-scatter is one ring reduce-scatter (programs.ring_reduce) per dtype of the list
  (the wire reduces one dtype at a time): the arrays of a dtype are laid out rank by rank, so that
  segment r of the fused buffer is every array's rows for rank r, one after the other. Each array's
  rows are split as reduce_scatter splits them (the first ranks get one more).

A rank whose list is wrong (a scalar, where every array needs a first dimension) refuses the
collective (refusal.refuse): every rank fails within ``abort_grace_s``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from ringserve.errors import ProtocolError
from ringserve.ring import check_op, segment_bounds
from ringserve.worker.dataplane import programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import executor
from ringserve.worker.dataplane.programs.executor import ring_of
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import collectives
from ringserve.worker.ops.arguments import as_array, chunk_elems, codec_for, reduction_values
from ringserve.worker.ops.refusal import refuse

_ALIGN = 16
_ROWS = np.dtype("<i8")


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack(arrays: list[np.ndarray]) -> np.ndarray:
    """One rank's block of a grouped allgather: its row counts, then each array's bytes (aligned)."""
    head = _padded(len(arrays) * _ROWS.itemsize)
    sizes = [_padded(a.nbytes) for a in arrays]
    out = np.zeros(head + sum(sizes), dtype=np.uint8)
    out[: len(arrays) * _ROWS.itemsize] = np.array([a.shape[0] for a in arrays], dtype=_ROWS).view(np.uint8)
    at = head
    for a, size in zip(arrays, sizes, strict=True):
        out[at: at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        at += size
    return out


def unpack(block: np.ndarray, like: list[np.ndarray], key: str = "") -> list[np.ndarray]:
    """The arrays of one rank's block, shaped as ``like`` but for their first dimensions.

    Raises:
        ProtocolError: the block's length does not match the row counts it starts with.
    """
    count = len(like)
    head = _padded(count * _ROWS.itemsize)
    rows = block[: count * _ROWS.itemsize].view(_ROWS) if block.size >= head else np.zeros(0, dtype=_ROWS)
    if rows.size != count or (rows < 0).any():
        raise ProtocolError(f"A block of grouped allgather {key!r} ({block.size} bytes) lacks its row counts.")
    parts, at = [], head
    for a, r in zip(like, rows.tolist(), strict=True):
        row_bytes = math.prod(a.shape[1:]) * a.dtype.itemsize
        nbytes = r * row_bytes
        if at + nbytes > block.size:
            raise ProtocolError(f"A block of grouped allgather {key!r} is shorter than its row counts say.")
        parts.append(block[at: at + nbytes].view(a.dtype).reshape((r, *a.shape[1:])))
        at += _padded(nbytes)
    if at != block.size:
        raise ProtocolError(f"A block of grouped allgather {key!r} is longer than its row counts say.")
    return parts


async def grouped_allgather(session: Session, arrays: list[Any], *, name: str | None, chunk_bytes: int,
                            timeout_s: float) -> list[np.ndarray]:
    """Concatenates every rank's arrays along axis 0, array by array, in one collective."""
    items = [as_array(a) for a in arrays]
    descriptor = Descriptor("grouped_allgather", items=tuple(Descriptor("", dtype=a.dtype.name, rows=a.shape[1:])
                                                             for a in items))
    scalars = [i for i, a in enumerate(items) if a.ndim == 0]
    if scalars:
        await refuse(session, name, descriptor,
                                 f"grouped_allgather needs arrays with a first dimension; those at {scalars} are scalars",
                                 timeout_s)
    blocks = await collectives.allgather_blocks(session, pack(items), row=1, name=name, descriptor=descriptor,
                                                chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    by_rank = [unpack(b, items) for b in blocks]
    return [np.concatenate([parts[i] for parts in by_rank], axis=0) for i in range(len(items))]


async def grouped_reduce_scatter(session: Session, arrays: list[Any], *, op: str, name: str | None, chunk_bytes: int,
                                 timeout_s: float, compression: str | list[str | None] | None = None) -> list[np.ndarray]:
    """Reduces each array and returns this rank's rows of each result, one collective per dtype.

    ``compression`` names a wire codec for the floating point arrays (integer ones travel as they
    are), or one codec (or None) per array; arrays of one dtype and codec share a collective.
    """
    check_op(op)
    items = [as_array(a) for a in arrays]
    descriptor = Descriptor("grouped_reduce_scatter", items=tuple(Descriptor("", dtype=a.dtype.name, shape=a.shape)
                                                                  for a in items), op=op)
    scalars = [i for i, a in enumerate(items) if a.ndim == 0]
    if scalars:
        await refuse(session, name, descriptor,
                                 f"grouped_reduce_scatter needs arrays with a first dimension; those at {scalars} "
                                 "are scalars", timeout_s)
    names = compression if isinstance(compression, list) else [compression] * len(items)
    world, rank = session.place.size, session.place.rank
    groups: dict[tuple[np.dtype, str | None], list[int]] = {}
    for i, a in enumerate(items):
        groups.setdefault((a.dtype, names[i] if a.dtype.kind == "f" else None), []).append(i)
    results: list[np.ndarray] = [np.empty(0)] * len(items)
    for k, ((dtype, codec), members) in enumerate(groups.items()):
        coder = codec_for(items[members[0]], op, codec, None)
        parts = [segment_bounds(items[i].shape[0], world, math.prod(items[i].shape[1:])) for i in members]
        # Segment r of the fused buffer: every member's rows for rank r, member after member.
        flats = [np.ascontiguousarray(items[i]).reshape(-1) for i in members]
        pieces = [flat[bounds[r][0]: bounds[r][1]] for r in range(world) for flat, bounds in zip(flats, parts, strict=True)]
        src = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
        edges = np.cumsum([0] + [sum(b[r][1] - b[r][0] for b in parts) for r in range(world)]).tolist()
        fused = [(edges[r], edges[r + 1]) for r in range(world)]
        buf = np.empty_like(src)
        values = reduction_values(src, buf, op, world, coder, None)
        program = programs.ring_reduce(ring_of(session), fused, chunk_elems(dtype, chunk_bytes), gather=False)
        part_name = name if name is None or len(groups) == 1 else f"{name}.{k}"
        part = replace(descriptor, dtype=dtype.name, codec=coder.name if coder is not None else "")
        await executor.run(session, part_name, part, timeout_s, program, values)
        at = fused[rank][0]
        for i, bounds in zip(members, parts, strict=True):
            n = bounds[rank][1] - bounds[rank][0]
            results[i] = buf[at: at + n].copy().reshape((-1, *items[i].shape[1:]))
            at += n
    return results
