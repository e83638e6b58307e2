"""The collectives' public side: arguments checked, descriptors made, results shaped.

Each collective asks for its plan once (algorithms.plan, planner.py: algorithm, stages, chunks),
then hands it to the runner of its op (algorithms.py, hierarchy.py by host), which builds the
programs the plan names (programs/, the pure schedules of ring.py's steps), the data their steps
act on (values.py: as they are, encoded by a codec, or blocks by origin), and runs them with the
executor (programs/executor.py), which does everything else once for all of them.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np

from ringserve.codecs import Codec
from ringserve.errors import InvalidArgumentError
from ringserve.ring import check_op, segment_bounds
from ringserve.worker.dataplane import programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import executor
from ringserve.worker.dataplane.programs.executor import ring_of
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Blocks, Exchange
from ringserve.worker.ops import algorithms, hierarchy
from ringserve.worker.ops.arguments import as_array, chunk_elems, codec_for, non_finite_error, result_buffer, scratch
from ringserve.worker.ops.planner import Call
from ringserve.worker.ops.refusal import refuse


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
    """Allreduce (by the ring, or as the plan says: planner.py); the result goes to a new
    array, or into ``out`` (``out=a`` is in place).

    ``compression`` names a wire codec (see codecs.py) for floating point arrays; ``residual``
    turns on error feedback (see values.Coded). With ``check_finite``, a result that holds NaN or Inf
    raises NonFiniteError; as the result is bit-identical everywhere, every rank raises it.
    """
    array = as_array(a)
    check_op(op, array.dtype)
    coder = codec_for(array, op, compression, residual)
    src = np.ascontiguousarray(array).reshape(-1)
    buf = result_buffer(session, array, out)
    descriptor = Descriptor("allreduce", dtype=array.dtype.name, shape=array.shape, op=op,
                            codec=coder.name if coder is not None else "")
    flat_residual = None if residual is None else residual.reshape(-1)
    plan = await algorithms.plan(session, wire_call("allreduce", buf, coder), chunk_bytes)
    if plan.by_host:
        key = await hierarchy.allreduce(session, plan, src, buf, op=op, name=name, descriptor=descriptor,
                                        timeout_s=timeout_s)
    else:
        key = await algorithms.allreduce(session, plan, src, buf, op=op, name=name, descriptor=descriptor,
                                         timeout_s=timeout_s, coder=coder, residual=flat_residual)
    if (check_finite or flat_residual is not None) and buf.dtype.kind == "f" and not np.isfinite(buf).all():
        if flat_residual is not None:
            flat_residual[:] = 0  # a NaN or Inf fed back would poison every later call
        if check_finite:
            raise non_finite_error(key)
    return buf.reshape(array.shape) if out is None else out


def wire_call(op: str, buf: np.ndarray, coder: Codec | None) -> Call:
    """What the planner needs of a reduction of ``buf``'s elements, under ``coder`` if any."""
    wire_bytes = coder.encoded_bytes(buf.size) if coder is not None else buf.nbytes
    return Call(op, buf.size, buf.dtype.itemsize, wire_bytes, coder.name if coder is not None else "")


async def reduce_scatter(session: Session, a: Any, *, op: str, name: str | None, chunk_bytes: int, timeout_s: float,
                         compression: str | None = None) -> np.ndarray:
    array = as_array(a)
    check_op(op, array.dtype)
    if array.ndim == 0:
        raise InvalidArgumentError("reduce_scatter needs an array with at least one dimension.")
    coder = codec_for(array, op, compression, None)
    rest = array.shape[1:]
    src = np.ascontiguousarray(array).reshape(-1)
    buf = scratch(session, src.dtype, src.size)  # internal: only this rank's part is returned, as a copy
    world, rank = session.place.size, session.place.rank
    bounds = segment_bounds(array.shape[0], world, math.prod(rest))
    descriptor = Descriptor("reduce_scatter", dtype=array.dtype.name, shape=array.shape, op=op,
                            codec=coder.name if coder is not None else "")
    plan = await algorithms.plan(session, wire_call("reduce_scatter", buf, coder), chunk_bytes)
    await algorithms.reduce_scatter(session, plan, src, buf, bounds, op=op, name=name, descriptor=descriptor,
                                    timeout_s=timeout_s, coder=coder)
    a0, b0 = bounds[rank]
    return buf[a0:b0].copy().reshape((-1, *rest))


