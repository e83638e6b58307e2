"""A plan carried out: the figures it is made by, the program of each stage, the executor's run.

collectives.py asks ``plan`` for the plan of a call (planner.py: the ring unless
RINGSERVE_ALGORITHM and the cost model say otherwise) and hands it to the runner of its op here
(or to hierarchy.py, by host), which builds the program the plan names (programs/), the values
its steps act on (values.py, partials.py) and runs them (programs/executor.py). Nothing here
chooses: a plan is a pure function of the call, the ring and the link figures
(dataplane/calibration.py, agreed once per view and ring), so every rank of the ring makes the
same plan without a word, and its descriptor names the algorithm (routes.py): ranks that
disagree fail with MismatchError. Measured figures enter by their class only (``figures``:
selection.planned), so that two runs of one job plan alike. Process sets run under it as the
whole view does: a sub-ring measures its own links and plans by its own size and hosts.
"""

from __future__ import annotations

import numpy as np

from ringserve import selection, topology
from ringserve.codecs import Codec
from ringserve.ring import segment_bounds
from ringserve.selection import LinkCosts
from ringserve.worker.dataplane import programs, routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.partials import PartialCoded, PartialRaw
from ringserve.worker.dataplane.programs import Programs, Ring, executor, halving_doubling, ring2d, trees
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Blocks, Raw
from ringserve.worker.ops import planner
from ringserve.worker.ops.arguments import reduction_values
from ringserve.worker.ops.planner import Call, Plan


async def figures(session: Session) -> LinkCosts:
    """The link figures the session's ring plans by: given ones as they are, measured ones (measured
    first if nobody has in this view) as their class's, by the ring's hosts (selection.planned).
    Alike on every rank of the ring: the measured figures are agreed, the hosts are the view's."""
    links = await session.plane.measures.links(session)
    return selection.planned(links, hosts=session.place.hosts, n=session.place.size)


def ground(session: Session) -> planner.Ground:
    """The session's ring as the planner sees it."""
    place = session.place
    return planner.Ground(place.size, place.rank, place.hosts, session.algorithm, session.hierarchical,
                          session.plane.scale)


async def plan(session: Session, call: Call, chunk_bytes: int) -> Plan:
    """The plan of ``call`` over the session's ring (planner.plan). Measures the ring's links first
    where the setting plans by them and nobody has in this view (dataplane/calibration.py)."""
    where = ground(session)
    links = await figures(session) if where.needs_figures else None
    return planner.plan(call, where, links, chunk_bytes)


def forced(session: Session, algorithm: str, call: Call, chunk_bytes: int) -> Plan:
    """The plan of ``call`` by ``algorithm``, as the others run it, for a rank that stands in (join.py)."""
    return planner.flat(algorithm, call, ground(session), chunk_bytes)


def allreduce_program(algorithm: str, ring: Ring, total: int, chunk_elems: int) -> Programs:
    """The program of an allreduce of ``total`` elements under ``algorithm`` (by host in one
    program: ``host_doubling/<ranks per host>``, routes.by_hosts_of).

    Raises:
        ValueError: no program by that name (or a 2D ring over a prime number of ranks).
    """
    if algorithm == selection.RING:
        return programs.ring_reduce(ring, segment_bounds(total, ring.size), chunk_elems, gather=True)
    if algorithm == selection.HALVING_DOUBLING:
        blocks = segment_bounds(total, topology.power_below(ring.size))
        return halving_doubling.halving_doubling(ring, blocks, chunk_elems)
    if algorithm == selection.RECURSIVE_DOUBLING:
        return halving_doubling.recursive_doubling(ring, total, chunk_elems)
    if algorithm == selection.TREE:
        return trees.tree_allreduce(ring, total, chunk_elems)
    if algorithm == selection.RING2D:
        return ring2d.ring2d_allreduce(ring, total, chunk_elems)
    name, _, local = algorithm.partition("/")
    if name == selection.HOST_DOUBLING and local.isdigit():
        return halving_doubling.host_doubling(ring, int(local), total, chunk_elems)
    raise ValueError(f"No allreduce program is called {algorithm!r}.")


