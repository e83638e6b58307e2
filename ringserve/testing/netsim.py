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
  executor's backpressure works as over TCP;
- with ``cpu`` (``Cpu``), the ranks are processes of one machine of ``cores`` cores: each frame
  costs its sender ``frame_s + b * byte_s`` of CPU before it leaves and its receiver as much
  before it is taken, each rank runs on one core at a time, and the work of all ranks queues, in
  the order it is asked for, for the first free core (``Network.compute``; a call adds its own
  work, outside the links', by ``Network.work``). A frame's work on each side is ``handoffs``
  parts, each queued once the last is done: a frame that passes from one thread to another
  (a lane's, the loop's) waits for a core at each. Without it (the default) CPU is free, as the
  alpha-beta model has it. Where many ranks share few cores, the CPU, not the links, is what a
  collective waits for (benchmarks/scale_sim.py: the scale harness's workers on 2 cores).

Bytes are the frames' encoded bytes, header included. With ``scale`` > 1 each payload byte stands
for ``scale`` bytes (the header counts once), so that 64 MiB over 1,024 ranks fits in memory: the
programs move 1/scale of the elements, in chunks 1/scale the size, and the planes choose their
algorithms for the virtual sizes (Plane.scale).
"""

from __future__ import annotations

import asyncio
import heapq
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
class Cpu:
    """The machine every rank runs on: ``cores`` cores shared by all ranks; each frame a rank sends
    or takes costs it ``frame_s`` of CPU, plus ``byte_s`` a (virtual) byte of it."""

    cores: int
    frame_s: float
    byte_s: float
    handoffs: int = 1  # the parts of a frame's work on one side, each queued for a core in turn

    def __post_init__(self) -> None:
        if self.cores < 1:
            raise ValueError(f"The number of cores ({self.cores}) must be at least one.")
        if self.handoffs < 1:
            raise ValueError(f"A frame's work is done in at least one part, not {self.handoffs}.")
        if self.frame_s < 0 or self.byte_s < 0:
            raise ValueError(f"A frame's CPU ({self.frame_s} s, {self.byte_s} s a byte) cannot be negative.")

    def frame(self, nbytes: int) -> float:
        """The CPU seconds a frame of ``nbytes`` costs its sender, and again its receiver."""
        return self.frame_s + nbytes * self.byte_s


@dataclass(frozen=True)
class Model:
    """The network: ``latency_s`` one way and ``bytes_per_s`` per host link, between hosts; with
    ``cpu``, the machine's cores that every rank's work shares (None: CPU is free)."""

    latency_s: float
    bytes_per_s: float
    hosts: tuple[int, ...] = ()  # each rank's host; empty: every rank on a host of its own
    local_latency_s: float = 5e-6
    local_bytes_per_s: float = 10e9
    scale: int = 1
    cpu: Cpu | None = None

    def host(self, rank: int) -> int:
        return self.hosts[rank] if self.hosts else rank

    def links(self) -> LinkCosts:
        """The figures of the links between hosts, as a plane that is told them holds them."""
        return LinkCosts.of(self.latency_s, self.bytes_per_s)


@dataclass
class Network:
    """The state of the model's links and cores: when each host's uplink and downlink are free,
    when each core and each rank is, the (virtual) bytes each rank sent, and, per rank, the CPU
    seconds it used and the frames and (virtual) bytes it sent or took."""

    model: Model
    world: int
    sent: list[int] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    frames: list[int] = field(default_factory=list)
    handled: list[int] = field(default_factory=list)
    _up: dict[int, float] = field(default_factory=dict)
    _down: dict[int, float] = field(default_factory=dict)
    _local: dict[int, float] = field(default_factory=dict)
    _cores: list[float] = field(default_factory=list)  # a heap of the times each core is free
    _ranks: dict[int, float] = field(default_factory=dict)  # when each rank's last work is done

    def __post_init__(self) -> None:
        self.reset()
        self._cores = [0.0] * (self.model.cpu.cores if self.model.cpu is not None else 0)

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

    def compute(self, rank: int, seconds: float, now: float) -> float:
        """When ``seconds`` of ``rank``'s CPU, asked for ``now``, are done: once the rank's earlier
        work is (a process runs on one core at a time), on the core free first (Cpu.cores)."""
        if not self._cores:
            raise ValueError("The model has no cores (Model.cpu is None): its CPU is free.")
        start = max(now, self._ranks.get(rank, 0.0), self._cores[0])
        done = start + seconds
        heapq.heapreplace(self._cores, done)
        self._ranks[rank] = done
        self.cpu_s[rank] += seconds
        return done

    async def work(self, rank: int, seconds: float) -> None:
        """Takes ``seconds`` of ``rank``'s CPU, queued as the frames' is; returns when done."""
        loop = asyncio.get_running_loop()
        done = self.compute(rank, seconds, loop.time())
        await asyncio.sleep(done - loop.time())

    def frame(self, rank: int, nbytes: int) -> float:
        """A frame of ``nbytes`` that ``rank`` sends or takes: the CPU seconds of each part of its
        work (0 where CPU is free)."""
        self.frames[rank] += 1
        self.handled[rank] += nbytes
        cpu = self.model.cpu
        return 0.0 if cpu is None else cpu.frame(nbytes) / cpu.handoffs

    @property
    def handoffs(self) -> int:
        return self.model.cpu.handoffs if self.model.cpu is not None else 0

    def reset(self) -> None:
        """Forgets the bytes sent, the CPU used and the frames handled so far (the links' and the
        cores' queues stay as they are)."""
        self.sent = [0] * self.world
        self.cpu_s = [0.0] * self.world
        self.frames = [0] * self.world
        self.handled = [0] * self.world


class TimedLink(Link):
    """A link to ``peer()``, a Plane of the same loop, whose frames arrive when ``network`` says."""

    def __init__(self, peer: Callable[[], Plane], counters: Counters, network: Network, src: int, dst: int, *,
                 window: int = SEND_WINDOW) -> None:
        super().__init__(counters, window=window)
        self._peer = peer
        self._network = network
        self._src, self._dst = src, dst
        self._pending: deque[tuple[Received, int]] = deque()  # on the way: each frame and its bytes
        self._taking: deque[Received] = deque()  # arrived, while the receiver's CPU takes them
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
                part = self._network.frame(self._src, nbytes)
                for _ in range(self._network.handoffs):  # the sender's CPU: the frame leaves once it is done
                    await asyncio.sleep(self._network.compute(self._src, part, loop.time()) - loop.time())
                left, arrives = self._network.send(self._src, self._dst, nbytes, loop.time())
                self._pending.append((Received(header, payload, raw), nbytes))
                loop.call_at(arrives, self._arrive, peer, sender)
                if left > loop.time():
                    await asyncio.sleep(left - loop.time())
            if self._pending or self._taking:
                self._drained = loop.create_future()
                await self._drained
            if self._refused is not None:
                self._fail(self._refused)
            else:
                clean = True
        finally:
            peer.stream_ended(sender, clean)

    def _arrive(self, peer: Plane, sender: int) -> None:
        """The oldest frame on the way has arrived: the receiver takes it once its CPU has (frames
        of one link arrive, and are taken, in order: one rank's work is done in the order asked)."""
        frame, nbytes = self._pending.popleft()
        self._taking.append(frame)
        self._take(peer, sender, self._network.frame(self._dst, nbytes), self._network.handoffs)

    def _take(self, peer: Plane, sender: int, part: float, parts: int) -> None:
        """The receiver's work on the oldest frame arrived, ``parts`` parts of ``part`` seconds to go."""
        if parts == 0:
            self._deliver(peer, sender)
            return
        loop = asyncio.get_running_loop()
        loop.call_at(self._network.compute(self._dst, part, loop.time()), self._take, peer, sender, part, parts - 1)

    def _deliver(self, peer: Plane, sender: int) -> None:
        frame = self._taking.popleft()
        if self._refused is None:
            try:
                peer.on_frame(frame, sender)
            except ProtocolError as exc:
                self._refused = exc
                self._wake_pump()
        if not self._pending and not self._taking and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


@dataclass
class Outcome:
    """What a simulated collective did: each rank's result, when the last rank finished (seconds
    after they all started), each rank's finish time, the (virtual) bytes each rank sent, the
    links' figures measured, and each rank's CPU seconds (with Model.cpu)."""

    results: list[Any]
    seconds: float
    finished: list[float]
    sent: list[int]
    links: LinkCosts | None
    cpu_s: list[float] = field(default_factory=list)  # each rank's CPU seconds (Model.cpu), the call's


def make_view(world: int, model: Model, *, algorithm: str = "auto", links: LinkCosts | None = None,
              abort_grace_s: float = 1.0, checksum: bool = False, hierarchical: str = "0",
              network: Network | None = None) -> tuple[list[Plane], Network]:
    """``world`` planes of view 1 linked by ``model``'s network (``network``: this state of it,
    which the caller holds to add its own work, Network.work; by default a fresh one);
    ``hierarchical``: RINGSERVE_HIERARCHICAL ("auto": allreduces by host where the plan says, as
    a worker's are by default)."""
    network = Network(model, world) if network is None else network
    planes: list[Plane] = []
    addresses = tuple(f"sim-{r}" for r in range(world))
    hosts = tuple(model.host(r) for r in range(world))
    for r in range(world):
        counters = Counters()
        place = Place(view_id=1, rank=r, size=world, addresses=addresses, hosts=hosts)

        def connect(to: int, r: int = r, counters: Counters = counters) -> TimedLink:
            return TimedLink(lambda: planes[to], counters, network, r, to)

        planes.append(Plane(place, counters, abort_grace_s, connect=connect, checksum=checksum, algorithm=algorithm,
                            links=links, measure_timeout_s=1e6, scale=model.scale, hierarchical=hierarchical))
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
    frame reached a collective that never took it. ``view`` goes to make_view (``network``: a
    Network of ``model`` whose ``work`` the call uses for CPU of its own).
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
    return Outcome([out for out, _ in done], max(finished), finished, list(network.sent), measured[0],
                   list(network.cpu_s))


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