BARRIER = Descriptor("barrier")
BARRIER_CALL = Call("barrier", 1, 4, 4)  # one int32, in one chunk


async def barrier(session: Session, *, timeout_s: float) -> None:
    """An allreduce of one int32 (by the ring, or the algorithm a 4-byte allreduce runs)."""
    buf = np.zeros(1, dtype=np.int32)
    plan = await algorithms.plan(session, BARRIER_CALL, buf.nbytes)
    await algorithms.allreduce(session, plan, buf, buf, op="sum", name=None, descriptor=BARRIER, timeout_s=timeout_s)


async def broadcast_bytes(
    session: Session,
    flat: np.ndarray | None,
    *,
    dtype: np.dtype,
    root: int,
    name: str | None,
    descriptor: Descriptor,
    chunk_bytes: int,
    timeout_s: float,
) -> np.ndarray:
    """Chain broadcast from ``root`` (see programs.broadcast_chain); non-roots may pass None when
    the size is unknown, and otherwise fail if the root sends a different size."""
    world, rank = session.place.size, session.place.rank
    blocks: list[np.ndarray | None] = [None] * world
    expect: list[int | None] = [None] * world
    if rank == root:
        assert flat is not None
        blocks[root] = flat
    elif flat is not None:
        expect[root] = flat.size
    values = Blocks(dtype, blocks, expect=expect)
    total = flat.size if flat is not None else 0
    # The size when every rank knows it (an array's shape is in its descriptor); else (an object)
    # a plan by latency alone, which every rank can make.
    known = flat.nbytes if flat is not None and descriptor.kind != "broadcast_object" else 0
    plan = await algorithms.plan(session, Call("broadcast", itemsize=dtype.itemsize, wire_bytes=known), chunk_bytes)
    await algorithms.broadcast(session, plan, values, root, total, name=name, descriptor=descriptor,
                               timeout_s=timeout_s)
    out = values.blocks[root]
    assert out is not None
    return out


def _check_root(root: int, world: int) -> None:
    if not 0 <= root < world:
        raise InvalidArgumentError(f"The root rank ({root}) must be in [0, {world}).")