def reduction(algorithm: str, ring: Ring, src: np.ndarray, buf: np.ndarray, op: str, world: int,
              coder: Codec | None, residual: np.ndarray | None) -> Raw:
    """How the values of a reduction by ``algorithm`` travel: a ring's as they are or encoded
    (values.py), any other's as partial sums, as they are or encoded (partials.py)."""
    if algorithm == selection.RING:
        return reduction_values(src, buf, op, world, coder, residual)
    if coder is None:
        return PartialRaw(src, buf, op, world, ring=ring)
    return PartialCoded(src, buf, op, world, ring=ring, key="", codec=coder, residual=residual)


async def allreduce(session: Session, plan: Plan, src: np.ndarray, buf: np.ndarray, *, op: str, name: str | None,
                    descriptor: Descriptor, timeout_s: float, coder: Codec | None = None,
                    residual: np.ndarray | None = None, key: str | None = None) -> str:
    """Reduces ``src`` into ``buf`` (which may be ``src``) as the plan of one stage says; returns the key.

    ``descriptor`` is the call's, without the algorithm (it is added here); ``key``: the others'
    key, for a rank that stands in (join.py).
    """
    stage = plan.stage
    values = reduction(stage.algorithm, session.ring, src, buf, op, session.place.size, coder, residual)
    program = allreduce_program(stage.algorithm, session.ring, buf.size, stage.chunk_elems)
    return await executor.run(session, name, routes.tagged(descriptor, stage.algorithm), timeout_s, program, values,
                              key=key)


async def reduce_scatter(session: Session, plan: Plan, src: np.ndarray, buf: np.ndarray,
                         bounds: list[tuple[int, int]], *, op: str, name: str | None, descriptor: Descriptor,
                         timeout_s: float, coder: Codec | None = None) -> str:
    """Reduce-scatter as the plan says (a ring's, or halving over a power-of-two ring): position p
    ends with ``bounds[p]``."""
    stage = plan.stage
    values = reduction(stage.algorithm, session.ring, src, buf, op, session.place.size, coder, None)
    if stage.algorithm == selection.RING:
        program = programs.ring_reduce(session.ring, bounds, stage.chunk_elems, gather=False)
    else:
        program = halving_doubling.halving_doubling(session.ring, bounds, stage.chunk_elems, gather=False)
    return await executor.run(session, name, routes.tagged(descriptor, stage.algorithm), timeout_s, program, values)


async def allgather_blocks(session: Session, plan: Plan, values: Blocks, total: int, *, name: str | None,
                           descriptor: Descriptor, timeout_s: float) -> str:
    """Allgather of blocks whose sizes differ by position, as the plan says (a ring's, or
    doubling over a power-of-two ring); ``total``: this rank's block's size."""
    stage = plan.stage
    if stage.algorithm == selection.RING:
        program = programs.allgather_blocks(session.ring, total, stage.chunk_elems)
    else:
        program = halving_doubling.allgather_doubling(session.ring, total, stage.chunk_elems)
    return await executor.run(session, name, routes.tagged(descriptor, stage.algorithm), timeout_s, program, values)


async def broadcast(session: Session, plan: Plan, values: Blocks, root: int, total: int, *, name: str | None,
                    descriptor: Descriptor, timeout_s: float) -> str:
    """Broadcast of block ``root`` as the plan says: down the chain, or down the binary tree rooted
    there, acknowledged and committed."""
    stage = plan.stage
    if stage.algorithm == selection.RING:
        program = programs.broadcast_chain(session.ring, root, total, stage.chunk_elems)
        return await executor.run(session, name, descriptor, timeout_s, program, values)
    program = trees.tree_broadcast(session.ring, root, total, stage.chunk_elems)
    return await executor.run(session, name, routes.tagged(descriptor, routes.rooted(root)), timeout_s,
                              program, values)
