"""A network in virtual time, for simulating the shipped collectives at up to thousands of ranks.

Every rank is a real ``Plane`` (the data plane that ships: programs, executor, values, routing,
aborts, the measure of the links), and its links are ``TimedLink``s: in-memory links, like
ringserve/testing/memlink.py's, that deliver each frame when the alpha-beta model says it arrives. Run under
vclock.py's loop, a collective's time is the model's, whatever the machine.

The model (``Model``), per frame of ``b`` bytes from rank s to rank d:

- between hosts, the sender's host sends its frames one after the other at ``bytes_per_s`` (its
  uplink, shared by the ranks on it), each is on the way ``latency_s``, and the receiver's host
  takes them in one after the other at ``bytes_per_s`` (its downlink): a frame arrives at
  ``max(sent + latency, downlink free + b / bytes_per_s)``;
- within a host (``hosts`` puts several ranks on one), ``local_latency_s`` and
  ``local_bytes_per_s`` per rank, as shared memory would give;
- a link takes its next frame only once the last has left (a socket's send buffer), so the
  executor's backpressure works as over TCP.

Bytes are the frames' encoded bytes, header included. With ``scale`` > 1 each payload byte stands
for ``scale`` bytes (the header counts once), so that 64 MiB over 1,024 ranks fits in memory: the
programs move 1/scale of the elements, in chunks 1/scale the size, and the planes choose their
algorithms for the virtual sizes (Plane.scale).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringserve import wire
from ringserve.errors import ProtocolError, RingChangedError
from ringserve.observe import Counters
from ringserve.selection import LinkCosts
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.links.stream import SEND_WINDOW, Link
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.dataplane.session import Session

Call = Callable[[Session, int], Awaitable[Any]]


@dataclass(frozen=True)
class Model:
    """The network: ``latency_s`` one way and ``bytes_per_s`` per host link, between hosts."""

    latency_s: float
    bytes_per_s: float
    hosts: tuple[int, ...] = ()  # each rank's host; empty: every rank on a host of its own
    local_latency_s: float = 5e-6
    local_bytes_per_s: float = 10e9
    scale: int = 1

    def host(self, rank: int) -> int:
        return self.hosts[rank] if self.hosts else rank

    def links(self) -> LinkCosts:
        """The figures of the links between hosts, as a plane that is told them holds them."""
        return LinkCosts.of(self.latency_s, self.bytes_per_s)


@dataclass
class Network:
    """The state of the model's links: when each host's uplink and downlink are free, and the
    (virtual) bytes each rank sent."""

    model: Model
    world: int
    sent: list[int] = field(default_factory=list)
    _up: dict[int, float] = field(default_factory=dict)
    _down: dict[int, float] = field(default_factory=dict)
    _local: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sent = [0] * self.world

    def send(self, src: int, dst: int, nbytes: int, now: float) -> tuple[float, float]:
        """(when the frame has left the sender, when it has arrived) for a frame sent ``now``."""
        m = self.model
        self.sent[src] += nbytes
        hs, hd = m.host(src), m.host(dst)
        if hs == hd:
            left = max(now, self._local.get(src, 0.0)) + nbytes / m.local_bytes_per_s
            self._local[src] = left
            return left, left + m.local_latency_s
        left = max(now, self._up.get(hs, 0.0)) + nbytes / m.bytes_per_s
        self._up[hs] = left
        arrives = max(left + m.latency_s, self._down.get(hd, 0.0) + nbytes / m.bytes_per_s)
        self._down[hd] = arrives
        return left, arrives

    def reset(self) -> None:
        """Forgets the bytes sent so far (the links' queues stay as they are)."""
        self.sent = [0] * self.world


class TimedLink(Link):
    """A link to ``peer()``, a Plane of the same loop, whose frames arrive when ``network`` says."""

    def __init__(self, peer: Callable[[], Plane], counters: Counters, network: Network, src: int, dst: int, *,
                 window: int = SEND_WINDOW) -> None:
        super().__init__(counters, window=window)
        self._peer = peer
        self._network = network
        self._src, self._dst = src, dst
        self._pending: deque[Received] = deque()
        self._drained: asyncio.Future[None] | None = None
        self._refused: ProtocolError | None = None

    async def _run(self, hello: wire.FrameHeader) -> None:
        peer, sender = self._peer(), hello.sender_rank
        try:
            peer.accept(hello)
        except ProtocolError as exc:
            self._fail(exc)
            return
        loop = asyncio.get_running_loop()
        scale = self._network.model.scale
        clean = False
        try:
            while (raw := await self._next()) is not None and self._refused is None:
                header, payload = wire.decode(raw)
                nbytes = len(raw) + (scale - 1) * payload.nbytes
                left, arrives = self._network.send(self._src, self._dst, nbytes, loop.time())
                self._pending.append(Received(header, payload, raw))
                loop.call_at(arrives, self._deliver, peer, sender)
                if left > loop.time():
                    await asyncio.sleep(left - loop.time())
            if self._pending:
                self._drained = loop.create_future()
                await self._drained
            if self._refused is not None:
                self._fail(self._refused)
            else:
                clean = True
        finally:
            peer.stream_ended(sender, clean)

    def _deliver(self, peer: Plane, sender: int) -> None:
        frame = self._pending.popleft()
        if self._refused is None:
            try:
                peer.on_frame(frame, sender)
            except ProtocolError as exc:
                self._refused = exc
                self._wake_pump()
        if not self._pending and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


@dataclass
class Outcome:
    """What a simulated collective did: each rank's result, when the last rank finished (seconds
    after they all started), each rank's finish time, and the (virtual) bytes each rank sent."""

    results: list[Any]
    seconds: float
    finished: list[float]
    sent: list[int]
    links: LinkCosts | None


def make_view(world: int, model: Model, *, algorithm: str = "auto", links: LinkCosts | None = None,
              abort_grace_s: float = 1.0, checksum: bool = False) -> tuple[list[Plane], Network]:
    """``world`` planes of view 1 linked by ``model``'s network."""
    network = Network(model, world)
    planes: list[Plane] = []
    addresses = tuple(f"sim-{r}" for r in range(world))
    hosts = tuple(model.host(r) for r in range(world))
    for r in range(world):
        counters = Counters()
        place = Place(view_id=1, rank=r, size=world, addresses=addresses, hosts=hosts)

        def connect(to: int, r: int = r, counters: Counters = counters) -> TimedLink:
            return TimedLink(lambda: planes[to], counters, network, r, to)

        planes.append(Plane(place, counters, abort_grace_s, connect=connect, checksum=checksum, algorithm=algorithm,
                            links=links, measure_timeout_s=1e6, scale=model.scale))
    return planes, network


async def simulate(world: int, call: Call, model: Model, *, algorithm: str = "auto", links: LinkCosts | None = None,
                   timeout_s: float = 1e6, seed: int = 0, check: bool = True, members: Sequence[int] | None = None,
                   **view: Any) -> Outcome:
    """Runs ``call(session, rank)`` on every rank at once, over ``model``'s network, on the running
    (virtual-time) loop.

    First, where the algorithm is chosen by measured links (``auto`` and no ``links``), every rank
    measures them (calibration.py), and only then do all start ``call`` at the same moment: the
    time and bytes reported are the call's alone. ``members``: run it on the sub-ring of these
    ranks (a process set) instead of the whole view. ``check``: fail (AssertionError) if any
    frame reached a collective that never took it.
    """
    planes, network = make_view(world, model, algorithm=algorithm, links=links, **view)
    ranks = list(range(world)) if members is None else list(members)
    sessions = {r: planes[r].session(None if members is None else tuple(members)) for r in ranks}
    measured: list[LinkCosts | None] = [None]
    ready = asyncio.Event()
    waiting = [len(ranks)]
    start = [0.0]
    rng = random.Random(seed)
    delays = {r: rng.random() * 1e-6 for r in ranks}

    async def rank(r: int) -> tuple[Any, float]:
        session = sessions[r]
        if algorithm != "ring" and links is None and len(ranks) > 1:
            measured[0] = await planes[r].measures.links(session)
        waiting[0] -= 1
        if waiting[0] == 0:
            network.reset()
            start[0] = asyncio.get_running_loop().time()
            ready.set()
        await ready.wait()
        await asyncio.sleep(delays[r])  # a random order among ranks that start at once
        out = await call(session, session.place.rank)
        return out, asyncio.get_running_loop().time()

    try:
        async with asyncio.timeout(timeout_s), asyncio.TaskGroup() as group:
            tasks = [group.create_task(rank(r)) for r in ranks]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    finally:
        await shut(planes)
    done = [t.result() for t in tasks]
    finished = [when - start[0] for _, when in done]
    if check:
        for r, p in enumerate(planes):
            assert p.unused == 0, f"rank {r} never took {p.unused} frame(s) that reached its collectives"
            assert not p._inboxes, f"rank {r} holds frames of collectives nobody opened: {sorted(p._inboxes)}"
    return Outcome([out for out, _ in done], max(finished), finished, list(network.sent), measured[0])


async def shut(planes: list[Plane]) -> None:
    """Ends every link cleanly (every frame sent is delivered first), then closes the planes."""
    for p in planes:
        p.retire(RingChangedError(1, 2, "the simulation is over"))
    try:
        async with asyncio.timeout(1e6):
            for p in planes:
                await p.wait_closed()
    finally:
        for p in planes:
            p.close(RingChangedError(1, 2, "the simulation is over"))
