"""One view's data plane, as seen by one worker: links to the ranks it sends to, the frames that
arrive from the ranks that send to it, sorted by collective, and the abort protocol.

A plane lives exactly as long as its view. Collectives run on it through sessions (session.py),
each a ring over some of the view's ranks: the whole view, or a sub-ring such as a process set.

- **Links out.** A plane holds at most one link per rank of its view. The link to the view's ring
  successor opens with the plane, as the whole view's collectives need it at once; any other opens
  on first use, when a collective whose ring sends there starts. All of them end (once no
  collective is in flight on a retired plane), close, and are drained with the plane. A link that
  fails fails the collectives that send on it, and the coordinator hears of the peer.
- **Streams in.** The peer server (peers.py) hands the plane every frame of each verified stream,
  with the rank that stream comes from. A frame goes to its collective's inbox by key, and only
  from the rank that precedes this one in that collective's ring: anything else is a broken peer
  or program (ProtocolError, the stream is refused). When the stream from a rank ends, only the
  collectives that wait on that rank starve.
- **Keys.** A collective's key names its ring (keys.py), so every frame, even one that arrives
  before its collective opened here, belongs to exactly one ring and one sender.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import numpy as np

from ringserve import wire
from ringserve.errors import PeerUnavailableError, ProtocolError, UsageError
from ringserve.observe import Counters, Timeline
from ringserve.selection import LinkCosts
from ringserve.worker.dataplane import aborts, keys, routes
from ringserve.worker.dataplane.aborts import Aborts
from ringserve.worker.dataplane.calibration import Measures
from ringserve.worker.dataplane.inbox import MISMATCH, Inbox, Received
from ringserve.worker.dataplane.lanes.tcp.frames import Landings
from ringserve.worker.dataplane.links.stream import Link
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.dataplane.pool import ResultPool
from ringserve.worker.dataplane.programs import Ring
from ringserve.worker.dataplane.session import Session

log = logging.getLogger("ringserve.worker")

# Makes the (unopened) link to one rank of the view; the plane opens it with its HELLO.
Connect = Callable[[int], Link]
OnPeerFailure = Callable[[int, int, str], None]  # (view, rank, why)


class Plane:
    """The data plane of one view, for one worker."""

    def __init__(
        self,
        place: Place,
        counters: Counters,
        abort_grace_s: float,
        *,
        connect: Connect | None = None,
        timeline: Timeline | None = None,
        on_peer_failure: OnPeerFailure | None = None,
        checksum: bool = False,
        pool: ResultPool | None = None,
        hierarchical: str = "0",
        algorithm: str = "ring",
        links: LinkCosts | None = None,
        measure_timeout_s: float = 60.0,
        scale: int = 1,
        landings: Landings | None = None,
    ) -> None:
        self.place = place
        # Where the payload lanes' threads may read a payload straight into a result (lanes/tcp/frames.py).
        self.landings = landings
        self.pool = pool  # new-result buffers (pool.py); None: each result is a fresh array
        self.hierarchical = hierarchical  # whole-view allreduces by host when the view allows (hierarchy.py)
        # RINGSERVE_ALGORITHM, and the link figures it goes by (worker/ops/algorithms.py): given, or
        # measured once per ring of this view (calibration.py).
        self.algorithm = algorithm
        self.measures = Measures(links, measure_timeout_s)
        # Each payload byte stands for ``scale`` bytes when algorithms are chosen: the virtual
        # sizes of the simulator (ringserve/testing/netsim.py); 1 everywhere else.
        self.scale = scale
        self.ring = Ring.whole(place.rank, place.size)
        self.counters = counters
        self.abort_grace_s = abort_grace_s
        self.timeline = timeline
        self.checksum = checksum
        self._connect = connect
        self._on_peer_failure = on_peer_failure
        self._links: dict[int, Link] = {}
        self._broken: dict[int, BaseException] = {}  # ranks whose link failed
        self._gone: dict[int, BaseException] = {}  # ranks whose stream in has ended
        self._streaming: dict[int, int] = {}  # ranks with a verified stream in open: how many
        self._ended = False  # every link was ended or closed: no new one opens
        self._inboxes: dict[str, Inbox] = {}
        self.numbering = keys.Numbering()
        # join.py's hook while joined: told (key, descriptor) of a whole-view collective not opened here.
        self.on_unopened: Callable[[str, str], None] | None = None
        self._damaged = ""  # a damaged frame named no open collective: the next one is aborted
        self._aborts = Aborts(place.rank, place.view_id, abort_grace_s)
        self.error: BaseException | None = None
        self.retired: BaseException | None = None
        self._active = 0
        self._opened: dict[str, float] = {}
        # Frames that reached a collective which then finished without taking them: always 0
        # for programs whose ranks agree (the simulator checks it).
        self.unused = 0
        # Resolved when frames of a collective not opened here arrive, or the plane ends (``arrival``).
        self._arrival: asyncio.Future[None] | None = None
        if place.size > 1:
            self.link_to(self.ring.next)

    @property
    def view_id(self) -> int:
        return self.place.view_id

    def session(self, members: tuple[int, ...] | None = None) -> Session:
        """A session over the whole view, or over the sub-ring of ``members`` in that order.

        Raises:
            InvalidArgumentError: members repeat, fall outside the view, or leave this rank out.
        """
        return Session(self, members)

    @property
    def linked_ranks(self) -> tuple[int, ...]:
        """The ranks this plane holds a link to."""
        return tuple(self._links)

    def link_report(self) -> list[tuple[int, str, int]]:
        """(rank, lane, bytes sent) of each link, the ring successor's first (for heartbeats)."""
        first = self.ring.next
        ranks = sorted(self._links, key=lambda r: (r != first, r))
        return [(r, self._links[r].lane_name, self._links[r].bytes_sent) for r in ranks]

    # -- the collectives' side -------------------------------------------------------------

    def link_to(self, rank: int) -> Link | None:
        """The link to ``rank``, opened now if this is its first use (None: no link can open)."""
        link = self._links.get(rank)
        if link is not None or rank == self.place.rank or self._ended or self._connect is None:
            return link
        link = self._links[rank] = self._connect(rank)
        hello = wire.FrameHeader(kind=wire.HELLO, view_id=self.view_id, sender_rank=self.place.rank)
        link.open(hello, functools.partial(self._link_failed, rank))
        return link

    def open(self, name: str | None, descriptor: str, ring: Ring, spec: str = "", *,
             key: str | None = None) -> tuple[str, Inbox, Link | None]:
        """Registers a collective over ``ring`` (``spec`` names a sub-ring); returns its key, its
        inbox, and the link to the ring's next rank (opened now if this is its first use). ``key``:
        that very key of the whole view's (a joined rank stands in for it: ``Numbering.claim``)."""
        if self.error is not None:
            raise self.error
        if self.retired is not None:
            raise self.retired
        sinks = routes.sinks(routes.algorithm_of(descriptor), ring)
        for rank in sinks:
            if rank in self._broken:
                raise self._broken[rank]
        link = self.link_to(ring.next) if ring.size > 1 else None
        if key is None:
            key = self.numbering.next(name if name is not None else "", spec)
        elif spec:
            raise UsageError(f"A joined rank stands in for the whole view's collectives only, not {key!r} on {spec}.")
        else:
            self.numbering.claim(key)
        inbox = self._inbox(key, ring)
        inbox.sinks = sinks
        inbox.descriptor = descriptor
        inbox.known[self.place.rank] = descriptor
        foreign = inbox.foreign(descriptor)
        if foreign:
            self._abort_start(key, inbox, foreign)
        if self._damaged:
            self._abort_start(key, inbox, {}, reason=self._damaged)
            self._damaged = ""
        self._active += 1
        self._opened[key] = time.monotonic()
        return key, inbox, link

    def waiting(self, key: str) -> bool:
        """Whether frames of ``key``, a collective not opened here yet, have arrived."""
        inbox = self._inboxes.get(key)
        return inbox is not None and inbox.descriptor is None

    async def arrival(self) -> None:
        """Waits until frames of a collective not opened here arrive (a recv from any of several
        senders waits for the first of them, p2p.recv_any), or the plane ends.

        Raises:
            the plane's error once it is closed, or why it retired.
        """
        if self._arrival is None or self._arrival.done():
            self._arrival = asyncio.get_running_loop().create_future()
        if self.error is None and self.retired is None:
            await asyncio.shield(self._arrival)
        if self.error is not None:
            raise self.error
        if self.retired is not None:
            raise self.retired

    def _arrived(self) -> None:
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    def unopened(self) -> list[tuple[str, str]]:
        """(key, descriptor) of the whole view's collectives with frames here not opened here."""
        return [(k, inbox.heard()) for k, inbox in self._inboxes.items()
                if inbox.descriptor is None and not keys.split(k)[2]]

    def stalled(self, older_than_s: float) -> list[str]:
        """Keys of the collectives in flight for longer than older_than_s."""
        now = time.monotonic()
        return sorted(k for k, t in self._opened.items() if now - t > older_than_s)

    def release(self, key: str) -> None:
        inbox = self._inboxes.pop(key, None)
        if inbox is not None and inbox.error is None:
            self.unused += inbox.untaken()
        self._opened.pop(key, None)
        self._active -= 1
        if self._active == 0 and self.retired is not None:
            self._end_links()

    def land(self, key: str, frames: list[tuple[int, int, np.ndarray]], dtype: int) -> None:
        """Frames (slot, chunk) of ``key`` may be read straight into their regions."""
        if self.landings is not None and frames:
            self.landings.offer(self.view_id, key, frames, dtype)

    async def withdraw(self, key: str) -> None:
        if self.landings is not None and not self.landings.withdraw(self.view_id, key):
            await self.landings.withdrawn(self.view_id, key, self.abort_grace_s)

    async def recv(self, key: str, inbox: Inbox, slot: int, chunk: int, source: int = -1) -> Received:
        """The frame (slot, chunk) of a collective, from rank ``source`` (-1: the ring's
        predecessor), after checking its author ran the same call.

        A slot names what a frame carries (a ring step, a segment, an origin rank), chosen so that
        a frame forwarded unchanged keeps its key from hop to hop.
        """
        frame = await inbox.take((slot, chunk), source)
        if frame.header.descriptor != inbox.descriptor:
            self._abort_start(key, inbox, {frame.header.sender_rank: frame.header.descriptor})
            raise await inbox.failure()
        return frame

    def send(self, link: Link | None, key: str, inbox: Inbox, *, slot: int, chunk: int,
             payload: np.ndarray | memoryview | bytes, dtype: int, count: int, origin: int = 0,
             origin_count: int = 0, codec: int = 0, volatile: bool = False) -> None:
        """Sends one DATA frame on ``link``; with ``checksum`` on, its header carries its crc32.
        ``volatile``: the caller may write the payload's memory once this returns (links/stream.py)."""
        header = wire.FrameHeader(
            kind=wire.DATA,
            view_id=self.place.view_id,
            sender_rank=self.place.rank,
            op_key=key,
            descriptor=inbox.descriptor,
            step=slot,
            chunk=chunk,
            origin=origin,
            origin_count=origin_count,
            dtype=dtype,  # type: ignore[arg-type]
            count=count,
            codec=codec,  # type: ignore[arg-type]
        )
        if self.checksum:
            header.crc32 = wire.frame_crc(header, payload)
        if link is not None:
            link.send(header, payload, volatile=volatile)

    # -- the peer server's side ------------------------------------------------------------

    def accept(self, hello: wire.FrameHeader) -> None:
        """Lets in the stream a HELLO opens: from another rank of this view.

        Any rank may stream to any other (sub-rings, point-to-point programs); which collectives a
        sender's frames may reach is checked frame by frame (``on_frame``).

        Raises:
            ProtocolError: the rank is not in the view, or is this worker's own.
        """
        rank, size, view = hello.sender_rank, self.place.size, self.view_id
        if not 0 <= rank < size:
            raise ProtocolError(f"A stream claims rank {rank}, but view {view} has ranks 0 to {size - 1}.")
        if rank == self.place.rank:
            raise ProtocolError(f"A stream claims rank {rank} of view {view}, the rank of the worker it reached.")
        self._streaming[rank] = self._streaming.get(rank, 0) + 1

    def stream_ended(self, rank: int, clean: bool) -> bool:
        """The stream from ``rank`` ended (``clean``: with its BYE); the collectives waiting for its
        frames fail. Returns whether the sender looks dead, for a report to the coordinator."""
        left = self._streaming.get(rank, 0) - 1
        if left > 0:
            self._streaming[rank] = left
        else:
            self._streaming.pop(rank, None)
        if self.retired is not None:
            self._starve(rank, self.retired)
            return False
        how = "ended" if clean else "broke"
        self._starve(rank, PeerUnavailableError(f"The stream from rank {rank} of view {self.view_id} {how}."))
        return not clean

    def on_frame(self, frame: Received, sender: int) -> None:
        """Routes one frame that came on the stream from rank ``sender`` to its collective.

        Raises:
            ProtocolError: the frame's collective does not receive from ``sender`` here (its key
                names a ring in which ``sender`` does not precede this rank), or it is malformed.
        """
        header = frame.header
        self.counters.bytes_received += len(frame.raw) + header.shm_bytes + header.lane_bytes
        if self.error is not None:
            self.counters.frames_rejected += 1
            return
        key = header.op_key
        if header.kind == wire.DATA:
            # Before anything reads the header: with a checksum, a damaged one is not to be trusted.
            damage = aborts.damage(frame, self.place.rank, self.view_id, self.checksum)
            if damage:
                self.counters.frames_rejected += 1
                self._on_damage(key, damage)
                return
        inbox = self._inboxes.get(key)
        ring = inbox.ring if inbox is not None else keys.ring_of(key, self.ring, self.view_id)
        assert ring is not None
        # Aborts go round the ring; data frames come from the ranks their program names.
        routes.check_sender(header.descriptor if header.kind == wire.DATA else "", key, ring, sender, self.view_id)
        if inbox is None and self._finished(key):
            # A collective this rank already finished or gave up on: a late data frame is
            # dropped; an abort is still passed on (the other ranks' laps need it) but kept nowhere.
            if header.kind == wire.ABORT:
                late = Inbox(ring)
                self._pass_on(late, self._aborts.received(key, late, header))
            else:
                self.counters.frames_rejected += 1
            return
        if inbox is None:
            inbox = self._inbox(key, ring)
            self._arrived()
        if inbox.descriptor is None and header.kind == wire.DATA and self.measures.pull(header.descriptor, key, self):
            inbox.announced = True  # a measure of the links: every rank takes part (calibration.py)
        if (inbox.descriptor is None and self.on_unopened is not None and not inbox.announced
                and not keys.split(key)[2]):
            inbox.announced = True
            self.on_unopened(key, header.descriptor)
        if header.kind == wire.DATA:
            if inbox.error is None:
                inbox.deliver((header.step, header.chunk), frame)
                # Checked on arrival too, not only when taken: a rank that disagrees on the root
                # waits for frames that never come, and never takes the ones that did.
                if inbox.descriptor is not None and header.descriptor != inbox.descriptor:
                    self._abort_start(key, inbox, {header.sender_rank: header.descriptor})
        elif header.kind == wire.ABORT:
            self._pass_on(inbox, self._aborts.received(key, inbox, header))
        else:
            raise ProtocolError(f"A frame of kind {header.kind} is not expected mid-stream.")

    # -- the view's end --------------------------------------------------------------------

    def retire(self, exc: BaseException) -> None:
        """Ends the view softly: new collectives fail with exc, those in flight may finish.

        Once none is in flight, every link ends cleanly, which tells each peer that nothing more
        will come (see stream_ended); so a drain ends within one lap.
        """
        if self.retired is not None or self.error is not None:
            return
        self.retired = exc
        self._arrived()
        if self._active == 0:
            self._end_links()

    def starve(self, ranks: tuple[int, ...], exc: BaseException) -> None:
        """Streams from ``ranks`` bring nothing more: collectives waiting on them fail with exc."""
        for rank in ranks:
            self._starve(rank, exc)

    def let_go(self, ranks: tuple[int, ...], exc: BaseException) -> None:
        """``ranks`` left in a graceful change (policy.Starve): starves those without an open
        stream in. A leaver let go at a commit (elastic.py names it in the admit) is dropped
        before it drains, and its last frames may still be on the way: that stream's end starves
        the waits instead (``stream_ended``)."""
        self.starve(tuple(r for r in ranks if r not in self._streaming), exc)

    def close(self, exc: BaseException) -> None:
        """Fails every collective of this view with exc and stops sending at once."""
        if self.error is None:
            self.error = exc
        for inbox in self._inboxes.values():
            inbox.fail(exc)
        self._arrived()
        self._ended = True
        self.measures.close(exc)
        for link in self._links.values():
            link.close()

    @property
    def drained(self) -> bool:
        """True once every link has ended (or there never was one)."""
        return all(link.done for link in self._links.values())

    async def wait_closed(self) -> None:
        """Waits for every link to end. A cancelled caller stays cancelled (and the links run on),
        so one deadline covers the waits on several planes."""
        for link in list(self._links.values()):
            await link.wait_closed()

    # -- internals -------------------------------------------------------------------------

    def _end_links(self) -> None:
        self._ended = True
        for link in self._links.values():
            link.end()

    def _finished(self, key: str) -> bool:
        """Whether ``key`` names a collective this rank opened and has since released."""
        return key not in self._inboxes and self.numbering.handed_out(key)

    def _inbox(self, key: str, ring: Ring) -> Inbox:
        inbox = self._inboxes.get(key)
        if inbox is None:
            inbox = self._inboxes[key] = Inbox(ring)
            if self.error is not None:
                inbox.fail(self.error)
            else:
                for rank, exc in self._gone.items():
                    inbox.starve(exc, rank)
        return inbox

    def _starve(self, rank: int, exc: BaseException) -> None:
        exc = self._gone.setdefault(rank, exc)
        for inbox in self._inboxes.values():
            inbox.starve(exc, rank)

    def _link_failed(self, rank: int, exc: BaseException, why: str) -> None:
        """The link to ``rank`` failed: the collectives that send there fail, and, if the peer
        looks dead (``why``), the coordinator hears of it."""
        self._broken.setdefault(rank, exc)
        for inbox in self._inboxes.values():
            if rank in inbox.sinks:
                inbox.fail(exc)
        link = self._links.get(rank)
        if link is not None:
            link.close()
        if why and self._on_peer_failure is not None:
            self._on_peer_failure(self.view_id, rank, why)

    def _on_damage(self, key: str, reason: str) -> None:
        """Aborts the collective a damaged frame belongs to, on every rank.

        The checksum covers the header too, so the collective the frame names may itself be
        damaged: if no collective of that name is open here, every open one is aborted, and if
        none is open, the next one to open is. A frame is never used, and no collective is left
        waiting for a frame that will not come.
        """
        if self._finished(key):
            return
        if key in self._inboxes:
            damaged = [key]
        else:
            damaged = list(self._inboxes)
            if not damaged:
                self._damaged = reason
        for k in damaged:
            self._abort_start(k, self._inboxes[k], {}, reason=reason)

    def _abort_start(self, key: str, inbox: Inbox, descriptors: dict[int, str], reason: str = MISMATCH) -> None:
        self._pass_on(inbox, self._aborts.start(key, inbox, descriptors, reason))

    def _pass_on(self, inbox: Inbox, frame: bytes | None) -> None:
        """Sends an abort frame to the next rank of the collective's ring."""
        ring = inbox.ring
        if frame is None or ring is None or ring.size == 1:
            return
        link = self.link_to(ring.next)
        if link is not None:
            link.control(frame)
