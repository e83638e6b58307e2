"""Hierarchical allreduce: within each host, then across hosts one ring per local slice.

With H hosts of L workers each, a flat ring in rank order crosses between hosts on one edge per
host, and each of those edges carries 2(N-1)/N of the tensor, N = H x L; every step waits for it.
Here instead, in three stages over sub-rings of the view (``plane.session(members)``):

1. a reduce-scatter among the L workers of each host (over shared memory where the host allows):
   local position p ends with the host's sum of slice p of L;
2. an allreduce of slice p among the H workers at local position p, one per host: L rings across
   hosts, each carrying 1/L of the tensor, so every host link is busy and each host sends
   2(H-1)/H of the tensor across in all (against 2(N-1)/N). Each of them runs the algorithm that
   RINGSERVE_ALGORITHM and the cross links call for (algorithms.py): over many hosts, a
   halving-doubling or a tree instead of a ring of 2(H-1) steps;
3. an allgather of the slices among the workers of each host.

Each stage is an ordinary collective of its ring (programs.ring_reduce, programs.ring_gather, run
by the executor), so deadlines, aborts, checksums and timelines hold per stage, and the result is
bit-identical on every rank: each slice is reduced once per host, in a fixed order, then across
hosts in a fixed order, and gathered byte for byte. It differs from the flat ring's result by the
order of a floating point sum only (integers, and floats that sum exactly, agree bit for bit).

Each call takes a number of its own (``hier`` in the plane's numbering, at its start, as every
collective's key), and its stages are named after it, so calls whose stages finish in different
orders on different ranks never meet the wrong stage. A stage that fails with MismatchError (the
ranks' arguments differ) still takes its part in the later stages, with a lap that names the
failure (refusal.py's), so that ranks on other hosts, which only meet this one in a
later stage, fail within abort_grace_s too and not at their deadline.

Every worker must agree on the setting (``hierarchical``), as on ``checksum``: a rank that runs the
flat ring while the others run stages never meets them. ``join`` stands in for whole-view
collectives only, so a job that uses join keeps the flat ring (``hierarchical=0``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

import numpy as np

from ringserve import selection
from ringserve.errors import MismatchError, RingserveError
from ringserve.ring import finish_into, segment_bounds
from ringserve.worker.dataplane import programs, routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.partials import PartialRaw
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.dataplane.programs import executor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Raw, Values
from ringserve.worker.ops import algorithms, refusal
from ringserve.worker.ops.arguments import ring_chunk_elems

MODES = ("auto", "1", "0")
FAILED_STAGE = "an earlier stage of this hierarchical allreduce failed"


def topology(place: Place) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(the ranks of this rank's host, the ranks at its local position on every host), or None
    where the hosts of the view hold different numbers of workers (or are not known)."""
    if len(place.hosts) != place.size:
        return None
    return _rings(place.hosts, place.rank)


