"""Collectives under the algorithm selection.py picks: the plan, the program, the values.

collectives.py asks ``plan`` which algorithm a call runs (the ring unless RINGSERVE_ALGORITHM and
the cost model say otherwise), and runs anything but the ring here. The plan is a pure function of
the setting, the call (op, bytes on the wire, codec), the ring's size and its link figures
(dataplane/calibration.py, agreed once per view and ring), so every rank of the ring makes the same plan
without a word, and its descriptor names the algorithm (routes.py): ranks that disagree fail
with MismatchError. Measured figures enter by their class only (``figures``: selection.planned),
so that two runs of one job plan alike. Process sets run under it as the whole view does: a
sub-ring measures its own links and plans by its own size and hosts.
"""

from __future__ import annotations

import numpy as np

from ringserve import selection, topology
from ringserve.codecs import Codec
from ringserve.ring import segment_bounds
from ringserve.selection import LinkCosts, Plan
from ringserve.worker.dataplane import routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.partials import PartialCoded, PartialRaw
from ringserve.worker.dataplane.programs import Programs, Ring, executor, halving_doubling, ring2d, trees
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Blocks, Raw


async def figures(session: Session) -> LinkCosts:
    """The link figures the session's ring plans by: given ones as they are, measured ones (measured
    first if nobody has in this view) as their class's, by the ring's hosts (selection.planned).
    Alike on every rank of the ring: the measured figures are agreed, the hosts are the view's."""
    links = await session.plane.measures.links(session)
    return selection.planned(links, hosts=session.place.hosts, n=session.place.size)


async def plan(session: Session, op: str, nbytes: int, *, chunk_bytes: int, timeout_s: float,
               coded: bool = False) -> Plan:
    """The plan of one call of ``op`` moving ``nbytes`` (on the wire) over the session's ring.

    Measures the ring's links first if nobody has in this view (dataplane/calibration.py).
    """
    setting, n = session.algorithm, session.place.size
    if setting == selection.RING or n <= 1:
        return Plan(selection.RING, chunk_bytes, 0.0)
    links = await figures(session)
    scale = session.plane.scale
    return selection.choose(setting, op, nbytes * scale, n, links, chunk_bytes * scale, coded=coded)


async def by_host(session: Session, rings: tuple[tuple[int, ...], tuple[int, ...]], nbytes: int, *,
                  chunk_bytes: int) -> bool:
    """Whether an allreduce of ``nbytes`` runs by host over ``rings`` (hierarchy.chosen's), or flat:
    by host always unless both RINGSERVE_ALGORITHM and RINGSERVE_HIERARCHICAL are ``auto``; then
    where the cost model says it pays (selection.by_host), by the whole ring's link figures, alike
    on every rank."""
    if session.algorithm != selection.AUTO or session.hierarchical != "auto":
        return True
    links = await figures(session)
    scale = session.plane.scale
    return selection.by_host(nbytes * scale, len(rings[0]), len(rings[1]), links, chunk_bytes * scale)


async def across_hosts(session: Session, rings: tuple[tuple[int, ...], tuple[int, ...]], nbytes: int, *,
                       chunk_bytes: int) -> Plan:
    """The plan of the stage across hosts of an allreduce of ``nbytes`` by host over ``rings``
    (hierarchy.chosen's), by the whole ring's link figures: alike on every rank of the view, where
    each ring across hosts measures its own links and may plan otherwise (selection.across_hosts)."""
    links = await figures(session)
    scale = session.plane.scale
    return selection.across_hosts(session.algorithm, nbytes * scale, len(rings[0]), len(rings[1]), links,
                                  chunk_bytes * scale)


async def flat_plan(session: Session, rings: tuple[tuple[int, ...], tuple[int, ...]], nbytes: int, *,
                    chunk_bytes: int) -> Plan:
    """The plan of an allreduce of ``nbytes`` that runs flat over a view of hosts (``rings``,
    hierarchy.chosen's) because by_host said so: selection.flat_plan, alike on every rank."""
    links = await figures(session)
    scale = session.plane.scale
    return selection.flat_plan(nbytes * scale, len(rings[0]), len(rings[1]), links, chunk_bytes * scale)


