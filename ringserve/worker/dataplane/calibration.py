"""The links' latency and bandwidth, measured once per ring of a view and agreed by its ranks.

``auto`` (selection.py) picks an algorithm from the class of the link figures (selection.planned:
one host, a LAN or a WAN), and every rank must pick the same one, so every rank must hold the same
figures. They are measured, once per view and ring (the
whole view, a process set), by one collective of that ring (``ringserve.links``), which the first
call that needs them runs on every rank (the others wait for it):

1. **Pings.** Each rank sends an empty frame to its successor, which echoes it back, then
   ``PROBE_FRAMES`` frames of ``PROBE_BYTES``, echoed the same way; ``ROUNDS`` times. Half the shortest
   round trip of the empty frame is the latency; the difference between the two shortest round
   trips, over the probe's size, the time per byte. The shortest of several rounds leaves out a
   neighbour that started late, TCP's first windows, and a rank that waited for a core: with 3
   rounds, four ranks on two cores measured 0.5-1.2 ms and 0.37-3.8 ns a byte from one start to
   the next, and auto took recursive doubling for 4 MiB buckets in some starts (a step 10% longer);
   with 8, 0.18-0.32 ms and 1.9-5.9 ns, and the ring in every start.
2. **Agreement.** A max-allreduce of (latency, time per byte) over the ring, by recursive
   doubling: every rank ends with the slowest link's figures, bit for bit.

The figures come back as ``selection.Measured``, which the plan takes by its class only: the
shortest of eight rounds still swings tenfold from one start to the next on a loaded machine, and
a plan that followed it summed in another order in another run.

It costs about ``ROUNDS`` x 2 round trips plus log2(n) hops, once per view and ring (at 20 ms one
way and 100 Mbit/s: about 0.8 s), and nothing when the figures are configured
(RINGSERVE_LINK_LATENCY_S and RINGSERVE_LINK_MBPS). Who starts it, and how the others are pulled
in: ``Measures``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np

from ringserve import selection, wire
from ringserve.errors import RingChangedError
from ringserve.loop import fine_clock
from ringserve.selection import FASTEST_SECONDS_PER_BYTE, LinkCosts, Measured
from ringserve.worker.dataplane import keys, programs, routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.partials import PartialRaw
from ringserve.worker.dataplane.programs import Lead, Program, Recv, Ring, Signal, Take, executor
from ringserve.worker.dataplane.programs.halving_doubling import recursive_doubling
from ringserve.worker.dataplane.session import Session, ViewPlane
from ringserve.worker.dataplane.values import Values

NAME = "ringserve.links"
DESCRIPTOR = Descriptor("links", algo=routes.PROBE)
ROUNDS = 8
PROBE_FRAMES = 3
PROBE_BYTES = 60 << 10  # a frame of it fits whatever chunk_bytes (max_message_bytes is four chunks + 64 KiB)
AGREE_SLOT = 1 << 20  # the agreement's slots, after the pings'


class Clock(Values):
    """The pings' data: nothing but the times at which this rank sent and heard back, on a clock
    that resolves a hop on loopback (``fine_clock``: under uvloop, whose clock counts whole
    milliseconds, an empty frame's round trip read as 0 or 1 ms, and the probe's bytes as no time
    at all, so that auto took recursive doubling for DDP's 16 and 6 MiB buckets of a training step)."""

    def __init__(self, size: int) -> None:
        self.dtype = wire.dtype_code(np.dtype(np.uint8))
        self._zeros = np.zeros(size, dtype=np.uint8)
        self._now = fine_clock(asyncio.get_running_loop())
        self.times: list[float] = []  # per round: small sent, small echoed, large sent, large echoed
        self._sending = False

    def first(self, a: int, b: int) -> np.ndarray:
        if not self._sending:  # the time its first frame left
            self.times.append(self._now())
        self._sending = True
        return self._zeros[a:b]

    def take(self, a: int, b: int, frame: Received) -> None:
        self.times.append(self._now())
        self._sending = False

    def figures(self, size: int) -> tuple[float, float]:
        """(latency, seconds per byte) from the shortest round trips."""
        small = min(self.times[i + 1] - self.times[i] for i in range(0, len(self.times), 4))
        large = min(self.times[i + 3] - self.times[i + 2] for i in range(0, len(self.times), 4))
        return small / 2, max(large - small, 0.0) / max(size, 1)


def pings(ring: Ring, size: int, rounds: int = ROUNDS) -> Program:
    """``rounds`` times: an empty frame to the successor and back, then PROBE_FRAMES frames of
    ``size`` bytes and back; and the same for the predecessor's pings, echoed to it."""
    n, me = ring.size, ring.index
    if n == 1:
        return
    prev, after = (me - 1) % n, (me + 1) % n
    for r in range(rounds):
        base = 4 * r
        for slot, frames in ((base, 1), (base + 2, PROBE_FRAMES)):
            length = 0 if frames == 1 else size
            for c in range(frames):
                yield Lead(slot, c, 0, length, to=(after,))
            for c in range(frames):
                yield Recv(slot, c, frm=prev)
            yield Signal(slot + 1, to=(prev,))
            yield Recv(slot + 1, 0, frm=after)
            yield Take(0, 0)


# What a ring on one host stands for in place of a measure: its class's figures (selection.planned
# plans by the class of a Measured, and one host's is HOST whatever was measured).
ONE_HOST = Measured(selection.HOST_LINKS.latency_s, selection.HOST_LINKS.seconds_per_byte)


class Measures:
    """One plane's link figures: given (``links``), or measured once per ring of its view.

    The measure is a collective of its ring. Whichever rank needs the figures first starts it, and
    its first frame pulls each other rank in (``pull``, from the plane's receive path) whatever
    that rank is doing: waiting in another collective, in a barrier, joined (join.py). So the
    measure never depends on which call comes first on each rank, and a rank whose first call
    differs from the others' (a mismatch) still meets them there, and fails in that call as it
    would have without the measure. The plane owns the pulled measures' tasks (``close``).
    """

    def __init__(self, links: LinkCosts | None, timeout_s: float) -> None:
        self.given = links
        self.timeout_s = timeout_s
        self._figures: dict[str, asyncio.Future[LinkCosts]] = {}  # by ring spec (keys.py)
        self._tasks: set[asyncio.Task[LinkCosts]] = set()

    async def links(self, session: Session) -> LinkCosts:
        """The figures of the session's ring: given, measured already in this view, or measured now
        (then ``Measured``, which auto plans by its class: selection.planned).

        A ring on one host is not measured: its class is HOST whatever a measure reads (see
        selection.link_class), and the measure cost the first collective of every view about 25 ms
        on loopback, which the members paid in full at each joiner's admission (issue 45)."""
        if self.given is not None:
            return self.given
        if selection.one_host(session.place.hosts, session.place.size):
            return ONE_HOST
        pending = self._figures.get(session.spec)
        if pending is None:
            pending = self._start(session)
        return await asyncio.shield(pending)

    def pull(self, descriptor: str, key: str, plane: ViewPlane) -> bool:
        """Whether a frame of ``key`` (with ``descriptor``) belongs to a measure; starts this rank's
        part in it on ``plane`` if it has not started yet. (The plane is an argument, not a field:
        the plane holds this, and a cycle would keep both until the garbage collector ran.)"""
        if descriptor != DESCRIPTOR.text:
            return False
        spec = keys.split(key)[2]
        if spec not in self._figures and self.given is None:
            members = tuple(int(m) for m in spec.split(".")) if spec else None
            self._start(plane.session(members))
        return True

    def close(self, exc: BaseException) -> None:
        """Fails the measures in flight with ``exc`` (the plane is closing with it), then cancels
        their tasks. Every collective awaiting the figures gets ``exc``: a cancellation of the
        measure's task must never reach a collective that nobody cancelled (issue 40: a bare
        CancelledError out of the first allgather of a view that ended under its measure)."""
        for pending in self._figures.values():
            _fail(pending, exc)
        for task in self._tasks:
            task.cancel()

    def _start(self, session: Session) -> asyncio.Future[LinkCosts]:
        loop = asyncio.get_running_loop()
        pending = self._figures[session.spec] = loop.create_future()
        task = loop.create_task(measure(session, timeout_s=self.timeout_s), name="ringserve-measure-links")
        self._tasks.add(task)

        def done(task: asyncio.Task[LinkCosts]) -> None:
            self._tasks.discard(task)
            if pending.done():  # failed by close()
                return
            if task.cancelled():  # the loop is ending: the plane was not closed first
                _fail(pending, RingChangedError(session.view_id, session.view_id,
                                                "the worker stopped while it measured the links"))
            elif (exc := task.exception()) is not None:
                _fail(pending, exc)
            else:
                pending.set_result(task.result())

        task.add_done_callback(done)
        return pending


def _fail(pending: asyncio.Future[LinkCosts], exc: BaseException) -> None:
    if not pending.done():
        pending.set_exception(exc)
        pending.exception()  # retrieved: each caller raises it, the loop need not log it


async def measure(session: Session, *, timeout_s: float) -> LinkCosts:
    """Runs the measuring collective of the session's ring on this rank."""
    ring = session.ring
    size = PROBE_BYTES
    clock = Clock(size)
    agreed = np.zeros(2, dtype=np.float64)

    def stages() -> Iterator[tuple[Program, Values]]:
        yield pings(ring, size), clock
        latency, per_byte = clock.figures(size * PROBE_FRAMES) if ring.size > 1 else (0.0, 0.0)
        mine = np.array([latency, per_byte], dtype=np.float64)
        yield (programs.shifted(recursive_doubling(ring, 2, 2), AGREE_SLOT),
               PartialRaw(mine, agreed, "max", ring.size, ring=ring))

    await executor.run_stages(session, NAME, DESCRIPTOR, timeout_s, stages())
    links = links_of(float(agreed[0]), float(agreed[1]))
    return Measured(links.latency_s, links.seconds_per_byte)


def links_of(latency_s: float, seconds_per_byte: float) -> LinkCosts:
    """The agreed figures as the model takes them: a time per byte no less than the fastest a link
    can be (selection.FASTEST_SECONDS_PER_BYTE), where the probe's bytes took no time to be seen."""
    return LinkCosts(latency_s, max(seconds_per_byte, FASTEST_SECONDS_PER_BYTE))
