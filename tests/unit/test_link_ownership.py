"""Who owns what on the data plane: a link's queue is bounded, a plane's close honours its
caller's deadline across planes, and shared-memory rings are unmapped when closed.

Planes here are linked by in-memory links (tests/ringsim.py); nothing opens a socket.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
import weakref

import numpy as np
import pytest
from ringsim import make_ring, shut

from ringserve import wire
from ringserve.errors import CollectiveTimeoutError, RingChangedError
from ringserve.observe import Counters
from ringserve.testing.memlink import MemoryLink
from ringserve.worker.dataplane.links import shared
from ringserve.worker.dataplane.links.shared import InboundRing, OutboundRing
from ringserve.worker.dataplane.links.stream import SEND_WINDOW, Link
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.session import Place
from ringserve.worker.ops import collectives

needs_shared = pytest.mark.skipif(not shared.supported(), reason="shared rings need Linux memfds on x86-64")


def pair(window: int = SEND_WINDOW) -> tuple[Plane, Plane, MemoryLink]:
    """Two planes of one view; rank 0's link to rank 1 is returned too."""
    planes: list[Plane] = []
    counters = [Counters(), Counters()]
    link = MemoryLink(lambda: planes[1], counters[0], window=window)
    back = MemoryLink(lambda: planes[0], counters[1], window=window)
    for r, lk in enumerate((link, back)):
        place = Place(view_id=1, rank=r, size=2, addresses=("a", "b"))
        planes.append(Plane(place, counters[r], 1.0, connect=lambda to, lk=lk: lk))
    return planes[0], planes[1], link


def next_link(plane: Plane) -> Link:
    """The plane's link to its successor in the view."""
    link = plane._links[plane.ring.next]
    return link


def data_header(chunk: int) -> wire.FrameHeader:
    return wire.FrameHeader(kind=wire.DATA, view_id=1, sender_rank=0, op_key="x#1", step=0, chunk=chunk)


async def test_a_link_queues_at_most_its_window_of_data_frames_and_lets_the_sender_wait_for_room() -> None:
    a, b, link = pair(window=3)
    link.pause()  # the peer takes nothing: frames pile up in the link
    for c in range(3):
        assert link.has_room
        link.send(data_header(c), np.zeros(1000, dtype=np.uint8))
    await asyncio.sleep(0.05)  # one frame has left the queue and is held by the paused pump
    assert link.has_room
    link.send(data_header(3), np.zeros(1000, dtype=np.uint8))
    assert not link.has_room
    # An abort is never held back by a full queue: it comes from the receive path.
    link.control(wire.encode(wire.FrameHeader(kind=wire.ABORT, view_id=1, sender_rank=0, op_key="y#1")))
    waiter = asyncio.ensure_future(link.room())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    link.resume()
    await asyncio.wait_for(waiter, 1)
    assert link.has_room
    await shut([a, b])


async def test_a_collective_with_a_window_of_one_frame_still_completes_and_never_queues_more() -> None:
    rng = random.Random(1)
    planes = make_ring(3, rng)
    peaks = [0, 0, 0]
    for p in planes:
        next_link(p).window = 1
    original = [next_link(p).send for p in planes]
    for r, p in enumerate(planes):
        def send(header: wire.FrameHeader, payload: object, whole: bytes = b"", *, volatile: bool = False,
                 r: int = r, p: Plane = p) -> None:
            original[r](header, payload, whole, volatile=volatile)  # type: ignore[arg-type]
            peaks[r] = max(peaks[r], next_link(p)._queued)
        next_link(p).send = send  # type: ignore[method-assign]
    x = np.arange(30000, dtype=np.float32)
    outs = await asyncio.gather(*(collectives.allreduce(p.session(), x, op="sum", name=None, chunk_bytes=1024,
                                                        timeout_s=10) for p in planes))
    for out in outs:
        np.testing.assert_array_equal(out, x * 3)
    assert peaks == [1, 1, 1]
    await shut(planes)


