"""The peer server's servicer: the streams other workers open to this one, and ``Peer/Latest``.

A peer stream opens with a HELLO that names a view and the sender's rank in it. The stream is
*verified* once that view's plane here accepts the sender (``Plane.accept``): a rank of the view,
not this worker's own. Only then are its frames read into the plane, routed by collective key,
each collective checking that its frames come from the rank that precedes this one in its ring
(``Plane.on_frame``: a frame any other stream brings is refused, and so is its stream); and only
then is a shared-memory ring it offers mapped (see links/shared.py), or, where there is none, its TCP
payload lane dialled (see lanes/tcp/outbound.py, lanes/tcp/inbound.py): once that lane is attached, the sender's frames
come on it, read and routed by the lane as the stream's are, with the same checks. So any rank of a view can stream to
any other, as sub-rings and point-to-point programs need, while the bounds of gate.py hold for the
streams that have proved nothing.

A HELLO for a view not installed here yet (the sender heard of it first) holds its stream
unverified, reading nothing more, until the view comes: gRPC's flow control then holds the sender's
frames, bounded by its window, instead of a buffer here. A HELLO for a past view, or for one
without this worker, is never verified: its frames are dropped and counted, and the gate ends it
at its deadline.

When a verified stream ends, its plane hears of it (``Plane.stream_ended``): the collectives that
wait on that sender starve, and a stream that broke (no BYE) is reported to the coordinator. A
stream's BYE counts once its lane has delivered every frame (the lane's end marker). A payload
lane that breaks starves the collectives that wait on its sender and is reported, as a broken
stream is; its sender's link fails as it sees the lane close. Where the lane is required
(RINGSERVE_PAYLOAD_LANE=tcp) and does not attach, the stream is refused with FAILED_PRECONDITION
and the sender's collectives starve with PayloadLaneError.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from ringserve import wire
from ringserve._proto import peer_pb2
from ringserve.config import WorkerConfig
from ringserve.errors import PayloadLaneError, ProtocolError
from ringserve.observe import Counters
from ringserve.ring import predecessor
from ringserve.worker.dataplane.gate import Pass, StreamGate
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.tcp.inbound import InboundLane
from ringserve.worker.dataplane.links.shared import InboundRing
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.registry import Planes

log = logging.getLogger("ringserve.worker")

PEER_SERVICE = "ringserve.v1.Peer"

Report = Callable[[int, int, str], None]  # (view, suspect rank, why)


class PeerServicer:
    """Serves ``Peer/Stream`` and ``Peer/Latest`` for one worker's planes."""

    def __init__(self, config: WorkerConfig, counters: Counters, planes: Planes, *, report: Report,
                 tag: Callable[[], str]) -> None:
        self.config = config
        self.counters = counters
        self.planes = planes
        self.gate = StreamGate(cap=config.max_unverified_streams, deadline_s=config.peer_hello_timeout_s)
        self._report = report
        self._tag = tag
        # Verified streams open from a (view, sender rank): a heartbeat says whether the ring's
        # link into us is up.
        self._inbound: dict[tuple[int, int], int] = {}
        # Called when the stream from the current view's ring predecessor first reaches us: the
        # lifeline heartbeats at once, so that a coordinator checking the ring hears it now.
        self.on_linked: Callable[[], None] = lambda: None
        self._rings: set[InboundRing] = set()  # shared rings mapped by streams still open
        self._handlers: set[asyncio.Task] = set()  # the tasks serving streams, until they end

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler to add to the peer server."""
        stream = grpc.stream_unary_rpc_method_handler(
            self.stream, response_serializer=peer_pb2.StreamSummary.SerializeToString
        )
        latest = grpc.unary_unary_rpc_method_handler(
            self.latest, request_deserializer=peer_pb2.LatestRequest.FromString,
            response_serializer=peer_pb2.LatestView.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(PEER_SERVICE, {"Stream": stream, "Latest": latest})

    def linked_view(self) -> int:
        """The current view if the stream from its ring predecessor has reached us, else 0."""
        plane = self.planes.current
        if plane is None:
            return 0
        place = plane.place
        if place.size == 1 or (place.view_id, predecessor(place.rank, place.size)) in self._inbound:
            return place.view_id
        return 0

    def serving(self) -> set[asyncio.Task]:
        """The tasks serving streams into this worker now."""
        return set(self._handlers)

    async def wait_handlers(self, timeout_s: float) -> None:
        """Waits, up to ``timeout_s``, for the tasks serving streams to end. The server's stop
        cancels the calls still open but can return before their tasks have run their ends."""
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=timeout_s)

    def close(self) -> None:
        """Unmaps every shared ring still mapped (the server has stopped: no stream reads them)."""
        for ring in list(self._rings):
            ring.close()
        self._rings.clear()

    async def latest(self, request: peer_pb2.LatestRequest, context: grpc.aio.ServicerContext) -> peer_pb2.LatestView:
        return peer_pb2.LatestView(view_id=self.planes.latest_view, worker_id=self.planes.state.worker_id)

    async def stream(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> peer_pb2.StreamSummary:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        # Streams that have proved nothing are bounded in number and in time (see gate.py).
        admitted = self.gate.enter()
        frames = 0
        ring: InboundRing | None = None
        lane: InboundLane | None = None
        lane_broke: list[BaseException] = []
        plane: Plane | None = None
        clean = False
        try:
            async with asyncio.timeout(self.gate.deadline_s) as admitted.deadline:
                raws = aiter(request_iterator)
                async for raw in raws:
                    hello, _ = wire.decode(raw)
                    frames += 1
                    if hello.kind != wire.HELLO:
                        raise ProtocolError("A peer stream must open with a HELLO frame.")
                    break
                else:
                    return peer_pb2.StreamSummary(frames=0)
                admitted.hello = hello
                plane = await self._verify(admitted)
                if plane is not None:
                    self._count(hello, +1)
                    if hello.HasField("shared_ring") and self.config.shared_memory:
                        ring = await self._attach(hello.shared_ring)
                        if ring is not None:
                            self._rings.add(ring)
                    if ring is None:
                        lane = await self._dial(hello, plane, lane_broke)
                sender = hello.sender_rank
                async for raw in raws:
                    header, payload = wire.decode(raw)
                    frames += 1
                    if header.view_id != hello.view_id:
                        raise ProtocolError(
                            f"A stream opened for view {hello.view_id} carried a frame of view {header.view_id}."
                        )
                    if header.kind == wire.BYE:
                        clean = True
                        continue
                    if header.HasField("shm_slot"):
                        if ring is None:
                            raise ProtocolError("A frame names a slot of a shared ring that this stream never set up.")
                        payload = ring.payload(header)
                    elif header.lane_bytes:
                        raise ProtocolError("A frame on the stream names bytes on a payload lane.")
                    if plane is None:
                        self.counters.frames_rejected += 1
                        continue
                    plane.on_frame(Received(header, payload, raw), sender)
                    # Not held here until the next frame: a view of the last payload would keep its
                    # slot of the shared ring in use, and an idle ring would never give its pages back.
                    del payload
                if clean and lane is not None:  # the BYE counts once the lane has brought every frame
                    clean = await lane.finished(self.config.drain_timeout_s)
                    frames += lane.frames
        except ProtocolError as exc:
            log.warning("%s: rejected a peer stream: %s", self._tag(), exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError:
            await context.abort(*self._timed_out(admitted))
        except PayloadLaneError as exc:  # required, and not there: the sender's collectives fail with it
            log.error("%s: %s", self._tag(), exc)
            if plane is not None and admitted.hello is not None:
                plane.starve((admitted.hello.sender_rank,), exc)
            # Hold the stream, unread, until the sender's own deadline has failed its link with the
            # same error (lanes/tcp/outbound.py): refused at once, a sender still writing could see INTERNAL.
            await asyncio.sleep(self.planes.lanes.required_within_s + self.config.rpc_timeout_s)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            if lane is not None:
                lane.close()
            if ring is not None:
                ring.close()  # unmapped once the collectives are done with its payloads
                self._rings.discard(ring)
            self.gate.leave(admitted)
            # Only a verified stream's end says anything about the view.
            if plane is not None and admitted.hello is not None:
                hello = admitted.hello
                self._count(hello, -1)
                if plane.stream_ended(hello.sender_rank, clean) and not lane_broke:  # (reported then)
                    self._report(hello.view_id, hello.sender_rank, f"its stream to rank {plane.place.rank} broke")
            if lane is not None:
                await lane.wait_closed()  # last: a second cancellation here loses nothing above
        return peer_pb2.StreamSummary(frames=frames)

    async def _dial(self, hello: wire.FrameHeader, plane: Plane, broke: list[BaseException]) -> InboundLane | None:
        """The payload lane the HELLO offers, being dialled (None: this stream keeps its frames).
        Its frames go to ``plane`` as the stream's do; ``broke`` gets the error if it breaks. Where
        the lane is required (RINGSERVE_PAYLOAD_LANE=tcp), it waits until the lane attaches.

        Raises:
            PayloadLaneError: the lane is required and does not attach (or is not offered).
        """
        lanes = self.planes.lanes
        sender, view = hello.sender_rank, hello.view_id
        address = plane.place.addresses[sender]
        edge = f"rank {sender} ({address}) -> rank {plane.place.rank} of view {plane.view_id}"
        if not hello.HasField("payload_lane"):
            if lanes.mode == "tcp":
                lanes.fell_back(edge, "its HELLO offers no payload lane (is RINGSERVE_PAYLOAD_LANE off there?)",
                                peer=address)
            return None

        def on_frame(frame: Received) -> None:
            if frame.header.view_id != view or frame.header.kind == wire.HELLO:
                raise ProtocolError(f"The payload lane of a stream of view {view} carried a frame of kind "
                                    f"{frame.header.kind} of view {frame.header.view_id}.")
            plane.on_frame(frame, sender)

        def on_broken(exc: BaseException) -> None:
            broke.append(exc)
            plane.starve((sender,), exc)
            log.warning("%s: %s", self._tag(), exc)
            if plane.retired is None and plane.error is None and not isinstance(exc, ProtocolError):
                self._report(view, sender, f"its payload lane to rank {plane.place.rank} broke")

        lane = lanes.inbound(hello.payload_lane, address=address, edge=edge, on_frame=on_frame, on_broken=on_broken)
        if lane is not None and lanes.mode == "tcp":
            try:
                await lane.ready()
            except ConnectionError as exc:
                lane.close()
                lanes.fell_back(f"{edge} (port {lane.where})", str(exc), peer=address)
        return lane

    async def _attach(self, offer: peer_pb2.SharedRing) -> InboundRing | None:
        """The predecessor's shared ring, mapped; through its ring server in the shared directory
        (a blocking exchange, on a thread, under connect_timeout_s), or through /proc."""
        cfg = self.config
        if offer.socket and cfg.shared_dir:
            return await asyncio.to_thread(InboundRing.attach, offer, shared_dir=cfg.shared_dir,
                                           timeout_s=cfg.connect_timeout_s)
        return InboundRing.attach(offer)

    async def _verify(self, admitted: Pass) -> Plane | None:
        """The plane that accepts the stream's sender, once its view is installed here; None if
        that view is past, or has no place for this worker (the stream stays unverified).

        Raises:
            ProtocolError: the plane refuses the sender (see Plane.accept).
        """
        hello = admitted.hello
        assert hello is not None
        while True:
            plane = self.planes.plane_of(hello.view_id)
            if plane is not None:
                plane.accept(hello)
                self.gate.verify(admitted)
                return plane
            if hello.view_id <= self.planes.latest_view or self.planes.state.stopped:
                return None
            await self.planes.changed()  # the gate's deadline bounds the wait

    def _timed_out(self, admitted: Pass) -> tuple[grpc.StatusCode, str]:
        if admitted.evicted:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"The peer server of {self._tag()} holds {self.gate.cap} streams whose HELLO is not verified "
                "(max_unverified_streams); this one, the oldest, was ended to make room."
            )
        hello = admitted.hello
        what = "sent no HELLO" if hello is None else (
            f"sent a HELLO (view {hello.view_id}, rank {hello.sender_rank}) that no view of this worker verified"
        )
        return grpc.StatusCode.DEADLINE_EXCEEDED, (
            f"The peer stream {what} within {self.gate.deadline_s:g} s (peer_hello_timeout_s) and was ended."
        )

    def _count(self, hello: wire.FrameHeader, delta: int) -> None:
        link = (hello.view_id, hello.sender_rank)
        before = self.linked_view()
        count = self._inbound.get(link, 0) + delta
        if count > 0:
            self._inbound[link] = count
        else:
            self._inbound.pop(link, None)
        if not before and self.linked_view():
            self.on_linked()
