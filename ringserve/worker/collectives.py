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

from ringserve import codecs, wire
from ringserve._proto.peer_pb2 import CODEC_NONE
from ringserve.codecs import Codec
from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError, NonFiniteError, ProtocolError
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
        # NaN and Inf are data here (check_finite reports them): inf - inf in a sum must not warn,
        # or, under -W error, raise on one rank in the middle of the ring. numpy keeps this
        # setting per task (a context variable), so it covers this collective only.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            async with asyncio.timeout(timeout_s):
                result = await body(key, inbox)
                if session.checksum:
                    await _confirm(session, key, inbox)
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


class _Raw:
    """How ring_reduce moves values when they travel as they are: sums land straight in ``buf``."""

    def __init__(self, src: np.ndarray, buf: np.ndarray, op: str, world: int, key: str) -> None:
        self.src, self.buf, self.op, self.world, self.key = src, buf, op, world, key
        self.dtype = wire.dtype_code(buf.dtype)
        self.codec = CODEC_NONE

    def alone(self, a: int, b: int) -> np.ndarray:
        """The "partial sum" of a world of one: this rank's input."""
        part = self.buf[a:b]
        if self.buf is not self.src:
            part[:] = self.src[a:b]
        return part

    def first(self, a: int, b: int) -> np.ndarray:
        """What this rank sends of its own input at the first step."""
        return self.src[a:b]

    def reduce(self, a: int, b: int, frame: Received) -> np.ndarray:
        """The partial sum of what arrived and this rank's input."""
        part = self.buf[a:b]
        combine_into(self.src[a:b], _payload(frame, self.buf.dtype, b - a, self.key), self.op, out=part)
        return part

    def pass_on(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        """What goes to the successor for a partial sum."""
        return part

    def own(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        """Finishes the segment this rank owns; returns what the allgather phase sends of it."""
        finish_into(part, self.op, self.world)
        return part

    def take(self, a: int, b: int, frame: Received) -> None:
        """Stores a finished segment that arrived in the allgather phase."""
        self.buf[a:b] = _payload(frame, self.buf.dtype, b - a, self.key)


class _Coded(_Raw):
    """Partial sums travel encoded by ``codec`` and are added in float32 (float64 for float64).

    With ``residual`` (error feedback), this rank's input is ``src + residual``, and on return
    ``residual`` holds what this rank's encodings lost, in units of the sum: every segment is
    encoded by this rank exactly once, so adding it to the next call's input loses nothing over
    time. The owner of a segment keeps ``decode(encode(result))``, the very values the others
    decode, so that every rank ends bit-identical.
    """

    def __init__(self, src: np.ndarray, buf: np.ndarray, op: str, world: int, key: str,
                 codec: Codec, residual: np.ndarray | None) -> None:
        super().__init__(src, buf, op, world, key)
        self.coder = codec
        self.codec = codec.code
        self.residual = residual
        self.acc = codecs.sum_dtype(buf.dtype)

    def _mine(self, a: int, b: int) -> np.ndarray:
        x = self.src[a:b].astype(self.acc)
        if self.residual is not None:
            x += self.residual[a:b]
        return x

    def alone(self, a: int, b: int) -> np.ndarray:
        return self._mine(a, b)

    def first(self, a: int, b: int) -> np.ndarray:
        return self.pass_on(a, b, self._mine(a, b))

    def reduce(self, a: int, b: int, frame: Received) -> np.ndarray:
        part = self._mine(a, b)
        combine_into(part, self._decoded(frame, b - a), self.op)
        return part

    def pass_on(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        data = self.coder.encode(part)
        if self.residual is not None:  # decoded only to learn what the encoding lost
            np.subtract(part, self.coder.decode(data, b - a), out=self.residual[a:b])
        return data

    def own(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        finish_into(part, self.op, self.world)
        data = self.coder.encode(part)
        kept = self.coder.decode(data, b - a)
        if self.residual is not None:
            lost = self.residual[a:b]
            np.subtract(part, kept, out=lost)
            if self.op == "average":
                lost *= self.world
        self.buf[a:b] = kept
        return data

    def take(self, a: int, b: int, frame: Received) -> None:
        self.buf[a:b] = self._decoded(frame, b - a)

    def _decoded(self, frame: Received, count: int) -> np.ndarray:
        header, payload = frame.header, frame.payload
        if (header.codec != self.codec or header.dtype != self.dtype or header.count != count
                or payload.nbytes != self.coder.encoded_bytes(count)):
            raise ProtocolError(
                f"A frame of collective {self.key!r} carries {header.count} elements of dtype code "
                f"{header.dtype} in codec {header.codec} ({payload.nbytes} bytes), where {count} "
                f"elements of {self.buf.dtype} in {self.coder.name} were expected."
            )
        return self.coder.decode(payload, count)


CONFIRM_SLOT = 1 << 30  # slots of the confirmation lap: far above any ring step or origin rank


async def _confirm(session: Session, key: str, inbox: Inbox) -> None:
    """Returns once every rank has finished the collective with every frame intact.

    With checksums on, a rank that finds a damaged frame aborts the collective, but the other
    ranks may have finished it already (a damaged frame of the last allgather step reaches one rank
    only). So each rank sends an empty frame once it is done, and returns only when it has the
    frames of all the others: an abort reaches every rank before then, and all ranks agree.
    It costs world - 1 hops of latency, and only with checksums.
    """
    rank, world = session.place.rank, session.place.size
    if world == 1:
        return
    session.send(key, inbox, slot=CONFIRM_SLOT + rank, chunk=0, payload=b"", dtype=wire.dtype_code(np.dtype(np.uint8)), count=0)
    for step in range(world - 1):
        _, origin = allgather_step(rank, world, step)
        frame = await session.recv(key, inbox, CONFIRM_SLOT + origin, 0)
        if step < world - 2:
            session.forward(frame)


async def ring_reduce(
    session: Session,
    key: str,
    inbox: Inbox,
    values: _Raw,
    bounds: list[tuple[int, int]],
    chunk_elems: int,
    *,
    gather: bool,
) -> None:
    """Reduces the flat ``values.src`` across the ring into the flat ``values.buf`` (may be src).

    Each rank adds its own input once, to the partial result that arrives from its
    predecessor, so ``buf`` needs no copy of ``src`` first: every segment of ``buf`` is written
    once, by a reduction or by the allgather. After the reduce-scatter phase rank ``r`` holds the
    full result of segment ``r``; with
    ``gather`` the allgather phase then gives every rank every segment. Reduce-scatter frames are
    keyed by ring step; allgather frames by ``world - 1 + segment``, so that they can be forwarded
    byte for byte. ``values`` says how values travel (as they are, or encoded).
    """
    rank, world = session.place.rank, session.place.size
    dtype, codec = values.dtype, values.codec
    if world == 1:
        for a, b in chunk_bounds(0, values.buf.size, chunk_elems):
            values.own(a, b, values.alone(a, b))
        return
    last_rs = world - 2
    gather_slot = world - 1
    send_seg, _ = reduce_scatter_step(rank, world, 0)
    for c, (a, b) in enumerate(chunk_bounds(*bounds[send_seg], chunk_elems)):
        session.send(key, inbox, slot=0, chunk=c, payload=values.first(a, b), dtype=dtype, count=b - a, codec=codec)
    for step in range(world - 1):
        _, recv_seg = reduce_scatter_step(rank, world, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            frame = await session.recv(key, inbox, step, c)
            if step == 0 and c == 0:
                _phase(inbox, "reduce_scatter")
            part = values.reduce(a, b, frame)
            if step < last_rs:
                session.send(key, inbox, slot=step + 1, chunk=c, payload=values.pass_on(a, b, part),
                             dtype=dtype, count=b - a, codec=codec)
                continue
            done = values.own(a, b, part)
            if gather:
                session.send(key, inbox, slot=gather_slot + rank, chunk=c, payload=done, dtype=dtype,
                             count=b - a, codec=codec)
    if not gather:
        return
    _phase(inbox, "allgather")
    for step in range(world - 1):
        _, recv_seg = allgather_step(rank, world, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            frame = await session.recv(key, inbox, gather_slot + recv_seg, c)
            values.take(a, b, frame)
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


def _values(src: np.ndarray, buf: np.ndarray, op: str, world: int, key: str,
            coder: Codec | None, residual: np.ndarray | None) -> _Raw:
    """How the values of a reduction travel: as they are, or encoded by a codec."""
    if coder is None:
        return _Raw(src, buf, op, world, key)
    return _Coded(src, buf, op, world, key, coder, residual)


def _coder(array: np.ndarray, op: str, compression: str | None, residual: np.ndarray | None) -> Codec | None:
    """The codec called ``compression``, after checking it and ``residual`` against the input."""
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


def _suffix(coder: Codec | None) -> str:
    """What a codec adds to a collective's descriptor, so that ranks must agree on it."""
    return "" if coder is None else f" codec={coder.name}"


def _non_finite_error(key: str) -> NonFiniteError:
    return NonFiniteError(
        f"The result of collective {key!r} holds NaN or Inf (every rank holds the same result "
        f"and raises this error)."
    )


async def allreduce(
    session: Session,
    a: Any,
    *,
    op: str,
    name: str | None,
    chunk_bytes: int,
    timeout_s: float,
    out: np.ndarray | None = None,
    compression: str | None = None,
    residual: np.ndarray | None = None,
    check_finite: bool = False,
) -> np.ndarray:
    """Ring allreduce; the result goes to a new array, or into ``out`` (``out=a`` is in place).

    ``compression`` names a wire codec (see codecs.py) for floating point arrays; ``residual``
    turns on error feedback (see _Coded). With ``check_finite``, a result that holds NaN or Inf
    raises NonFiniteError; as the result is bit-identical everywhere, every rank raises it.
    """
    array = _as_array(a)
    check_op(op)
    coder = _coder(array, op, compression, residual)
    src = np.ascontiguousarray(array).reshape(-1)
    buf = _output(array, out)
    descriptor = f"allreduce {array.dtype} {tuple(array.shape)} op={op}{_suffix(coder)}"
    world = session.place.size
    bounds = segment_bounds(buf.size, world)
    elems = _chunk_elems(buf.dtype, chunk_bytes)
    flat_residual = None if residual is None else residual.reshape(-1)

    async def body(key: str, inbox: Inbox) -> str:
        values = _values(src, buf, op, world, key, coder, flat_residual)
        await ring_reduce(session, key, inbox, values, bounds, elems, gather=True)
        return key

    key = await run(session, name, descriptor, timeout_s, body)
    if (check_finite or flat_residual is not None) and buf.dtype.kind == "f" and not np.isfinite(buf).all():
        if flat_residual is not None:
            flat_residual[:] = 0  # a NaN or Inf fed back would poison every later call
        if check_finite:
            raise _non_finite_error(key)
    return buf.reshape(array.shape) if out is None else out


async def reduce_scatter(session: Session, a: Any, *, op: str, name: str | None, chunk_bytes: int, timeout_s: float,
                         compression: str | None = None) -> np.ndarray:
    array = _as_array(a)
    check_op(op)
    if array.ndim == 0:
        raise InvalidArgumentError("reduce_scatter needs an array with at least one dimension.")
    coder = _coder(array, op, compression, None)
    rest = array.shape[1:]
    src = np.ascontiguousarray(array).reshape(-1)
    buf = np.empty_like(src)
    world, rank = session.place.size, session.place.rank
    bounds = segment_bounds(array.shape[0], world, math.prod(rest))
    descriptor = f"reduce_scatter {array.dtype} {tuple(array.shape)} op={op}{_suffix(coder)}"

    async def body(key: str, inbox: Inbox) -> None:
        values = _values(src, buf, op, world, key, coder, None)
        await ring_reduce(session, key, inbox, values, bounds, _chunk_elems(buf.dtype, chunk_bytes), gather=False)

    await run(session, name, descriptor, timeout_s, body)
    a0, b0 = bounds[rank]
    return buf[a0:b0].copy().reshape((-1, *rest))


async def barrier(session: Session, *, timeout_s: float) -> None:
    buf = np.zeros(1, dtype=np.int32)
    bounds = segment_bounds(1, session.place.size)

    async def body(key: str, inbox: Inbox) -> None:
        values = _Raw(buf, buf, "sum", session.place.size, key)
        await ring_reduce(session, key, inbox, values, bounds, 1, gather=True)

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
