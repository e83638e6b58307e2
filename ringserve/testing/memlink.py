"""The in-memory link: frames to a Plane in this process, for tests and the ring simulator.

It moves the very bytes a StreamLink would write (encoded frames, payloads in the shared-memory
lane if it has one), in order, into the peer's ``on_frame``, as the peer server does with a
stream: the peer accepts the HELLO first, and hears when the link ends, cleanly or not. With a
TCP payload lane (``tcp``, and ``dial`` to make the peer's end of it: see tests/ringsim.py), frames
go on that real lane once it attaches, as between hosts, while the rest keep to the link. Each frame
waits a random number of loop turns first (from a seeded generator), so that N ranks linked in a
ring run under many interleavings while each link keeps its order, as a stream does. A frame the
peer refuses (a ProtocolError) fails both ends, as a refused stream does: the sender's link fails
with it, and the peer's collectives that wait on this sender starve.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from ringserve import wire
from ringserve._proto import peer_pb2
from ringserve.errors import ProtocolError
from ringserve.observe import Counters
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.tcp.inbound import InboundLane
from ringserve.worker.dataplane.lanes.tcp.outbound import OutboundLane
from ringserve.worker.dataplane.links.shared import InboundRing, OutboundRing
from ringserve.worker.dataplane.links.stream import SEND_WINDOW, Link
from ringserve.worker.dataplane.plane import Plane

# Makes the receiving end of a TCP payload lane that a HELLO offers: (offer, the peer, the sender).
Dial = Callable[[peer_pb2.PayloadLane, Plane, int], InboundLane]


class MemoryLink(Link):
    """A link to ``peer()``, a Plane of the same loop (looked up when the link opens)."""

    def __init__(self, peer: Callable[[], Plane], counters: Counters, *, rng: random.Random | None = None,
                 max_delay: int = 0, lane: OutboundRing | None = None, window: int = SEND_WINDOW,
                 tcp: OutboundLane | None = None, dial: Dial | None = None) -> None:
        super().__init__(counters, lane=lane, tcp=tcp, window=window)
        self._dial = dial
        self._peer = peer
        self._rng = rng or random.Random(0)
        self._max_delay = max_delay
        self._flowing = asyncio.Event()  # clear: frames stop moving (a peer that hangs)
        self._flowing.set()

    def pause(self) -> None:
        """Stops frames moving, as a peer that hangs would."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def _run(self, hello: wire.FrameHeader) -> None:
        peer, sender = self._peer(), hello.sender_rank
        try:
            peer.accept(hello)
        except ProtocolError as exc:
            self._fail(exc)
            return
        inbound = InboundRing.attach(hello.shared_ring) if hello.HasField("shared_ring") else None
        tcp = (self._dial(hello.payload_lane, peer, sender)
               if self._dial is not None and inbound is None and hello.HasField("payload_lane") else None)
        clean = False
        try:
            while (raw := await self._next()) is not None:
                for _ in range(self._rng.randint(0, self._max_delay)):
                    await asyncio.sleep(0)
                await self._flowing.wait()
                header, payload = wire.decode(raw)
                if header.HasField("shm_slot"):
                    if inbound is None:
                        raise ProtocolError("A frame names a slot of a shared ring that this link never set up.")
                    payload = inbound.payload(header)
                peer.on_frame(Received(header, payload, raw), sender)
                del payload, header
            clean = tcp is None or await tcp.finished(5.0)  # the lane's frames are routed too
        except ProtocolError as exc:
            self._fail(exc)
        finally:
            if tcp is not None:
                tcp.close()
            peer.stream_ended(sender, clean)
            if inbound is not None:
                inbound.close()
