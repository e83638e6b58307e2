"""Links: how one rank's frames reach another rank of its view, in order, with backpressure.

A link is the outbound half of one edge between two ranks of a view; a plane (plane.py) holds one
per rank it sends to. The executor hands it DATA frames (new ones, and frames forwarded as they
came); the plane hands it ABORT frames. The link encodes them, puts a
payload into the shared-memory lane when the lane is attached and has a free slot (the header then
names the slot, see links/shared.py), and moves the frames, in the order they were given, to the peer,
where they arrive at that peer's ``Plane.on_frame``. Between hosts, once the TCP payload lane is
attached, frames go on it instead, each with its payload (lanes/tcp/outbound.py). A new way to move frames (fd passing between
containers, a faster lane between hosts) is one new subclass: it implements ``_run``, which takes
frames with ``_next`` until it returns None, then ends the stream cleanly.

- ``StreamLink``: the gRPC stream to a peer (the contract between hosts), optionally with the
  shared-memory lane of ``OutboundRing`` for payloads between processes of one host, and the TCP
  payload lane of ``OutboundLane`` for payloads between hosts.
- ``MemoryLink`` (ringserve/testing/memlink.py): a Plane in the same process, for tests and the simulator.

Backpressure: at most ``window`` DATA frames (``SEND_WINDOW`` by default) wait in a link's queue,
and one more is being written. The executor asks ``has_room`` before it sends and waits on
``room()`` when there is none, so a rank never runs more than ``window`` chunks ahead of its link:
a link's memory is bounded by ``window + 1`` frames of at most ``frame_bytes`` (config.py) and a header each
(with the shared ring attached, a queued frame is its header only; the TCP lane holds at most
``window`` buffers that the kernel has not taken, see lanes/tcp/outbound.py). ABORT frames and the clean end never
wait: they are a few hundred bytes at most, once per collective, and are sent from the receive
path, which must never block. A full queue cannot deadlock the ring: the receiving side routes
every frame to its collective's inbox as it arrives, whatever that collective is waiting for.

Why 32: without a bound, the queue of the largest benchmark (64 MiB over 2 ranks, 16 chunks of
2 MiB per step) peaks at 17 frames, so 32 never holds it back, and the bound costs nothing where
the old unbounded queue was fine. With the default 2 MiB chunks a link holds at most 66 MiB on the
stream (33 frames), where a 1 GiB allreduce once queued 512 MiB, and a burst of small collectives
behind a slow peer could queue without limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import grpc
import numpy as np

from ringserve import wire
from ringserve._proto import peer_pb2
from ringserve.errors import PayloadLaneError, PeerUnavailableError
from ringserve.observe import Counters
from ringserve.transport import peer_error
from ringserve.worker.dataplane.lanes.tcp.outbound import OutboundLane
from ringserve.worker.dataplane.links.channels import Lease
from ringserve.worker.dataplane.links.shared import OutboundRing

log = logging.getLogger("ringserve.worker")

SEND_WINDOW = 32
# How a link's payloads travel, as its heartbeat names it to the status page (a new lane names
# itself: the coordinator shows whatever text a worker reports).
LANE_STREAM = "stream"
LANE_SHARED = "shared memory"
LANE_TCP = "tcp lane"
STREAM_METHOD = "/ringserve.v1.Peer/Stream"

Payload = np.ndarray | memoryview | bytes
# Called once when a link fails: the error for the collectives, and why the peer looks dead ("" if
# it does not: a refusal, a timeout on the peer's side), for a report to the coordinator.
OnFailure = Callable[[BaseException, str], None]


class Link:
    """The outbound half of one edge: frames to one peer, in order, with backpressure."""

    def __init__(self, counters: Counters, *, lane: OutboundRing | None = None, tcp: OutboundLane | None = None,
                 window: int = SEND_WINDOW) -> None:
        if window < 1:
            raise ValueError("A link needs a window of at least one frame.")
        self.counters = counters
        self.lane = lane
        self.tcp = tcp
        if tcp is not None:
            tcp.window = window
            tcp.on_room = self._let_in
            tcp.on_failure = self._fail
            tcp.spared = lambda: lane is not None and lane.attached  # the shared ring won: no TCP lane needed
        self.window = window
        self._frames: deque[tuple[bytes, bool]] = deque()
        self._queued = 0  # DATA frames in _frames
        self._wake: asyncio.Future[None] | None = None  # the pump waits here for a frame
        self._waiters: deque[asyncio.Future[None]] = deque()  # senders waiting for room
        self._ending = False
        self._closed = False
        self._carrier_over = False  # the call that carries the frames ended (see StreamLink._run)
        self._task: asyncio.Task[None] | None = None
        self._on_failure: OnFailure = _ignore
        self.bytes_sent = 0  # this link's share of counters.bytes_sent

    @property
    def lane_name(self) -> str:
        """How payloads travel on this link now (the status page's lane)."""
        if self.lane is not None and self.lane.attached:
            return LANE_SHARED
        return LANE_TCP if self.tcp is not None and self.tcp.attached else LANE_STREAM

    # -- the sending side ------------------------------------------------------------------

    def open(self, hello: wire.FrameHeader, on_failure: OnFailure) -> None:
        """Starts moving frames; ``hello`` goes first (with the lane's offer, if there is a lane)."""
        if self.lane is not None:
            hello.shared_ring.CopyFrom(self.lane.offer())
        if self.tcp is not None:
            hello.payload_lane.CopyFrom(self.tcp.offer())
        self._on_failure = on_failure
        self._task = asyncio.get_running_loop().create_task(self._pump(hello), name=f"ringserve-link-v{hello.view_id}")
        self._task.add_done_callback(self._ended)

    @property
    def has_room(self) -> bool:
        """Whether a DATA frame may be sent now; a closed link has room (its frames are dropped)."""
        return self._closed or (self._queued < self.window and (self.tcp is None or self.tcp.has_room))

    async def room(self) -> None:
        """Returns once a DATA frame has left the queue (or the link closed); check has_room again."""
        if self.has_room:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if not waiter.done():
                waiter.cancel()
            if self._waiters and waiter in self._waiters:
                self._waiters.remove(waiter)

    def send(self, header: wire.FrameHeader, payload: Payload, whole: bytes = b"", *, volatile: bool = False) -> None:
        """Queues a DATA frame, its payload in the lane when the lane has room for it.

        ``whole``: the frame already encoded with its payload, if it was (a frame forwarded).
        ``volatile``: the caller may write the payload's memory once this returns. The TCP lane,
        which sends from that memory later, then sends a copy; the stream and the shared ring copy
        the payload here anyway.
        """
        self.counters.frames_sent += 1
        if self.tcp is not None and self.tcp.attached:
            if volatile and not isinstance(payload, bytes):
                payload = payload.copy() if isinstance(payload, np.ndarray) else bytes(payload)
            header.lane_bytes = payload.nbytes if isinstance(payload, np.ndarray | memoryview) else len(payload)
            frame = wire.encode(header)
            sent = len(frame) + self.tcp.frame(frame, payload)
            self.counters.bytes_sent += sent
            self.bytes_sent += sent
            return
        slot = self.lane.put(payload) if self.lane is not None else None
        if slot is None:
            self._push(whole or wire.encode(header, payload), True)
            return
        nbytes = payload.nbytes if isinstance(payload, np.ndarray | memoryview) else len(payload)
        header.shm_slot = slot
        header.shm_bytes = nbytes
        self.counters.shared_bytes_sent += nbytes
        self._push(wire.encode(header), True, nbytes)

    def forward(self, header: wire.FrameHeader, payload: memoryview, raw: bytes) -> None:
        """Queues a received frame as it is: the same header, the same payload.

        A frame that came whole goes on as the same bytes, unless a lane is attached (the TCP lane
        takes every frame; the ring, a payload it has room for: one copy into it beats the
        stream's copies); one whose payload came in the predecessor's shared ring or on its TCP
        lane goes on a lane of ours, or into the frame.
        """
        beside = header.HasField("shm_slot") or header.lane_bytes
        if (not beside and (self.lane is None or not self.lane.attached)
                and (self.tcp is None or not self.tcp.attached)):
            self.counters.frames_sent += 1
            self._push(raw, True)
            return
        copy = wire.FrameHeader()
        copy.CopyFrom(header)
        if beside:
            copy.ClearField("shm_slot")
            copy.shm_bytes = 0
            copy.lane_bytes = 0
            self.send(copy, payload)
        else:
            self.send(copy, payload, raw)

    async def flushed(self) -> None:
        """Returns once no payload sent so far is still read from its caller's memory (the TCP
        lane sends from it; the stream and the shared ring copy at once)."""
        if self.tcp is not None:
            await self.tcp.flushed()

    def control(self, frame: bytes) -> None:
        """Queues an encoded control frame (an ABORT); it never waits for room."""
        if self.tcp is not None and self.tcp.attached and not self._closed:
            self.counters.bytes_sent += len(frame)
            self.bytes_sent += len(frame)
            self.tcp.frame(frame)
            return
        self._push(frame, False)

    def end(self) -> None:
        """No more frames: the link ends cleanly once the queue is empty (and the TCP lane's)."""
        self._ending = True
        if self.tcp is not None:
            self.tcp.end()
        self._wake_pump()

    def close(self) -> None:
        """Stops at once: queued frames are dropped, and waiting senders are let go."""
        self._closed = True
        self._on_failure = _ignore  # the plane is closing: nothing to tell it (and no cycle left)
        if self._task is not None:
            self._task.cancel()
        if self.lane is not None:
            self.lane.close()  # a pump cancelled before it ran never reaches its own close
        if self.tcp is not None:
            self.tcp.close()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._frames.clear()
        self._queued = 0

    @property
    def done(self) -> bool:
        """True once the link has ended (or never started)."""
        return self._task is None or self._task.done()

    async def wait_closed(self) -> None:
        """Waits for the link to end. Cancelling the caller does not cancel the link, and is not
        swallowed: a deadline over several links holds for all of them."""
        task = self._task
        if task is not None:
            await asyncio.wait([task])

    def _ended(self, task: asyncio.Task[None]) -> None:
        """Forgets the finished pump: a cancelled one's traceback holds the link, and the link would
        hold it back, a cycle that kept the channel (and gRPC's poller thread) until the next GC."""
        self._task = None
        if not task.cancelled():
            task.exception()  # logged by _pump, and the plane failed with it: seen, not raised twice

    # -- for subclasses --------------------------------------------------------------------

    async def _run(self, hello: wire.FrameHeader) -> None:
        """Moves ``hello``, then every frame ``_next`` gives, to the peer; ends cleanly at None."""
        raise NotImplementedError

    async def _next(self) -> bytes | None:
        """The next frame to move, or None once the link has ended and the queue is empty."""
        while not self._frames:
            if self._ending or self._carrier_over:
                return None
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        frame, data = self._frames.popleft()
        if data:
            self._queued -= 1
            self._let_in()
        return frame

    def _let_in(self) -> None:
        """A DATA frame left the queue (or the TCP lane's): every sender waiting for room looks again.

        Every one, not the first only: a sender may wait on this link for a frame it sends to
        several (a tree's chunk to both children), and, woken, find another of them full and wait
        there instead, sending nothing here. Had it taken the only wake-up, a sender behind it
        would sleep while this link had room, and with no frame left to leave the link, for good:
        a double binary tree runs four programs on a rank, two of which may send on one link, and
        between 8 hosts over the TCP lane a 4 MiB allreduce hung that way in most runs. A sender
        woken for nothing checks ``has_room`` and waits again (executor.py's ``_room``).
        """
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, exc: BaseException, why: str = "") -> None:
        self._on_failure(exc, why)

    # -- internals -------------------------------------------------------------------------

    def _push(self, frame: bytes, data: bool, beside: int = 0) -> None:
        """Queues a frame; ``beside``: its payload's bytes, sent through a lane instead."""
        if self._closed:
            return
        self.counters.bytes_sent += len(frame) + beside
        self.bytes_sent += len(frame) + beside
        self._frames.append((frame, data))
        if data:
            self._queued += 1
        self._wake_pump()

    def _wake_pump(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _pump(self, hello: wire.FrameHeader) -> None:
        try:
            await self._run(hello)
        except Exception as exc:
            log.exception("a link from rank %d of view %d failed", hello.sender_rank, hello.view_id)
            self._fail(exc)
            raise
        finally:
            if self.lane is not None:
                self.lane.close()
            if self.tcp is not None:
                # A clean end comes after the peer routed every frame, so every payload was read.
                self.tcp.close()
                await self.tcp.wait_closed()
            # The plane holds the link, and the callback holds the plane: break the cycle, so
            # that both (and the channel, whose poller thread waits for its last user) go at once
            # when the worker drops them, not at the next garbage collection.
            self._on_failure = _ignore


def _ignore(exc: BaseException, why: str) -> None:
    pass


class StreamLink(Link):
    """The gRPC stream to a peer: a client stream of encoded frames, HELLO first, BYE last.

    It holds a lease on the peer's channel (see links/channels.py) until it has ended.
    """

    def __init__(self, lease: Lease, counters: Counters, *, drain_timeout_s: float,
                 lane: OutboundRing | None = None, tcp: OutboundLane | None = None, window: int = SEND_WINDOW) -> None:
        super().__init__(counters, lane=lane, tcp=tcp, window=window)
        self.lease = lease
        self.address = lease.address
        self.drain_timeout_s = drain_timeout_s

    def close(self) -> None:
        super().close()
        if self._task is None:  # never started, or already ended: nothing will release it later
            self.lease.release()

    def _carrier_ended(self, _call: object) -> None:
        self._carrier_over = True
        self._wake_pump()

    def _ended(self, task: asyncio.Task[None]) -> None:
        super()._ended(task)
        self.lease.release()

    async def _run(self, hello: wire.FrameHeader) -> None:
        method = self.lease.channel.stream_unary(STREAM_METHOD,
                                                 response_deserializer=peer_pb2.StreamSummary.FromString)
        call = method(metadata=self.lease.metadata or None)
        view = hello.view_id
        # A call that ends while the link is idle (keepalive found the peer silent: a partition,
        # which no FIN or RST reports) wakes the pump, so that the failure is seen, and reported,
        # now, not at the next frame, which the collective waiting on that peer never sends.
        call.add_done_callback(self._carrier_ended)
        try:
            await call.write(wire.encode(hello))
            while (frame := await self._next()) is not None:
                await call.write(frame)
            if self._carrier_over and not self._ending:
                await call  # raises the call's error (AioRpcError, below)
            # A clean end, said in so many words: a process killed -9 also closes its socket
            # cleanly, so the peer takes an end without BYE as the sender's failure.
            # The answer comes once the peer has routed every frame.
            await call.write(wire.encode(wire.FrameHeader(kind=wire.BYE, view_id=view, sender_rank=hello.sender_rank)))
            await call.done_writing()
            async with asyncio.timeout(self.drain_timeout_s):
                await call
        except TimeoutError:
            self._fail(PeerUnavailableError(
                f"The peer at {self.address} did not confirm the end of view {view} within {self.drain_timeout_s:g} s."
            ))
        except grpc.aio.AioRpcError as exc:
            # A refusal (INVALID_ARGUMENT) says that the peer is alive and disagrees, not that it died;
            # FAILED_PRECONDITION: it requires a payload lane (RINGSERVE_PAYLOAD_LANE=tcp) that did not attach.
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._fail(PayloadLaneError(f"The peer at {self.address} refused the stream: {exc.details()}"))
                return
            refused = exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            self._fail(peer_error(exc, self.address), "" if refused else f"the stream to it failed: {exc.code().name}")
        except asyncio.InvalidStateError:  # the peer ended the call while we wrote: with what status?
            if await call.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._fail(PayloadLaneError(f"The peer at {self.address} refused the stream: {await call.details()}"))
                return
            self._fail(PeerUnavailableError(f"The stream to {self.address} closed."), "its stream closed")
        finally:
            call.cancel()