async def test_close_waits_on_every_retired_plane_within_one_deadline_and_is_not_swallowed() -> None:
    # Three planes whose peers hang: their links never end. One deadline must cover the waits
    # on all three (it once covered only the first, and the rest waited without limit).
    pairs = [pair() for _ in range(3)]
    for a, b, link in pairs:
        link.pause()
        link.send(data_header(0), b"x")
        for s in (a, b):
            s.retire(RingChangedError(1, 2, "test"))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            for a, b, _ in pairs:
                await a.wait_closed()
                await b.wait_closed()
    assert time.monotonic() - started < 1.0
    # The deadline cancelled the waiter, not the links: they are still running, and end once freed.
    assert not any(a.drained for a, _, _ in pairs)
    for _, _, link in pairs:
        link.resume()
    async with asyncio.timeout(2):
        for a, b, _ in pairs:
            await a.wait_closed()
            await b.wait_closed()


@needs_shared
async def test_a_link_unmaps_its_shared_ring_when_it_closes_and_the_receiver_once_payloads_are_dropped() -> None:
    ring = OutboundRing(slots=2, slot_bytes=64)
    hello = wire.FrameHeader(kind=wire.HELLO, view_id=1, sender_rank=0)
    hello.shared_ring.CopyFrom(ring.offer())
    inbound = InboundRing.attach(hello.shared_ring)
    assert inbound is not None and ring.attached
    slot = ring.put(np.arange(8, dtype=np.uint8))
    assert slot is not None
    header = wire.FrameHeader(kind=wire.DATA, shm_slot=slot, shm_bytes=8)
    view = inbound.payload(header)
    ring.close()
    assert ring.closed
    inbound.close()
    assert not inbound.closed  # a collective still holds a payload: the mapping stays
    assert bytes(view) == bytes(range(8))
    del view
    await asyncio.sleep(0)  # unmapped just after the last view goes
    assert inbound.closed


@needs_shared
async def test_sessions_that_shared_memory_leave_no_mapping_behind() -> None:
    rng = random.Random(2)
    planes = make_ring(3, rng, lanes=True, lane_slots=4, slot_bytes=256)
    lanes = [next_link(p).lane for p in planes]
    x = np.arange(200, dtype=np.float32)
    await asyncio.gather(*(collectives.allreduce(p.session(), x, op="sum", name=None, chunk_bytes=256, timeout_s=10)
                           for p in planes))
    assert sum(p.counters.shared_bytes_sent for p in planes) > 0
    await shut(planes)
    assert all(lane is not None and lane.closed for lane in lanes)


class Sink(Link):
    """A link whose peer takes every frame at once."""

    async def _run(self, hello: wire.FrameHeader) -> None:
        while await self._next() is not None:
            pass


@pytest.mark.parametrize("how", ["retired", "closed"])
async def test_a_plane_and_its_link_are_freed_when_dropped_without_waiting_for_the_garbage_collector(how: str) -> None:
    # The worker's gRPC poller thread stays until the last channel is freed: a plane and link
    # kept alive by a reference cycle kept it running after shutdown.
    gc.disable()
    try:
        counters = Counters()
        plane = Plane(Place(view_id=1, rank=0, size=2, addresses=("a", "b")), counters, 1.0,
                      connect=lambda to: Sink(counters))
        x = np.ones(4, dtype=np.float32)
        with pytest.raises(CollectiveTimeoutError):  # a session used, and its collective finished
            await collectives.allreduce(plane.session(), x, op="sum", name=None, chunk_bytes=8, timeout_s=0.05)
        if how == "retired":
            plane.retire(RingChangedError(1, 2, "test"))
        else:
            plane.close(RingChangedError(1, 2, "test"))
        await plane.wait_closed()
        refs = [weakref.ref(plane), weakref.ref(next_link(plane))]
        del plane
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


async def test_room_wakes_every_sender_waiting_on_a_link_so_none_sleeps_while_it_has_room() -> None:
    a, b, link = pair(window=1)
    link.pause()
    link.send(data_header(0), np.zeros(1000, dtype=np.uint8))
    await asyncio.sleep(0.05)  # held by the paused pump
    link.send(data_header(1), np.zeros(1000, dtype=np.uint8))
    assert not link.has_room
    # The first waits for a frame to two links (a tree's chunk to both children): once woken it
    # finds the other full and sends nothing here. The second has a frame for this link only.
    first = asyncio.ensure_future(link.room())
    second = asyncio.ensure_future(link.room())
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()
    link.resume()
    await asyncio.wait_for(first, 1)
    await asyncio.sleep(0.05)  # frame 1 has left too: the link is idle, no frame will leave it again
    assert link.has_room
    await asyncio.wait_for(second, 1)  # woken by the same frame leaving, not by one that never comes
    await shut([a, b])
