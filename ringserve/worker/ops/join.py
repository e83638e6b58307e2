"""join(): Horovod's semantics for uneven data. A rank that has run out of data joins; until every
rank has joined it takes part in the others' collectives, and join returns the last rank to join.

How a joined rank takes part: it learns of the others' collectives from their frames. Every frame
names its collective's key and descriptor (op, dtype, shape), and the ring brings every
collective's frames to every rank, so a frame of a collective this rank has not opened reaches it
(``Plane.on_unopened``, or ``Plane.unopened()`` for those that came before the join). It then
opens that very key (``Session.open(key=...)``) with what ``stand_in`` decides for the descriptor,
as Horovod's joined ranks do:

- an allreduce (plain, compressed, or Adasum): zeros of the same dtype and shape, so the others get
  the reduction of their own tensors, and Average still divides by the world size (Horovod's test
  expects ``(size - 1) / size`` of a tensor when one rank of ``size`` has joined). For Min, Max and
  Product zeros are zeros, as in Horovod;
- a barrier: it takes part;
- anything else (allgather, broadcast, alltoall, reducescatter, the object collectives, a sparse
  allreduce, which gathers): Horovod refuses these while a rank has joined ("Allgather is not
  supported with Join at this time", controller.cc), and so does this rank: it opens the collective
  under a descriptor that says so (refusal.py's lap), and every rank in it fails at once with
  MismatchError (a RuntimeError, which is what Horovod's tests catch).

What a frame says of its collective is parsed once (``Descriptor.parse``, descriptor.py); a text
that is no descriptor is refused as any collective this rank cannot stand in for.

A join is over the whole view, as Horovod's is over the global process set: a joined rank stands
in for the whole view's collectives only (keys without a ring spec, see keys.py), and counts only
those; a sub-ring's collectives are not stood in for, and wait for this rank to open them.

The join itself is an allgather (name ``ringserve.join``): each rank gives its clock and how many
collectives of each name it has opened. A rank's frames of it wait in the inboxes of ranks still
working. Once it completes, each rank knows every collective any rank opened before joining, and
stays joined (standing in) until it has opened each of them too: a collective started just before
a rank's join may reach the others only after their join completed. Once its stand-ins have ended,
it stops standing in and runs a last lap of empty frames (``join stage=done``): no rank leaves join
before every rank has stopped standing in, so the collectives a rank starts after its join are
never taken for ones of before.

The last rank to join is the one that opened the most collectives of its own accord since the
last join (a rank that joined later cannot have opened fewer: every collective a rank opened
before joining happened before any later rank joined, and that rank took part in it), ties broken
by the wall clock at the join, then by rank. Every rank computes it from the same gathered values, so all return the same.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import numpy as np

from ringserve.errors import CollectiveTimeoutError, ProtocolError, RingserveError, UsageError
from ringserve.worker.dataplane import keys, programs, routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import executor
from ringserve.worker.dataplane.programs.executor import ring_of
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Values
from ringserve.worker.ops import adasum, algorithms, collectives, refusal
from ringserve.worker.ops.arguments import codec_for

log = logging.getLogger("ringserve.worker")

JOIN = "ringserve.join"
JOINING = Descriptor("join")  # the join's own allgather
JOINED = Descriptor("join", stage="done")  # its last lap


@dataclass(frozen=True)
class Zeros:
    """Stand in with zeros: an allreduce of this dtype and shape."""

    dtype: np.dtype
    shape: tuple[int, ...]
    op: str
    codec: str | None
    algorithm: str = "ring"  # the others' (routes.py): this rank runs the same program


@dataclass(frozen=True)
class Along:
    """Stand in by taking part with no data of one's own (a barrier)."""


@dataclass(frozen=True)
class Refuse:
    """Refuse the collective: every rank in it fails with MismatchError naming ``reason``."""

    reason: str


Stand = Zeros | Along | Refuse


def stand_in(descriptor: Descriptor) -> Stand | None:
    """What a joined rank does for a collective of ``descriptor`` (None: nothing, a join's own).

    Pure: tested without sockets. Adasum's allreduces are Zeros too (adasum.py reads their parts).
    """
    kind = descriptor.kind
    if kind == "join":
        return None  # a later join of the others: this rank opens it itself once this one is over
    if kind == "barrier":
        return Along()
    if (kind == "allreduce" and descriptor.dtype and descriptor.shape is not None and descriptor.op
            and not descriptor.stage and not descriptor.problem):
        try:
            dtype = np.dtype(descriptor.dtype)
        except TypeError:
            dtype = None
        if dtype is not None:
            return Zeros(dtype, descriptor.shape, descriptor.op, descriptor.codec or None, routes.algorithm_of(descriptor))
    what = kind or "a collective"
    return Refuse(f"{what} is not supported while a rank has joined (as in Horovod: only allreduce and barrier are)")


def _read(text: str) -> Descriptor:
    """What a frame says of its collective, or, if it is no descriptor, a collective to refuse."""
    try:
        return Descriptor.parse(text)
    except ProtocolError:
        return Descriptor("")