async def broadcast(session: Session, a: Any, *, root: int, name: str | None, chunk_bytes: int, timeout_s: float) -> np.ndarray:
    array = as_array(a)
    _check_root(root, session.place.size)
    flat = np.array(array, copy=True, order="C").reshape(-1)
    descriptor = Descriptor("broadcast", dtype=array.dtype.name, shape=array.shape, root=root)
    out = await broadcast_bytes(session, flat, dtype=array.dtype, root=root, name=name,
                                descriptor=descriptor, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    return out.reshape(array.shape)


async def allgather_blocks(
    session: Session,
    flat: np.ndarray,
    *,
    row: int,
    name: str | None,
    descriptor: Descriptor,
    chunk_bytes: int,
    timeout_s: float,
) -> list[np.ndarray]:
    """Ring allgather of blocks whose sizes differ by rank; returns the flat blocks in rank order."""
    world, rank = session.place.size, session.place.rank
    blocks: list[np.ndarray | None] = [None] * world
    blocks[rank] = flat
    values = Blocks(flat.dtype, blocks, row=row)
    # Each rank knows its own block only: a plan by latency alone, which every rank can make.
    plan = await algorithms.plan(session, Call("allgather", itemsize=flat.dtype.itemsize), chunk_bytes)
    await algorithms.allgather_blocks(session, plan, values, flat.size, name=name, descriptor=descriptor,
                                      timeout_s=timeout_s)
    return [b if b is not None else flat[:0] for b in values.blocks]


async def allgather(session: Session, a: Any, *, name: str | None, chunk_bytes: int, timeout_s: float) -> np.ndarray:
    array = as_array(a)
    if array.ndim == 0:
        raise InvalidArgumentError("allgather needs an array with at least one dimension.")
    rest = tuple(array.shape[1:])
    flat = np.ascontiguousarray(array).reshape(-1)
    descriptor = Descriptor("allgather", dtype=array.dtype.name, rows=rest)
    blocks = await allgather_blocks(session, flat, row=math.prod(rest), name=name,
                                    descriptor=descriptor, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    return np.concatenate([b.reshape((-1, *rest)) for b in blocks], axis=0)


def split_rows(splits: Any, rows: int, world: int) -> tuple[list[int], str]:
    """The rows an alltoall sends to each rank, and what is wrong with ``splits`` ("" if nothing).

    As Horovod: no splits (or empty ones) split the first dimension evenly, which must then be a
    multiple of the world size; otherwise one non-negative integer per rank, summing to at most
    the first dimension (rows after the sum are not sent).
    """
    if splits is None or np.size(splits) == 0:
        if rows % world:
            return [], (f"the first dimension ({rows}) is not a multiple of the world size ({world}); "
                        f"pass splits to send uneven parts")
        return [rows // world] * world, ""
    parts = np.asarray(splits)
    if parts.dtype.kind not in "iu" or parts.ndim != 1:
        return [], f"splits must be one integer per rank, not an array of {parts.dtype} of shape {parts.shape}"
    if parts.size != world:
        return [], f"splits has {parts.size} entries, but the world has {world} ranks"
    if (parts < 0).any():
        return [], f"splits {parts.tolist()} holds a negative number of rows"
    total = int(parts.sum())
    if total > rows:
        return [], f"splits {parts.tolist()} sum to {total}, more than the first dimension ({rows})"
    return [int(p) for p in parts], ""


async def alltoall(session: Session, a: Any, *, splits: Any = None, name: str | None, chunk_bytes: int,
                   timeout_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Sends ``splits[d]`` rows of ``a`` (along axis 0, in order) to rank d; returns the rows every
    rank sent this one, concatenated in rank order, and how many came from each (int64).

    Arguments that are wrong on a rank (see split_rows, a scalar) fail on every rank within
    ``abort_grace_s`` (see refuse), never by a deadline.
    """
    array = as_array(a)
    world, rank = session.place.size, session.place.rank
    rest = tuple(array.shape[1:])
    descriptor = Descriptor("alltoall", dtype=array.dtype.name, rows=rest)
    if array.ndim == 0:
        await refuse(session, name, descriptor, "alltoall needs an array with at least one dimension", timeout_s)
    rows, problem = split_rows(splits, array.shape[0], world)
    if problem:
        await refuse(session, name, descriptor, problem, timeout_s)
    row = math.prod(rest)
    if row == 0:  # blocks of no elements tell no row counts: exchange the counts themselves
        counts, _ = await alltoall(session, np.array(rows, dtype=np.int64).reshape(world, 1), name=name,
                                   chunk_bytes=chunk_bytes, timeout_s=timeout_s)
        return np.empty((int(counts.sum()), *rest), dtype=array.dtype), counts.reshape(-1)
    flat = np.ascontiguousarray(array).reshape(-1)
    starts = np.concatenate([[0], np.cumsum(rows)]) * row
    outgoing = [flat[starts[d]: starts[d + 1]] for d in range(world)]
    values = Exchange(array.dtype, outgoing, row=row)
    values.blocks[rank] = outgoing[rank]  # a rank's block to itself never travels
    program = programs.alltoall_ring(ring_of(session), [b.size for b in outgoing], chunk_elems(array.dtype, chunk_bytes))
    await executor.run(session, name, descriptor, timeout_s, program, values)
    received = [b if b is not None else flat[:0] for b in values.blocks]
    counts = np.array([b.size // row for b in received], dtype=np.int64)
    return np.concatenate(received).reshape((-1, *rest)), counts


def _pickled(obj: object) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


async def broadcast_object(session: Session, obj: object, *, root: int, name: str | None, chunk_bytes: int, timeout_s: float) -> object:
    _check_root(root, session.place.size)
    flat = _pickled(obj) if session.place.rank == root else None
    out = await broadcast_bytes(session, flat, dtype=np.dtype(np.uint8), root=root, name=name,
                                descriptor=Descriptor("broadcast_object", root=root), chunk_bytes=chunk_bytes,
                                timeout_s=timeout_s)
    if session.place.rank == root:
        return obj
    return pickle.loads(out.tobytes())


async def allgather_object(session: Session, obj: object, *, name: str | None, chunk_bytes: int, timeout_s: float) -> list[object]:
    blocks = await allgather_blocks(session, _pickled(obj), row=1, name=name,
                                    descriptor=Descriptor("allgather_object"), chunk_bytes=chunk_bytes,
                                    timeout_s=timeout_s)
    return [pickle.loads(b.tobytes()) for b in blocks]
