"""Hierarchical allreduce: within each host, then across hosts one ring per local slice.

With H hosts of L workers each, a flat ring in rank order crosses between hosts on one edge per
host, and each of those edges carries 2(N-1)/N of the tensor, N = H x L; every step waits for it.
Here instead, in three stages over sub-rings of the view (``plane.session(members)``):

1. a reduce-scatter among the L workers of each host (over shared memory where the host allows):
   local position p ends with the host's sum of slice p of L;
2. an allreduce of slice p among the H workers at local position p, one per host: L rings across
   hosts, each carrying 1/L of the tensor, so every host link is busy and each host sends
   2(H-1)/H of the tensor across in all (against 2(N-1)/N). Each of them runs the algorithm that
   RINGSERVE_ALGORITHM and the view's links call for, with the uplink shared by the host's ranks
   (planner.py): over many hosts, a halving-doubling or a tree instead of a ring of 2(H-1) steps;
3. an allgather of the slices among the workers of each host.

Whether a call runs by host, its stages, their algorithms and chunks are the plan's (planner.py);
this module carries them out and decides nothing. Where the stage across hosts would run
recursive doubling over hosts of consecutive ranks, the plan is one program instead
(programs/halving_doubling.host_doubling), numbered as the stages would be.

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

import numpy as np

from ringserve.errors import MismatchError, RingserveError
from ringserve.ring import finish_into, segment_bounds
from ringserve.worker.dataplane import programs, routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import executor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Raw, Values
from ringserve.worker.ops import algorithms, planner, refusal
from ringserve.worker.ops.planner import Plan

FAILED_STAGE = "an earlier stage of this hierarchical allreduce failed"


async def allreduce(session: Session, plan: Plan, src: np.ndarray, buf: np.ndarray, *, op: str, name: str | None,
                    descriptor: Descriptor, timeout_s: float) -> str:
    """Reduces ``src`` into ``buf`` (which may be ``src``) by host, as ``plan`` (planner.py's, by
    host) says: its three stages, or its one program; returns the call's name (for error messages).
    ``timeout_s`` bounds the stages together."""
    plane = session.plane
    call = plane.numbering.next(name or "", "hier")  # now, before any wait: the same on every rank
    assert plan.rings is not None
    if len(plan.stages) == 1:
        # Latency, not bytes: the same hops and uplink bytes as three stages, in half the frames.
        return await algorithms.allreduce(session, plan, src, buf, op=op, name=f"{call}:host", descriptor=descriptor,
                                          timeout_s=timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    rings = {planner.LOCAL: plane.session(plan.rings[0]), planner.CROSS: plane.session(plan.rings[1])}
    local, cross = rings[planner.LOCAL], rings[planner.CROSS]
    world = local.place.size * cross.place.size
    bounds = segment_bounds(buf.size, local.place.size)
    a, b = bounds[local.place.rank]
    part = buf[a:b]
    step_op = "sum" if op == "average" else op  # the division comes once, at the end

    def reduce_locally(chunk: int) -> tuple[programs.Programs, Values]:
        return (programs.ring_reduce(local.ring, bounds, chunk, gather=False),
                Raw(src, buf, step_op, local.place.size))

    def reduce_across(chunk: int) -> tuple[programs.Programs, Values]:
        values = algorithms.reduction(across, cross.ring, part, part, step_op, cross.place.size, None, None)
        return algorithms.allreduce_program(across, cross.ring, part.size, chunk), values

    def gather_locally(chunk: int) -> tuple[programs.Programs, Values]:
        if op == "average":
            finish_into(part, op, world)
        return programs.ring_gather(local.ring, bounds, chunk), Raw(buf, buf, op, local.place.size)

    across = plan.stages[1].algorithm
    makers = {planner.LOCAL_REDUCE: reduce_locally, planner.ACROSS: reduce_across, planner.LOCAL_GATHER: gather_locally}
    for i, stage in enumerate(plan.stages):
        ring = rings[stage.ring]
        where = routes.tagged(descriptor.at_stage(stage.name), stage.algorithm)
        try:
            program, values = makers[stage.name](stage.chunk_elems)
            await executor.run(ring, f"{call}:{stage.name}", where, max(deadline - loop.time(), 1e-3), program, values)
        except MismatchError:
            for later in plan.stages[i + 1:]:
                with contextlib.suppress(RingserveError):
                    await refusal.lap(rings[later.ring], f"{call}:{later.name}",
                                      descriptor.at_stage(later.name).refused(FAILED_STAGE),
                                      max(deadline - loop.time(), 1e-3))
            raise
    return call
