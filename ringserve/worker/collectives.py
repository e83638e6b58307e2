"""Collectives driven over one view's ring: the pure schedule from ``ring.py``, carried out as
pipelined chunks on the session's stream.

Pipelining: chunk ``c`` of step ``s + 1`` leaves as soon as chunk ``c`` of step ``s`` has arrived
and been reduced, so a rank never waits for a whole segment. Every step carries at least one frame
(an empty one for an empty segment), and every frame names its sender's arguments, so a rank whose
arguments differ is caught by its successor at the first step.
"""

from __future__ import annotations

import asyncio
import math
import pickle
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from ringserve import wire
from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError, ProtocolError
from ringserve.observe import Span
from ringserve.ring import (
    allgather_step,
    check_op,
    chunk_bounds,
    combine_into,
    finish_into,
    reduce_scatter_step,
    segment_bounds,
    successor,
)
from ringserve.worker.session import Inbox, Received, Session

T = TypeVar("T")


def _as_array(a: Any) -> np.ndarray:
    array = np.asarray(a)
    wire.dtype_code(array.dtype)
    return array


def _payload(frame: Received, dtype: np.dtype, count: int, key: str) -> np.ndarray:
    """The frame's elements, after checking that its dtype, count and length are the expected ones."""
    header, payload = frame.header, frame.payload
    if header.dtype != wire.dtype_code(dtype) or header.count != count or payload.nbytes != count * dtype.itemsize:
        raise ProtocolError(
            f"A frame of collective {key!r} carries {header.count} elements of dtype code {header.dtype} "
            f"in {payload.nbytes} bytes, where {count} elements of {dtype} were expected."
        )
    return np.frombuffer(payload, dtype=dtype)


async def run(
    session: Session,
    name: str | None,
    descriptor: str,
    timeout_s: float,
    body: Callable[[str, Inbox], Awaitable[T]],
) -> T:
    """Runs one collective under its deadline, counts it, and forgets its frames afterwards."""
    key, inbox = session.open(name, descriptor)
    kind = descriptor.split(" ", 1)[0]
    span = inbox.span = Span(session.timeline, session.counters, f"{kind} {key}", {
        "op": kind, "op_key": key, "descriptor": descriptor, "view": session.view_id, "rank": session.place.rank,
    })
    ok = False
    try:
        async with asyncio.timeout(timeout_s):
            result = await body(key, inbox)
        ok = True
    except TimeoutError:
        raise CollectiveTimeoutError(
            f"Collective {key!r} ({descriptor}) did not finish within {timeout_s:g} s on rank "
            f"{session.place.rank} of view {session.view_id}."
        ) from None
    finally:
        session.release(key)
        elapsed = span.end(ok)
    session.counters.observe(kind, elapsed)
    return result


