"""The TCP payload lane: between hosts, a link's frames on a plain TCP connection beside its stream.

Why: every byte that leaves a host used to go through Python gRPC, which copies a message on
send and twice on receive, and its per-message work is in grpcio's core. ``benchmarks/
stream_floor.py`` measured bare grpc.aio, moving bytes and nothing else, no faster than
ringserve's whole allreduce over the stream (0.4-0.9x gloo), and plain TCP from the same Python
process at 1.1-2.2x gloo. The lane is that TCP connection, set up the way the shared-memory lane
(shared.py) is: offered in the stream's HELLO, bound to the stream by a token.

How:

- **One port per worker** (``payload_port``, any free port by default; laneserver.py). Each link
  (link.py) gets an ``OutboundLane`` with a random token, and its HELLO offers the port and the
  token (``PayloadLane``). The receiver, once the HELLO is verified (peers.py), dials that port at
  the host of the sender's address in the view, never at a host the HELLO names, and presents the
  token (lanein.py). The token went only to the verified receiver, over the authenticated stream,
  so it binds the lane to the stream's peer; with TLS, the lane also speaks the job's TLS.
- **The receiver dials, not the sender**: the HELLO is what the sender says to the receiver, and a
  gRPC client stream cannot answer it, so the sender offers and the receiver takes, as with the
  shared-memory ring. For a firewall it is the same: every worker's one payload port must be
  reachable from its peers.
- **Whole frames on the lane.** Once attached, every frame the link sends (DATA with its payload,
  ABORT) goes on the lane as ``[length][encoded header][payload]``, in the link's order, and the
  receiver routes it exactly as a frame of the stream (the same checks, the same inboxes); the
  stream keeps the HELLO, the frames sent before the lane attached, and the BYE, which counts
  once the lane's end marker has come, so a clean end still means every frame was routed. The
  issue that asked for the lane kept headers on the stream; measured, a gRPC message costs about
  100 us of CPU (both ends) and 150-400 us of latency per hop, which is most of a small
  collective's time and the main cost per chunk left after the payload copies, so headers follow
  their payloads. Frames of one collective are delivered by key, so the frames still on the
  stream when the lane attaches may arrive after later ones from the lane: nothing depends on
  order across keys, and a late frame of a finished collective is dropped as it always was.
- **Send straight from the array**: ``frame`` hands the kernel the header and what it takes of
  the payload now, in one ``sendmsg`` (one copy, the kernel's), and queues views of the rest,
  which a writer task sends as the kernel takes it: no copy in user space. The caller's memory
  is then the lane's until it is sent, so a collective's program waits for ``flushed`` before it
  returns (executor.py): after that, the caller may write its buffers, as it may after the
  stream's encoding or the ring's copy. Within a collective, a buffer sent on is written again
  only with data that came back through the ring after the send was received (the causality
  every ring program has), or in a later stage, which comes after a flush too. Under TLS,
  OpenSSL encrypts from the same views as it sends. The receiver reads a frame's header through
  a staging buffer and its payload with ``recv_into`` (decrypting under TLS) into a pooled
  buffer, which the reduction reads from (lanein.py).
- **Never a new way to fail.** Until the lane attaches, frames travel on the stream, as payloads
  do while the shared ring is unattached; an edge whose lane cannot connect and authenticate
  within ``payload_connect_timeout_s`` keeps the stream (``auto``), logged once per edge and
  counted (``lane_fallbacks``, in the metrics and in ``ringserve status``). With ``tcp`` the lane
  is required: such an edge fails with PayloadLaneError, naming the port. A lane that breaks
  fails the link as a broken stream does (PeerUnavailableError, the coordinator hears of the
  peer), at either end at once (the sender watches for the receiver closing it), and its
  receiver starves the collectives that wait on the sender; a damaged payload fails the frame's
  checksum as on the stream. Shared memory still wins on one host: a receiver that maps the
  ring never dials.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import deque
from collections.abc import Callable

import numpy as np

from ringserve import wire
from ringserve._proto import peer_pb2
from ringserve.errors import PayloadLaneError, PeerUnavailableError
from ringserve.observe import Counters
from ringserve.worker.dataplane.lanesock import ATTACHED, PREFIX, TOKEN_BYTES, LaneClosed, LaneSocket

WINDOW = 32  # buffers that may wait for the kernel, as the link's SEND_WINDOW frames may
_BATCH = 64  # buffers the writer hands the kernel in one sendmsg (IOV_MAX is 1024)
_FRAME_END = wire.encode(wire.FrameHeader(kind=wire.BYE))
_END = len(_FRAME_END).to_bytes(PREFIX, "little") + _FRAME_END  # the last frame on a lane that ended
OnFailure = Callable[[BaseException, str], None]


def _nothing() -> None:
    pass


def _drop(_: object) -> None:
    pass


def _ignore(exc: BaseException, why: str) -> None:
    pass


def as_bytes(payload: np.ndarray | memoryview | bytes) -> memoryview:
    """A flat byte view of a payload, without a copy when it is contiguous."""
    if isinstance(payload, np.ndarray):
        return memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class OutboundLane:
    """The sender's side of one edge's lane: offered in its link's HELLO, attached when the
    receiver presents the token on the payload port, then the way of the link's frames.

    It holds the connection's writes: ``frame`` sends what the kernel takes now and queues views
    of the rest, and a writer task (owned here, started on the first partial send) drains the
    queue. It watches the connection too: a receiver that closes it fails the link at once.
    """

    def __init__(self, counters: Counters, *, port: int, tls: bool, withdraw: Callable[[OutboundLane], None],
                 window: int = WINDOW, required_within_s: float = 0.0) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        # RINGSERVE_PAYLOAD_LANE=tcp: unless it (or the shared ring: ``spared``) attaches within this
        # long of the HELLO, the link fails with PayloadLaneError; 0: not required.
        self.required_within_s = required_within_s
        self.spared: Callable[[], bool] = lambda: False
        self._deadline: asyncio.TimerHandle | None = None
        self.port = port
        self.tls = tls
        self.counters = counters
        self.window = window
        self.conn: LaneSocket | None = None
        self.on_room: Callable[[], None] = _nothing  # a queued frame went to the kernel
        self.on_failure: OnFailure = _ignore
        self._withdraw = withdraw
        self._queue: deque[memoryview] = deque()  # bytes the kernel has not taken, oldest first
        self._wake: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        self._ended = False  # the link ended: the end marker is (or goes, once attached) on the lane
        self._queued_total = 0  # items ever queued, and of those, items sent: for flushed()
        self._sent_total = 0
        self._flushes: deque[tuple[int, asyncio.Future[None]]] = deque()

    def offer(self) -> peer_pb2.PayloadLane:
        """What goes into the HELLO (a required lane's deadline starts now)."""
        if self.required_within_s and self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(self.required_within_s, self._required)
        return peer_pb2.PayloadLane(port=self.port, token=self.token, tls=self.tls)

    def _required(self) -> None:
        """The deadline of a required lane: attached by now (or spared by the shared ring), or the
        link fails. The sender finds out by itself: the receiver's refusal of the stream may reach it
        as INTERNAL (grpc.aio reports a write that races the server's status so: grpc/grpc#36066)."""
        if self.conn is None and not self._closed and not self.spared():
            self.on_failure(PayloadLaneError(
                f"The receiver did not attach to this worker's payload lane on port {self.port} within "
                f"{self.required_within_s:g} s of the HELLO; RINGSERVE_PAYLOAD_LANE=tcp requires it (open that TCP "
                f"port to the workers, pin it with RINGSERVE_PAYLOAD_PORT, or set auto)."), "")

    @property
    def attached(self) -> bool:
        """Whether frames go on the lane now: attached, and neither ended nor closed."""
        return self.conn is not None and not self._closed and not self._ended

    def attach(self, conn: LaneSocket) -> bool:
        """Takes the connection of the receiver that presented this lane's token (laneserver.py);
        False if the lane takes none any more (closed, or attached already)."""
        if self._closed or self.conn is not None:
            return False
        self.conn = conn
        self._withdraw(self)  # a token is good once
        self._emit(ATTACHED, b"")
        if self._ended:  # the link ended before the receiver came: nothing will follow
            self._emit(_END, b"")
        conn.watch(self._receiver_closed)
        return True

    @property
    def waiting(self) -> int:
        """Buffers (of frames, and the answer) that the kernel has not taken all of yet."""
        return len(self._queue)

    @property
    def has_room(self) -> bool:
        """Whether another frame may be sent: at most ``window`` buffers wait for the kernel."""
        return len(self._queue) < self.window

    def frame(self, frame: bytes, payload: np.ndarray | memoryview | bytes = b"") -> int:
        """Sends an encoded frame (its header naming ``lane_bytes``) and its payload on the lane;
        returns the payload's size. Only while ``attached``. The payload's memory is the lane's
        until ``flushed`` returns."""
        conn = self.conn
        assert conn is not None and self.attached, "frames go on the lane only once it is attached"
        view = as_bytes(payload)
        head = len(frame).to_bytes(PREFIX, "little") + frame
        self._emit(head, view)
        self.counters.lane_bytes_sent += view.nbytes
        return view.nbytes

    def end(self) -> None:
        """The link ends: an end marker follows its last frame, so the receiver knows it has all."""
        if self._ended or self._closed:
            return
        self._ended = True
        if self.conn is not None:
            self._emit(_END, b"")

    def _emit(self, head: bytes, payload: bytes | memoryview) -> None:
        """Writes ``head`` (bytes of the lane's own) and ``payload`` after what is queued: what the
        kernel takes now (TLS encrypts it from there), the rest queued (``payload`` as a view of the
        caller's memory)."""
        conn = self.conn
        assert conn is not None
        parts = [memoryview(head), memoryview(payload)] if len(payload) else [memoryview(head)]
        if not self._queue:
            try:
                sent = conn.try_send_parts(parts)
            except OSError as exc:
                self._broken(exc)
                return
            while parts and sent >= parts[0].nbytes:
                sent -= parts.pop(0).nbytes
            if not parts:
                return
            parts[0] = parts[0][sent:]
        self._queue.extend(parts)
        self._queued_total += len(parts)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write(conn), name="ringserve-lane-writer")
            self._writer.add_done_callback(_seen)
        elif self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _write(self, conn: LaneSocket) -> None:
        """Drains the queue into the kernel as it takes it, until the lane closes."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                while not self._queue:
                    self._wake = loop.create_future()
                    await self._wake
                sent = conn.try_send_parts(list(itertools.islice(self._queue, _BATCH)))
                done = 0
                while self._queue and sent >= self._queue[0].nbytes:
                    sent -= self._queue.popleft().nbytes
                    done += 1
                if self._queue and sent:
                    self._queue[0] = self._queue[0][sent:]
                if done:
                    self._sent_total += done
                    while self._flushes and self._flushes[0][0] <= self._sent_total:
                        _resolve(self._flushes.popleft()[1])
                    self.on_room()
                if self._queue:
                    await conn.writable()
        except OSError as exc:  # LaneClosed too: the connection went under us
            self._broken(exc)

    async def flushed(self) -> None:
        """Returns once every frame sent so far is in the kernel (or the lane has ended: a lane
        that broke fails its link, and the collective with it), so that its memory is free."""
        if self._sent_total >= self._queued_total or self._closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._flushes.append((self._queued_total, waiter))
        await waiter

    def _receiver_closed(self) -> None:
        if not self._ended:  # after the end marker, the receiver closes when it has read it
            self._broken(LaneClosed("the receiver closed it"))

    def _broken(self, exc: BaseException) -> None:
        if self._closed:
            return
        conn = self.conn
        peer = conn.peer if conn is not None else "?"
        self.on_failure(PeerUnavailableError(f"The payload lane to {peer} (port {self.port}) broke: {exc}."),
                        "its payload lane broke")

    def close(self) -> None:
        """Stops: the token is withdrawn, the writer cancelled, the connection closed."""
        if self._closed:
            return
        self._closed = True
        self._withdraw(self)
        if self._deadline is not None:
            self._deadline.cancel()
        if self._writer is not None:
            self._writer.cancel()
        if self.conn is not None:
            self.conn.close()
        self._queue.clear()
        while self._flushes:
            _resolve(self._flushes.popleft()[1])
        self.on_room = _nothing
        self.on_failure = _ignore

    async def wait_closed(self) -> None:
        """Waits for the writer to end (after close)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            await asyncio.wait([writer])


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _seen(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # reported through on_failure; not raised twice