async def _stand(session: Session, key: str, descriptor: Descriptor, *, chunk_bytes: int, timeout_s: float) -> None:
    """Opens the others' collective ``key`` on this joined rank, as ``stand_in`` decides."""
    plan = stand_in(descriptor)
    if plan is None:
        return
    if isinstance(plan, Refuse):
        await refusal.lap(session, None, Descriptor("joined", problem=plan.reason), timeout_s, key=key)
        return
    if isinstance(plan, Along):
        buf = np.zeros(1, dtype=np.int32)
        along = algorithms.forced(session, routes.algorithm_of(descriptor), collectives.BARRIER_CALL, buf.nbytes)
        await algorithms.allreduce(session, along, buf, buf, op="sum", name=None,
                                   descriptor=routes.untagged(descriptor), timeout_s=timeout_s, key=key)
        return
    zeros = np.zeros(plan.shape, dtype=plan.dtype)
    if plan.op == "adasum":
        await adasum.stand_in(session, key, descriptor, zeros, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
        return
    flat = zeros.reshape(-1)
    coder = codec_for(zeros, plan.op, plan.codec, None)
    theirs = algorithms.forced(session, plan.algorithm, collectives.wire_call("allreduce", flat, coder), chunk_bytes)
    await algorithms.allreduce(session, theirs, flat, np.empty_like(flat), op=plan.op, name=None,
                               descriptor=routes.untagged(descriptor), timeout_s=timeout_s, coder=coder, key=key)


def _arrival(block: np.ndarray, rank: int) -> tuple[int, float, dict[str, int]]:
    """What rank ``rank`` said when it joined (JSON, never a pickle: it comes from a peer)."""
    try:
        opened, clock, counts = json.loads(block.tobytes())
        checked = {str(k): int(v) for k, v in counts.items()}
        return int(opened), float(clock), checked
    except (ValueError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"Rank {rank}'s join block is not what a join sends: {exc}") from exc


def last_to_join(arrivals: list[tuple[int, float]]) -> int:
    """The rank that joined last: the most collectives opened of its own accord, then the latest
    clock, then the highest rank."""
    return max(range(len(arrivals)), key=lambda r: (arrivals[r][0], arrivals[r][1], r))


async def join(session: Session, *, chunk_bytes: int, timeout_s: float, join_timeout_s: float) -> int:
    """Stands in for the others' collectives until every rank has joined; returns the last to join.

    Args:
        timeout_s: the deadline of each collective this rank stands in for.
        join_timeout_s: how long to wait for the last rank to join.

    Raises:
        UsageError: a join is already running on this rank.
        CollectiveTimeoutError: not every rank joined within ``join_timeout_s``.
        RingChangedError and the other errors of a collective, from the join's own allgather.
    """
    plane = session.plane
    if session.spec:
        raise UsageError(f"join() runs over the whole view, not over the sub-ring {session.ring.members}.")
    if plane.on_unopened is not None:
        raise UsageError("join() is already running on this rank.")
    loop = asyncio.get_running_loop()
    stands: set[asyncio.Task[None]] = set()
    heard = asyncio.Event()

    def done(task: asyncio.Task[None]) -> None:
        stands.discard(task)
        heard.set()
        if not task.cancelled() and (exc := task.exception()) is not None:
            # A refusal fails here as on the others; any other failure is theirs to see too.
            level = logging.DEBUG if isinstance(exc, RingserveError) else logging.ERROR
            log.log(level, "rank %d view %d: standing in while joined: %r", session.place.rank, session.view_id, exc)

    served: set[str] = set()

    def serve(key: str, descriptor: str) -> None:
        base, number, spec = keys.split(key)
        if base == JOIN or key in served or spec or not number.isdigit():
            return
        served.add(key)
        task = loop.create_task(_stand(session, key, _read(descriptor), chunk_bytes=chunk_bytes, timeout_s=timeout_s),
                                name=f"ringserve-join-stand-{key}")
        stands.add(task)
        task.add_done_callback(done)
        heard.set()

    plane.on_unopened = serve
    try:
        for key, descriptor in plane.unopened():
            serve(key, descriptor)
        numbering = plane.numbering
        mine = json.dumps([numbering.opened, time.time(), numbering.counts()]).encode()
        blocks = await collectives.allgather_blocks(
            session, np.frombuffer(mine, dtype=np.uint8), row=1, name=JOIN, descriptor=JOINING,
            chunk_bytes=chunk_bytes, timeout_s=join_timeout_s)
        gathered = [_arrival(b, r) for r, b in enumerate(blocks)]
        union: dict[str, int] = {}
        for _, _, counts in gathered:
            for base, n in counts.items():
                union[base] = max(union.get(base, 0), n)
        try:
            async with asyncio.timeout(join_timeout_s):
                while numbering.behind(union) or stands:
                    heard.clear()
                    await heard.wait()
        except TimeoutError:
            raise CollectiveTimeoutError(
                f"Rank {session.place.rank} of view {session.view_id} did not take part in every collective "
                f"the other ranks opened before joining within {join_timeout_s:g} s."
            ) from None
        # A last lap: no rank leaves join (and starts new collectives) before every rank has stopped
        # standing in, so no rank takes a collective of after the join for one of before.
        plane.on_unopened = None
        await executor.run(session, JOIN, JOINED, join_timeout_s, programs.confirm(ring_of(session), 0), Values())
        numbering.opened = 0  # the next join compares what the ranks did after this one
        return last_to_join([(opened, clock) for opened, clock, _ in gathered])
    finally:
        plane.on_unopened = None
        for task in list(stands):
            task.cancel()
        if stands:
            await asyncio.wait(list(stands))