async def ring_reduce(
    session: Session,
    key: str,
    inbox: Inbox,
    src: np.ndarray,
    buf: np.ndarray,
    op: str,
    bounds: list[tuple[int, int]],
    chunk_elems: int,
    *,
    gather: bool,
) -> None:
    """Reduces the flat ``src`` across the ring into the flat ``buf`` (which may be ``src``).

    Each rank adds its own input once, to the partial result that arrives from its
    predecessor, so ``buf`` needs no copy of ``src`` first: every segment of ``buf`` is written
    once, by a reduction or by the allgather. After the reduce-scatter phase rank ``r`` holds the
    full result of segment ``r``; with
    ``gather`` the allgather phase then gives every rank every segment. Reduce-scatter frames are
    keyed by ring step; allgather frames by ``world - 1 + segment``, so that they can be forwarded
    byte for byte.
    """
    rank, world = session.place.rank, session.place.size
    code = wire.dtype_code(buf.dtype)
    if world == 1:
        if buf is not src:
            buf[:] = src
        finish_into(buf, op, world)
        return
    last_rs = world - 2
    gather_slot = world - 1
    send_seg, _ = reduce_scatter_step(rank, world, 0)
    for c, (a, b) in enumerate(chunk_bounds(*bounds[send_seg], chunk_elems)):
        session.send(key, inbox, slot=0, chunk=c, payload=src[a:b], dtype=code, count=b - a)
    for step in range(world - 1):
        _, recv_seg = reduce_scatter_step(rank, world, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            frame = await session.recv(key, inbox, step, c)
            if step == 0 and c == 0:
                _phase(inbox, "reduce_scatter")
            part = buf[a:b]
            combine_into(src[a:b], _payload(frame, buf.dtype, b - a, key), op, out=part)
            if step < last_rs:
                session.send(key, inbox, slot=step + 1, chunk=c, payload=part, dtype=code, count=b - a)
                continue
            finish_into(part, op, world)
            if gather:
                session.send(key, inbox, slot=gather_slot + rank, chunk=c, payload=part, dtype=code, count=b - a)
    if not gather:
        return
    _phase(inbox, "allgather")
    for step in range(world - 1):
        _, recv_seg = allgather_step(rank, world, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            frame = await session.recv(key, inbox, gather_slot + recv_seg, c)
            buf[a:b] = _payload(frame, buf.dtype, b - a, key)
            if step < world - 2:
                session.forward(frame)


def _phase(inbox: Inbox, name: str) -> None:
    """Marks the start of a phase on the timeline; the wait before the first frame is "negotiate"."""
    if inbox.span is not None:
        inbox.span.phase(name)


def _chunk_elems(dtype: np.dtype, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // dtype.itemsize)


def _output(array: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """The flat result buffer: a new array, or ``out`` (which may be the input itself)."""
    if out is None:
        return np.empty(array.size, dtype=array.dtype)
    if not isinstance(out, np.ndarray) or out.shape != array.shape or out.dtype != array.dtype:
        raise InvalidArgumentError(
            f"out must be an array of the input's shape {array.shape} and dtype {array.dtype}."
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgumentError("out must be a writeable C-contiguous array.")
    return out.reshape(-1)


async def allreduce(
    session: Session,
    a: Any,
    *,
    op: str,
    name: str | None,
    chunk_bytes: int,
    timeout_s: float,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Ring allreduce; the result goes to a new array, or into ``out`` (``out=a`` is in place)."""
    array = _as_array(a)
    check_op(op)
    src = np.ascontiguousarray(array).reshape(-1)
    buf = _output(array, out)
    descriptor = f"allreduce {array.dtype} {tuple(array.shape)} op={op}"
    bounds = segment_bounds(buf.size, session.place.size)
    elems = _chunk_elems(buf.dtype, chunk_bytes)

    async def body(key: str, inbox: Inbox) -> None:
        await ring_reduce(session, key, inbox, src, buf, op, bounds, elems, gather=True)

    await run(session, name, descriptor, timeout_s, body)
    return buf.reshape(array.shape) if out is None else out


async def reduce_scatter(session: Session, a: Any, *, op: str, name: str | None, chunk_bytes: int, timeout_s: float) -> np.ndarray:
    array = _as_array(a)
    check_op(op)
    if array.ndim == 0:
        raise InvalidArgumentError("reduce_scatter needs an array with at least one dimension.")
    rest = array.shape[1:]
    src = np.ascontiguousarray(array).reshape(-1)
    buf = np.empty_like(src)
    world, rank = session.place.size, session.place.rank
    bounds = segment_bounds(array.shape[0], world, math.prod(rest))
    descriptor = f"reduce_scatter {array.dtype} {tuple(array.shape)} op={op}"

    async def body(key: str, inbox: Inbox) -> None:
        await ring_reduce(session, key, inbox, src, buf, op, bounds, _chunk_elems(buf.dtype, chunk_bytes), gather=False)

    await run(session, name, descriptor, timeout_s, body)
    a0, b0 = bounds[rank]
    return buf[a0:b0].copy().reshape((-1, *rest))


async def barrier(session: Session, *, timeout_s: float) -> None:
    buf = np.zeros(1, dtype=np.int32)
    bounds = segment_bounds(1, session.place.size)

    async def body(key: str, inbox: Inbox) -> None:
        await ring_reduce(session, key, inbox, buf, buf, "sum", bounds, 1, gather=True)

    await run(session, None, "barrier", timeout_s, body)


async def broadcast_bytes(
    session: Session,
    flat: np.ndarray | None,
    *,
    dtype: np.dtype,
    root: int,
    name: str | None,
    descriptor: str,
    chunk_bytes: int,
    timeout_s: float,
) -> np.ndarray:
    """Pipelined chain broadcast from ``root``; non-roots may pass None when the size is unknown.

    The chain runs root -> root+1 -> ... -> root-1, and the last rank sends an empty frame back to
    the root, which closes the ring: the root learns that every rank got the data and whether the
    last rank's arguments matched its own. The root then sends an empty commit frame down the
    chain, and a non-root returns only once it has it: a rank whose arguments differ is caught
    downstream of the ranks before it, and they must fail too, not return the data.
    """
    world, rank = session.place.size, session.place.rank
    code = wire.dtype_code(dtype)
    elems = _chunk_elems(dtype, chunk_bytes)
    nxt = successor(rank, world)

    async def body(key: str, inbox: Inbox) -> np.ndarray:
        if rank == root:
            assert flat is not None
            _phase(inbox, "broadcast")
            if world > 1:
                for c, (a, b) in enumerate(chunk_bounds(0, flat.size, elems)):
                    session.send(key, inbox, slot=0, chunk=c, payload=flat[a:b], dtype=code,
                                 count=b - a, origin=root, origin_count=flat.size)
                await session.recv(key, inbox, 1, 0)
                session.send(key, inbox, slot=2, chunk=0, payload=b"", dtype=code, count=0)
            return flat
        frame = await session.recv(key, inbox, 0, 0)
        _phase(inbox, "broadcast")
        total = frame.header.origin_count
        if flat is not None and total != flat.size:
            raise ProtocolError(f"The root of {key!r} sent {total} elements, not {flat.size}.")
        out = np.empty(total, dtype=dtype)
        for c, (a, b) in enumerate(chunk_bounds(0, total, elems)):
            if c:
                frame = await session.recv(key, inbox, 0, c)
            out[a:b] = _payload(frame, dtype, b - a, key)
            if nxt != root:
                session.forward(frame)
        if nxt == root:
            session.send(key, inbox, slot=1, chunk=0, payload=b"", dtype=code, count=0)
        commit = await session.recv(key, inbox, 2, 0)
        if nxt != root:
            session.forward(commit)
        return out

    return await run(session, name, descriptor, timeout_s, body)


def _check_root(root: int, world: int) -> None:
    if not 0 <= root < world:
        raise InvalidArgumentError(f"The root rank ({root}) must be in [0, {world}).")


async def broadcast(session: Session, a: Any, *, root: int, name: str | None, chunk_bytes: int, timeout_s: float) -> np.ndarray:
    array = _as_array(a)
    _check_root(root, session.place.size)
    flat = np.array(array, copy=True, order="C").reshape(-1)
    descriptor = f"broadcast {array.dtype} {tuple(array.shape)} root={root}"
    out = await broadcast_bytes(session, flat, dtype=array.dtype, root=root, name=name,
                                descriptor=descriptor, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    return out.reshape(array.shape)


async def allgather_blocks(
    session: Session,
    flat: np.ndarray,
    *,
    row: int,
    name: str | None,
    descriptor: str,
    chunk_bytes: int,
    timeout_s: float,
) -> list[np.ndarray]:
    """Ring allgather of blocks whose sizes differ by rank; returns the flat blocks in rank order."""
    world, rank = session.place.size, session.place.rank
    dtype = flat.dtype
    code = wire.dtype_code(dtype)
    elems = _chunk_elems(dtype, chunk_bytes)

    async def body(key: str, inbox: Inbox) -> list[np.ndarray]:
        blocks: list[np.ndarray] = [flat] * world
        if world == 1:
            return blocks
        for c, (a, b) in enumerate(chunk_bounds(0, flat.size, elems)):
            session.send(key, inbox, slot=rank, chunk=c, payload=flat[a:b], dtype=code, count=b - a,
                         origin=rank, origin_count=flat.size)
        for step in range(world - 1):
            _, origin = allgather_step(rank, world, step)
            frame = await session.recv(key, inbox, origin, 0)
            if step == 0:
                _phase(inbox, "allgather")
            total = frame.header.origin_count
            if total % max(row, 1):
                raise ProtocolError(
                    f"Collective {key!r} got a block of {total} elements from rank {origin}, "
                    f"which is not a whole number of rows of {row}."
                )
            block = np.empty(total, dtype=dtype)
            for c, (a, b) in enumerate(chunk_bounds(0, total, elems)):
                if c:
                    frame = await session.recv(key, inbox, origin, c)
                block[a:b] = _payload(frame, dtype, b - a, key)
                if step < world - 2:
                    session.forward(frame)
            blocks[origin] = block
        return blocks

    return await run(session, name, descriptor, timeout_s, body)


async def allgather(session: Session, a: Any, *, name: str | None, chunk_bytes: int, timeout_s: float) -> np.ndarray:
    array = _as_array(a)
    if array.ndim == 0:
        raise InvalidArgumentError("allgather needs an array with at least one dimension.")
    rest = tuple(array.shape[1:])
    flat = np.ascontiguousarray(array).reshape(-1)
    descriptor = f"allgather {array.dtype} (*, {', '.join(map(str, rest))})"
    blocks = await allgather_blocks(session, flat, row=math.prod(rest), name=name,
                                    descriptor=descriptor, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    return np.concatenate([b.reshape((-1, *rest)) for b in blocks], axis=0)


def _pickled(obj: object) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


async def broadcast_object(session: Session, obj: object, *, root: int, name: str | None, chunk_bytes: int, timeout_s: float) -> object:
    _check_root(root, session.place.size)
    flat = _pickled(obj) if session.place.rank == root else None
    out = await broadcast_bytes(session, flat, dtype=np.dtype(np.uint8), root=root, name=name,
                                descriptor=f"broadcast_object root={root}", chunk_bytes=chunk_bytes,
                                timeout_s=timeout_s)
    if session.place.rank == root:
        return obj
    return pickle.loads(out.tobytes())


async def allgather_object(session: Session, obj: object, *, name: str | None, chunk_bytes: int, timeout_s: float) -> list[object]:
    blocks = await allgather_blocks(session, _pickled(obj), row=1, name=name,
                                    descriptor="allgather_object", chunk_bytes=chunk_bytes,
                                    timeout_s=timeout_s)
    return [pickle.loads(b.tobytes()) for b in blocks]
