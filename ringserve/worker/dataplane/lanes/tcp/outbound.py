"""The TCP payload lane: between hosts, a link's frames on a plain TCP connection beside its stream.

Why: every byte that leaves a host used to go through Python gRPC, which copies a message on
send and twice on receive, and its per-message work is in grpcio's core. ``benchmarks/
stream_floor.py`` measured bare grpc.aio, moving bytes and nothing else, no faster than
ringserve's whole allreduce over the stream (0.4-0.9x gloo), and plain TCP from the same Python
process at 1.1-2.2x gloo. The lane is that TCP connection, set up the way the shared-memory lane
(links/shared.py) is: offered in the stream's HELLO, bound to the stream by a token.

How:

- **One port per worker** (``payload_port``, any free port by default; lanes/tcp/server.py). Each link
  (links/stream.py) gets an ``OutboundLane`` with a random token, and its HELLO offers the port and the
  token (``PayloadLane``). The receiver, once the HELLO is verified (peers.py), dials that port at
  the host of the sender's address in the view, never at a host the HELLO names, and presents the
  token (lanes/tcp/inbound.py). The token went only to the verified receiver, over the authenticated stream,
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
  returns (programs/executor.py): after that, the caller may write its buffers, as it may after the
  stream's encoding or the ring's copy. Within a collective, a buffer sent on is written again
  only with data that came back through the ring after the send was received (the causality
  every ring program has), or in a later stage, which comes after a flush too. Under TLS,
  the writer seals from the same views into records of its own and sends those (lanes/tcp/seal.py). The receiver reads a frame's header through
  a staging buffer and its payload with ``recv_into`` (under TLS, a sealed record opened straight
  into it) into a pooled buffer, which the reduction reads from (lanes/tcp/inbound.py).
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
import secrets
from collections import deque
from collections.abc import Callable

import numpy as np

from ringserve import wire
from ringserve._proto import peer_pb2
from ringserve.errors import PayloadLaneError, PeerUnavailableError
from ringserve.observe import Counters
from ringserve.worker.dataplane.lanes.tcp.seal import Sealer
from ringserve.worker.dataplane.lanes.tcp.sockets import ATTACHED, PREFIX, TOKEN_BYTES, LaneClosed, LaneSocket
from ringserve.worker.dataplane.lanes.tcp.threads import Writer

WINDOW = 32  # buffers that may wait for the kernel, as the link's SEND_WINDOW frames may
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

    Its writes are a ``Writer``'s (lanes/tcp/threads.py): a thread that sends the queued buffers in order
    while the loop goes on. The lane counts what is queued and what is out, for ``flushed`` and
    for room, and watches the connection: a receiver that closes it fails the link at once.
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
        self.peer = "?"  # the receiver's address, once attached
        self.on_room: Callable[[], None] = _nothing  # queued buffers went to the kernel
        self.on_failure: OnFailure = _ignore
        self._withdraw = withdraw
        self._writer: Writer | None = None
        self._closed = False
        self._ended = False  # the link ended: the end marker is (or goes, once attached) on the lane
        self._queued_total = 0  # buffers ever queued for the writer, and of those, buffers it sent
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

    def attach(self, conn: LaneSocket, *, key: bytes | None = None) -> bool:
        """Takes the connection of the receiver that presented this lane's token (lanes/tcp/server.py);
        False if the lane takes none any more (closed, or attached already). With ``key`` (a TLS
        lane, which sent its answer and the key in its session and left TLS), its frames go sealed
        under that key (lanes/tcp/seal.py); without, it answers here, in plaintext."""
        if self._closed or self.conn is not None:
            return False
        self.conn = conn
        self.peer = conn.peer  # named in a break's error, when the socket may be gone
        self._withdraw(self)  # a token is good once
        self._writer = Writer(conn.sock, sealer=Sealer(key) if key is not None else None,
                              loop=asyncio.get_running_loop(), on_progress=self._progress, on_error=self._broken)
        if key is None:
            self._emit(ATTACHED, b"")
        if self._ended:  # the link ended before the receiver came: nothing will follow
            self._emit(_END, b"")
        conn.watch(self._receiver_closed)
        return True

    @property
    def waiting(self) -> int:
        """Buffers (of frames, and the answer) that the kernel has not taken all of yet."""
        return self._queued_total - self._sent_total

    @property
    def has_room(self) -> bool:
        """Whether another frame may be sent: at most ``window`` buffers wait for the kernel."""
        return self._queued_total - self._sent_total < self.window

    def frame(self, frame: bytes, payload: np.ndarray | memoryview | bytes = b"") -> int:
        """Sends an encoded frame (its header naming ``lane_bytes``) and its payload on the lane;
        returns the payload's size. Only while ``attached``. The payload's memory is the lane's
        until ``flushed`` returns."""
        assert self.attached, "frames go on the lane only once it is attached"
        view = as_bytes(payload)
        self._emit(len(frame).to_bytes(PREFIX, "little") + frame, view)
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
        """Hands ``head`` (bytes of the lane's own) and ``payload`` (a view of the caller's memory)
        to the writer, after what is queued."""
        assert self._writer is not None
        parts = [memoryview(head), memoryview(payload)] if len(payload) else [memoryview(head)]
        self._queued_total += len(parts) - self._writer.put(parts)

    def _progress(self, sent: int) -> None:
        """The writer has sent ``sent`` buffers in all: their memory is free, and there is room."""
        self._sent_total = sent
        while self._flushes and self._flushes[0][0] <= sent:
            _resolve(self._flushes.popleft()[1])
        self.on_room()

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
        self.on_failure(PeerUnavailableError(f"The payload lane to {self.peer} (port {self.port}) broke: {exc}."),
                        "its payload lane broke")

    def close(self) -> None:
        """Stops: the token is withdrawn, the writer stopped, the connection closed once it is out."""
        if self._closed:
            return
        self._closed = True
        self._withdraw(self)
        if self._deadline is not None:
            self._deadline.cancel()
        conn, writer = self.conn, self._writer
        if writer is not None:
            writer.close()
            if conn is not None:
                writer.done.add_done_callback(lambda _: conn.close())  # the thread is out of the socket
        elif conn is not None:
            conn.close()
        while self._flushes:
            _resolve(self._flushes.popleft()[1])
        self.on_room = _nothing
        self.on_failure = _ignore

    async def wait_closed(self) -> None:
        """Waits for the writer's thread to end (after close)."""
        if self._writer is not None:
            await asyncio.wait([self._writer.done])


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