@functools.lru_cache(maxsize=64)  # asked on every allreduce, the same answer for the view
def _rings(hosts: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    by_host: dict[int, list[int]] = {}
    for r, host in enumerate(hosts):
        by_host.setdefault(host, []).append(r)
    if len({len(ranks) for ranks in by_host.values()}) != 1:
        return None
    mine = by_host[hosts[rank]]
    position = mine.index(rank)
    return tuple(mine), tuple(by_host[h][position] for h in sorted(by_host))


def consecutive(place: Place) -> bool:
    """Whether each host of the view holds consecutive ranks, as many on each (as the launchers
    number them): what programs_hd.host_doubling runs over."""
    return topology(place) is not None and _consecutive(place.hosts)


@functools.lru_cache(maxsize=64)  # asked on every allreduce by host, the same answer for the view
def _consecutive(hosts: tuple[int, ...]) -> bool:
    """Hosts of equal size (topology's check) holding consecutive ranks each."""
    local = hosts.count(hosts[0])
    return all(hosts[r] == hosts[r - r % local] for r in range(len(hosts))) and len(set(hosts)) == len(hosts) // local


def chosen(mode: str, place: Place) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The rings of a hierarchical allreduce in this view, or None for the flat ring.

    ``auto``: with more than one host, several workers on each and as many on every host; ``1``:
    whenever every host holds as many workers (even one host, or one worker each); ``0``: never.
    """
    if mode == "0":
        return None
    rings = topology(place)
    if rings is None or mode == "1":
        return rings
    local, cross = rings
    return rings if len(local) > 1 and len(cross) > 1 else None


async def allreduce(session: Session, rings: tuple[tuple[int, ...], tuple[int, ...]], src: np.ndarray,
                    buf: np.ndarray, *, op: str, name: str | None, descriptor: Descriptor, chunk_elems: int,
                    timeout_s: float) -> str:
    """Reduces ``src`` into ``buf`` (which may be ``src``) over the three stages; returns the
    call's name (for error messages). ``timeout_s`` bounds the three together."""
    plane = session.plane
    call = plane.numbering.next(name or "", "hier")  # now, before any wait: the same on every rank
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunk_bytes = chunk_elems * buf.dtype.itemsize
    if consecutive(session.place) and session.algorithm != selection.RING and (await algorithms.across_hosts(
            session, rings, buf.nbytes, chunk_bytes=chunk_bytes)).algorithm == selection.RECURSIVE_DOUBLING:
        # Latency, not bytes: the same hops and uplink bytes as one program, in half the frames. Decided
        # by the whole view's link figures: every rank must take this path or none.
        return await algorithms.allreduce(session, routes.by_hosts_of(len(rings[0])), src, buf, op=op,
                                          name=f"{call}:host", descriptor=descriptor, chunk_bytes=chunk_bytes,
                                          timeout_s=max(deadline - loop.time(), 1e-3))
    local, cross = plane.session(rings[0]), plane.session(rings[1])
    world = len(rings[0]) * len(rings[1])
    bounds = segment_bounds(buf.size, local.place.size)
    a, b = bounds[local.place.rank]
    part = buf[a:b]
    # The cross stage runs the algorithm its ring's size and links call for (algorithms.py).
    across = (await algorithms.plan(cross, "allreduce", part.nbytes, chunk_bytes=chunk_bytes,
                                    timeout_s=timeout_s)).algorithm
    step_op = "sum" if op == "average" else op  # the division comes once, at the end

    def reduce_locally() -> tuple[programs.Programs, Values]:
        return (programs.ring_reduce(local.ring, bounds, chunk_elems, gather=False),
                Raw(src, buf, step_op, local.place.size))

    def reduce_across() -> tuple[programs.Programs, Values]:
        if across != selection.RING:
            elems = max(1, algorithms.chunk_of(cross, across, part.nbytes, chunk_bytes) // buf.dtype.itemsize)
            return (algorithms.allreduce_program(across, cross.ring, part.size, elems),
                    PartialRaw(part, part, step_op, cross.place.size, ring=cross.ring))
        wide = ring_chunk_elems(cross, buf.dtype, part.size, chunk_bytes)
        return (programs.ring_reduce(cross.ring, segment_bounds(part.size, cross.place.size), wide, gather=True),
                Raw(part, part, step_op, cross.place.size))

    def gather_locally() -> tuple[programs.Programs, Values]:
        if op == "average":
            finish_into(part, op, world)
        return programs.ring_gather(local.ring, bounds, chunk_elems), Raw(buf, buf, op, local.place.size)

    stages = [(local, "local-reduce", reduce_locally), (cross, "cross", reduce_across), (local, "local-gather", gather_locally)]
    for i, (ring, stage, make) in enumerate(stages):
        where = routes.tagged(descriptor.at_stage(stage), across if stage == "cross" else selection.RING)
        try:
            program, values = make()
            await executor.run(ring, f"{call}:{stage}", where, max(deadline - loop.time(), 1e-3), program, values)
        except MismatchError:
            for later, later_stage, _ in stages[i + 1:]:
                with contextlib.suppress(RingserveError):
                    await refusal.lap(later, f"{call}:{later_stage}",
                                      descriptor.at_stage(later_stage).refused(FAILED_STAGE),
                                      max(deadline - loop.time(), 1e-3))
            raise
    return call