def chunk_of(session: Session, algorithm: str, nbytes: int, chunk_bytes: int) -> int:
    """The chunk an allreduce of ``nbytes`` runs in over the session's ring: a tree's own
    (selection.tree_chunk), else ``chunk_bytes``."""
    if algorithm != selection.TREE:
        return chunk_bytes
    scale = session.plane.scale
    return max(1, selection.tree_chunk(nbytes * scale, session.place.size, chunk_bytes * scale) // scale)


def allreduce_program(algorithm: str, ring: Ring, total: int, chunk_elems: int) -> Programs:
    """The program of an allreduce of ``total`` elements under ``algorithm`` (not the ring's; by
    host, ``host_doubling/<ranks per host>``: routes.by_hosts_of).

    Raises:
        ValueError: no program by that name (or a 2D ring over a prime number of ranks).
    """
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


def partial_values(ring: Ring, src: np.ndarray, buf: np.ndarray, op: str, world: int,
                   coder: Codec | None, residual: np.ndarray | None) -> Raw:
    """How the values of a reduction that is not a ring's travel: as they are, or encoded."""
    if coder is None:
        return PartialRaw(src, buf, op, world, ring=ring)
    return PartialCoded(src, buf, op, world, ring=ring, key="", codec=coder, residual=residual)


async def allreduce(session: Session, algorithm: str, src: np.ndarray, buf: np.ndarray, *, op: str,
                    name: str | None, descriptor: Descriptor, chunk_bytes: int, timeout_s: float,
                    coder: Codec | None = None, residual: np.ndarray | None = None, key: str | None = None) -> str:
    """Reduces ``src`` into ``buf`` (which may be ``src``) under ``algorithm``; returns the key.

    ``descriptor`` is the call's, without the algorithm (it is added here); ``key``: the others'
    key, for a rank that stands in (join.py).
    """
    ring, world = session.ring, session.place.size
    nbytes = coder.encoded_bytes(buf.size) if coder is not None else buf.nbytes
    elems = max(1, chunk_of(session, algorithm, nbytes, chunk_bytes) // buf.dtype.itemsize)
    values = partial_values(ring, src, buf, op, world, coder, residual)
    program = allreduce_program(algorithm, ring, buf.size, elems)
    return await executor.run(session, name, routes.tagged(descriptor, algorithm), timeout_s, program, values,
                              key=key)


async def reduce_scatter(session: Session, src: np.ndarray, buf: np.ndarray, bounds: list[tuple[int, int]], *,
                         op: str, name: str | None, descriptor: Descriptor, chunk_elems: int, timeout_s: float,
                         coder: Codec | None = None) -> str:
    """Reduce-scatter by halving over a power-of-two ring: position p ends with ``bounds[p]``."""
    values = partial_values(session.ring, src, buf, op, session.place.size, coder, None)
    program = halving_doubling.halving_doubling(session.ring, bounds, chunk_elems, gather=False)
    return await executor.run(session, name, routes.tagged(descriptor, selection.HALVING_DOUBLING), timeout_s,
                              program, values)


async def allgather_blocks(session: Session, values: Blocks, total: int, *, name: str | None, descriptor: Descriptor,
                           chunk_elems: int, timeout_s: float) -> str:
    """Allgather by doubling over a power-of-two ring, of blocks whose sizes differ by position."""
    program = halving_doubling.allgather_doubling(session.ring, total, chunk_elems)
    return await executor.run(session, name, routes.tagged(descriptor, selection.HALVING_DOUBLING), timeout_s,
                              program, values)


async def broadcast(session: Session, values: Blocks, root: int, total: int, *, name: str | None, descriptor: Descriptor,
                    chunk_elems: int, timeout_s: float) -> str:
    """Broadcast of block ``root`` down the binary tree rooted there, acknowledged and committed."""
    program = trees.tree_broadcast(session.ring, root, total, chunk_elems)
    return await executor.run(session, name, routes.tagged(descriptor, routes.rooted(root)), timeout_s,
                              program, values)
