"""A ring of simulated ranks in one event loop: the shipped collectives over in-memory links.

Each rank is a real ``Plane`` whose links to the ranks it sends to are ``MemoryLink``s, so a
collective runs exactly the code that ships: its program (programs/__init__.py), the executor, the values,
the session and the plane's routing and abort protocol, and the link's encoding, lane and
backpressure. Only the socket is missing. Collectives over sub-rings of the view run too
(``simulate_rings``), concurrently with the whole view's, as process sets would. Each link delays
each frame by a seeded random number of loop turns, has a random window (down to one frame), and
each rank starts after a random delay, so one seed is one interleaving of the ranks, and a test
runs many.

``simulate`` fails (AssertionError) when a rank's collective fails, when the ring hangs, and when
any frame was sent that no rank used: a frame left in a finished collective's inbox, or one that
arrived after its collective had finished.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ringserve._proto import peer_pb2
from ringserve.errors import RingChangedError
from ringserve.observe import Counters
from ringserve.selection import LinkCosts
from ringserve.testing.memlink import MemoryLink
from ringserve.worker.dataplane.lanes.tcp.inbound import InboundLane, LaneBuffers
from ringserve.worker.dataplane.lanes.tcp.outbound import OutboundLane
from ringserve.worker.dataplane.lanes.tcp.server import LaneServer
from ringserve.worker.dataplane.links.shared import OutboundRing
from ringserve.worker.dataplane.links.stream import SEND_WINDOW
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.session import Place, Session

Call = Callable[[Session, int], Awaitable[Any]]

WINDOWS = (1, 2, 3, SEND_WINDOW)
DELAYS = (0, 1, 3, 8)


def make_ring(world: int, rng: random.Random, *, checksum: bool = False, lanes: bool = False,
              lane_slots: int = 2, slot_bytes: int = 64, abort_grace_s: float = 1.0, algorithm: str = "ring",
              links: LinkCosts | None = None, tcp_lanes: list[LaneServer] | None = None) -> list[Plane]:
    """``world`` planes of view 1; each opens a MemoryLink to any rank it sends to (its successor
    at once, others on first use), each link with its own random delays and window. ``algorithm``
    (RINGSERVE_ALGORITHM) and ``links`` (the link figures, None: measured) are the planes'.

    ``tcp_lanes`` (a list, which gets one LaneServer per rank, on 127.0.0.1): every link also has a
    real TCP payload lane, which its frames take once attached (the rest, on the delayed link)."""
    planes: list[Plane] = []
    addresses = tuple(f"sim-{r}" for r in range(world))
    buffers = LaneBuffers(1 << 20)

    def dial(offer: peer_pb2.PayloadLane, peer: Plane, sender: int) -> InboundLane:
        return InboundLane(host="127.0.0.1", port=offer.port, token=offer.token, context=None, server_name="",
                           timeout_s=5.0, buffers=buffers, max_bytes=1 << 20, fell_back=_lane_failed,
                           attached_late=lambda: None, on_frame=lambda frame: peer.on_frame(frame, sender),
                           on_broken=lambda exc: peer.starve((sender,), exc))

    def connect(r: int, counters: Counters, to: int) -> MemoryLink:
        lane = OutboundRing(lane_slots, slot_bytes) if lanes else None
        tcp = None
        if tcp_lanes is not None:
            server = tcp_lanes[r]
            tcp = OutboundLane(counters, port=server.port, tls=False, withdraw=server.withdraw)
            server.offer(tcp)
        return MemoryLink(lambda: planes[to], counters, rng=random.Random(rng.random()),
                          max_delay=rng.choice(DELAYS), window=rng.choice(WINDOWS), lane=lane, tcp=tcp,
                          dial=dial if tcp_lanes is not None else None)

    for r in range(world):
        counters = Counters()
        place = Place(view_id=1, rank=r, size=world, addresses=addresses)
        planes.append(Plane(place, counters, abort_grace_s, checksum=checksum, algorithm=algorithm, links=links,
                            connect=lambda to, r=r, counters=counters: connect(r, counters, to)))
    return planes


def _lane_failed(why: str) -> None:
    raise AssertionError(f"a simulated TCP payload lane did not attach: {why}")


async def simulate(world: int, call: Call, *, seed: int, timeout_s: float = 20.0, aborts: bool = False,
                   tcp: bool = False, **ring: Any) -> list[Any]:
    """Runs ``call(session, rank)`` on every rank of a simulated ring; returns the ranks' results.

    ``session`` spans the whole view; a call may run collectives over sub-rings too, on
    ``session.plane.session(members)`` (see ``simulate_rings``). ``aborts``: the call expects
    collectives to be aborted (and catches their errors), so frames that arrive after their
    collective failed are no fault.
    """
    rng = random.Random(seed)
    servers: list[LaneServer] = []
    if tcp:
        servers += [LaneServer("127.0.0.1", 0, context=None, hello_timeout_s=5.0, cap=16, counters=Counters(),
                               tag=lambda: "simulated rank") for _ in range(world)]
        ring["tcp_lanes"] = servers
    planes = make_ring(world, rng, **ring)

    async def rank(r: int) -> Any:
        for _ in range(rng.randint(0, 5)):
            await asyncio.sleep(0)
        return await call(planes[r].session(), r)

    try:
        async with asyncio.timeout(timeout_s):
            # A TaskGroup: when one rank fails, the others are cancelled, not left running.
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(rank(r)) for r in range(world)]
    except TimeoutError:
        raise AssertionError(f"the simulated ring of {world} hung (seed {seed})") from None
    except BaseExceptionGroup as group_error:
        raise group_error.exceptions[0] from None  # the first rank's failure, as a rank would see it
    finally:
        await shut(planes)
        for server in servers:
            await server.close()
    results = [t.result() for t in tasks]
    for r, p in enumerate(planes):
        assert not p._inboxes, f"rank {r} holds frames of collectives nobody opened: {sorted(p._inboxes)}"
        assert p.unused == 0, f"rank {r} never took {p.unused} frame(s) that reached its collectives"
        assert aborts or p.counters.frames_rejected == 0, (
            f"rank {r} got {p.counters.frames_rejected} frame(s) after their collective had finished")
    return list(results)


Rings = Mapping[tuple[int, ...] | None, Call]


async def simulate_rings(world: int, rings: Rings, *, seed: int, timeout_s: float = 20.0,
                         **ring: Any) -> dict[tuple[int, ...] | None, list[Any]]:
    """Runs several rings of one simulated view at once: for each ``members`` (None: the whole
    view), ``call(session, position)`` on every member, over that sub-ring, concurrently with the
    other rings' calls on the same ranks. Returns each ring's results in ring order.

    Every rank runs its rings' calls concurrently, each started after its own random delay, so
    the frames of several collectives share links and inbound streams under random interleavings.
    """
    order = list(rings)

    async def call(session: Session, rank: int) -> dict[int, Any]:
        async def one(i: int, members: tuple[int, ...] | None) -> Any:
            for _ in range(random.Random(seed * 1000 + rank * 31 + i).randint(0, 8)):
                await asyncio.sleep(0)
            sub = session if members is None else session.plane.session(members)
            return await rings[members](sub, sub.place.rank)

        mine = [(i, m) for i, m in enumerate(order) if m is None or rank in m]
        outs = await asyncio.gather(*(one(i, m) for i, m in mine))
        return {i: out for (i, _), out in zip(mine, outs, strict=True)}

    per_rank = await simulate(world, call, seed=seed, timeout_s=timeout_s, **ring)
    results: dict[tuple[int, ...] | None, list[Any]] = {}
    for i, members in enumerate(order):
        ranks = range(world) if members is None else members
        results[members] = [per_rank[r][i] for r in ranks]
    return results


async def shut(planes: list[Plane]) -> None:
    """Ends every link cleanly (every frame sent is delivered first), then closes the planes."""
    for p in planes:
        p.retire(RingChangedError(1, 2, "the simulation is over"))
    try:
        async with asyncio.timeout(5):
            for p in planes:
                await p.wait_closed()
    finally:
        for p in planes:
            p.close(RingChangedError(1, 2, "the simulation is over"))
