"""The payload port on its own (lanes/tcp/server.py, lanes/tcp/outbound.py, lanes/tcp/inbound.py): a real listener on
127.0.0.1:0, the sender's lanes it holds, and receivers that dial it, over real sockets.

What must hold: the holder of a lane's token attaches and gets every payload, in order, exact;
the sender's memory is read until ``flushed`` and free after; the end marker tells the receiver it
has every frame, and a receiver that closes the lane fails the sender's; and nothing without a valid token
(garbage, silence, a wrong or spent token) reaches a lane or stays open past its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from ringserve import wire
from ringserve.observe import Counters
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.tcp.inbound import InboundLane, LaneBuffers
from ringserve.worker.dataplane.lanes.tcp.outbound import OutboundLane
from ringserve.worker.dataplane.lanes.tcp.server import LaneServer
from ringserve.worker.dataplane.lanes.tcp.sockets import ATTACHED, MAGIC

pytestmark = pytest.mark.timeout(30)

MiB = 1 << 20


@dataclass
class Port:
    server: LaneServer
    counters: Counters
    fallbacks: list[str] = field(default_factory=list)
    lanes: list[OutboundLane] = field(default_factory=list)
    inbound: list[InboundLane] = field(default_factory=list)
    frames: asyncio.Queue[Received] = field(default_factory=asyncio.Queue)
    broken: list[BaseException] = field(default_factory=list)

    def offer(self) -> OutboundLane:
        lane = OutboundLane(self.counters, port=self.server.port, tls=self.server.tls, withdraw=self.server.withdraw)
        lane.on_failure = lambda exc, why: self.broken.append(exc)
        self.server.offer(lane)
        self.lanes.append(lane)
        return lane

    def dial(self, lane: OutboundLane, *, port: int | None = None, token: bytes | None = None,
             timeout_s: float = 2.0) -> InboundLane:
        inbound = InboundLane(host="127.0.0.1", port=port or self.server.port, token=token or lane.token, context=None,
                              server_name="127.0.0.1", timeout_s=timeout_s, buffers=LaneBuffers(MiB),
                              max_bytes=4 * MiB, fell_back=self.fallbacks.append, attached_late=lambda: None,
                              on_frame=self.frames.put_nowait, on_broken=self.broken.append)
        self.inbound.append(inbound)
        return inbound


def send(lane: OutboundLane, payload: np.ndarray, chunk: int = 0) -> int:
    """A DATA frame carrying ``payload`` on the lane, as Link.send makes it."""
    header = wire.FrameHeader(kind=wire.DATA, view_id=1, chunk=chunk, lane_bytes=payload.nbytes)
    return lane.frame(wire.encode(header), payload)


@pytest.fixture
async def port() -> AsyncIterator[Port]:
    counters = Counters()
    server = LaneServer("127.0.0.1", 0, context=None, hello_timeout_s=0.5, cap=4, counters=counters,
                        tag=lambda: "test worker")
    made = Port(server, counters)
    try:
        yield made
    finally:
        for inbound in made.inbound:
            inbound.close()
            await inbound.wait_closed()
        for lane in made.lanes:
            lane.close()
            await lane.wait_closed()
        await server.close()


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.01)


async def test_the_holder_of_the_token_attaches_and_gets_every_payload_in_order_and_exact(port: Port) -> None:
    lane = port.offer()
    inbound = port.dial(lane)
    await until(lambda: lane.attached)
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 17, 300_000, 2 * MiB, 5, MiB + 3)]
    assert [send(lane, p, k) for k, p in enumerate(payloads)] == [p.nbytes for p in payloads]
    lane.frame(wire.encode(wire.FrameHeader(kind=wire.ABORT, view_id=1, reason="a control frame")))
    got = [await port.frames.get() for _ in range(len(payloads) + 1)]
    assert [f.header.chunk for f in got[:-1]] == list(range(len(payloads)))
    assert [bytes(f.payload) for f in got[:-1]] == [p.tobytes() for p in payloads]
    assert got[-1].header.kind == wire.ABORT and got[-1].payload.nbytes == 0
    assert port.counters.lane_bytes_sent == sum(p.nbytes for p in payloads)
    assert port.fallbacks == [] and inbound.attached and inbound.frames == len(payloads) + 1


async def test_the_end_marker_tells_the_receiver_it_has_every_frame(port: Port) -> None:
    lane = port.offer()
    inbound = port.dial(lane)
    await until(lambda: lane.attached)
    send(lane, np.arange(500_000, dtype=np.int32))
    lane.end()
    assert not lane.attached  # nothing more goes on it
    assert await inbound.finished(5) is True
    assert (await port.frames.get()).payload.nbytes == 2_000_000
    lane.close()  # the receiver may close first, or the sender: neither is a failure after the end
    assert port.broken == []


async def test_a_link_that_ended_before_its_receiver_came_answers_with_the_end_marker(port: Port) -> None:
    lane = port.offer()
    lane.end()
    inbound = port.dial(lane)
    assert await inbound.finished(5) is True and port.frames.empty()


async def test_a_receiver_that_closes_the_lane_fails_the_senders_at_once(port: Port) -> None:
    lane = port.offer()
    inbound = port.dial(lane)
    await until(lambda: lane.attached)
    inbound.close()
    await until(lambda: bool(port.broken))
    assert "The payload lane to" in str(port.broken[0]) and "the receiver closed it" in str(port.broken[0])


async def test_a_sender_that_breaks_the_lane_mid_frame_breaks_the_receivers(port: Port) -> None:
    lane = port.offer()
    inbound = port.dial(lane)
    await until(lambda: lane.attached)
    for _ in range(4):
        send(lane, np.ones(500_000))  # 16 MB: more than the kernel's buffers take at once
    lane.close()
    assert await inbound.finished(5) is False
    assert "The payload lane from 127.0.0.1" in str(port.broken[0]) and "broke" in str(port.broken[0])


async def test_the_senders_array_is_read_until_flushed_and_is_free_after(port: Port) -> None:
    lane = port.offer()
    port.dial(lane)
    await until(lambda: lane.attached)
    # 16 MiB at once, more than the kernel's buffers hold before the receiver's loop runs: the
    # rest waits in the lane, as views of the sender's arrays, not copies.
    arrays = [np.full(2 * MiB, k, dtype=np.uint8) for k in range(8)]
    for a in arrays:
        send(lane, a)
    assert lane.waiting > 0
    flushed = asyncio.ensure_future(lane.flushed())
    received = []
    for _ in arrays:
        received.append(np.frombuffer((await port.frames.get()).payload, dtype=np.uint8).copy())
    await asyncio.wait_for(flushed, 5)
    for a in arrays:
        a[:] = 255  # the caller's again: nothing more of it may be sent
    assert [int(r.min()) for r in received] == [int(r.max()) for r in received] == list(range(8))


async def test_a_wrong_token_is_closed_counted_and_never_attaches_a_lane(port: Port, caplog: pytest.LogCaptureFixture) -> None:
    lane = port.offer()
    caplog.set_level(logging.WARNING, "ringserve.worker")
    inbound = port.dial(lane, token=bytes(16))
    await until(lambda: bool(port.fallbacks))
    assert "it refused the token: a wrong or spent token" in port.fallbacks[0]  # said: not dialled again
    assert not lane.attached and not inbound.attached and port.counters.lane_refused == 1
    assert "presented a token that no lane offers" in caplog.text
    # The real holder still attaches afterwards.
    port.dial(lane)
    await until(lambda: lane.attached)


async def test_a_token_is_good_once(port: Port) -> None:
    lane = port.offer()
    port.dial(lane)
    await until(lambda: lane.attached)
    second = port.dial(lane)
    await until(lambda: bool(port.fallbacks))
    assert not second.attached and port.counters.lane_refused == 1


async def raw_connect(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def closed_by_peer(sock: socket.socket, timeout_s: float) -> float:
    """Seconds until the peer closes ``sock`` (reading and discarding whatever it sends)."""
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                if not await loop.sock_recv(sock, 1024):
                    return time.monotonic() - start
            except ConnectionError:
                return time.monotonic() - start


async def test_garbage_on_the_port_is_closed_at_once_and_counted(port: Port) -> None:
    lane = port.offer()
    for garbage in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 64, MAGIC + b"short"):
        sock = await raw_connect(port.server.port)
        with contextlib.closing(sock):
            await asyncio.get_running_loop().sock_sendall(sock, garbage)
            if garbage.startswith(MAGIC):  # a hello cut short: the deadline closes it
                assert await closed_by_peer(sock, 3) < 2
            else:
                assert await closed_by_peer(sock, 3) < 0.4
    assert port.counters.lane_refused == 3
    port.dial(lane)
    await until(lambda: lane.attached)


async def test_a_silent_connection_is_closed_after_the_hello_deadline(port: Port) -> None:
    sock = await raw_connect(port.server.port)
    with contextlib.closing(sock):
        elapsed = await closed_by_peer(sock, 5)
    assert 0.4 < elapsed < 2.0  # the deadline is 0.5 s
    assert port.counters.lane_refused == 1 and port.server.waiting == 0


async def test_half_open_connections_are_capped_and_the_oldest_makes_room(port: Port) -> None:
    socks = [await raw_connect(port.server.port) for _ in range(4)]
    await until(lambda: port.server.waiting == 4)
    newest = await raw_connect(port.server.port)
    socks.append(newest)
    try:
        assert await closed_by_peer(socks[0], 2) < 0.4  # evicted at once, long before its deadline
        await until(lambda: port.server.waiting == 4)
        lane = port.offer()
        port.dial(lane)  # a member still gets in while squatters hold the rest
        await until(lambda: lane.attached)
    finally:
        for s in socks:
            s.close()


async def test_a_receiver_that_has_begun_its_hello_is_never_evicted_by_silent_connections(port: Port) -> None:
    # A receiver speaks at once (its hello, or under TLS its ClientHello); squatters do not. Under a
    # flood of silent connections, they go, and the receiver finishes its hello and attaches.
    loop = asyncio.get_running_loop()
    lane = port.offer()
    speaker = await raw_connect(port.server.port)
    await loop.sock_sendall(speaker, MAGIC)  # its hello begun, the token still to come
    await until(lambda: port.server.waiting == 1)
    await asyncio.sleep(0.05)  # the port has read its first byte
    silent = [await raw_connect(port.server.port) for _ in range(3 * port.server.cap)]
    try:
        await until(lambda: port.counters.lane_refused >= 2 * port.server.cap)  # evictions made room
        await loop.sock_sendall(speaker, lane.token)
        async with asyncio.timeout(2):
            assert await loop.sock_recv(speaker, 1) == ATTACHED  # not evicted: attached
        await until(lambda: lane.attached)
    finally:
        speaker.close()
        for s in silent:
            s.close()


async def test_a_refused_port_falls_back_at_once_with_the_reason(port: Port) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    lane = port.offer()
    start = time.monotonic()
    port.dial(lane, port=closed)
    await until(lambda: bool(port.fallbacks))
    assert time.monotonic() - start < 0.5
    assert "the connection failed (Connection refused)" in port.fallbacks[0]


async def test_a_port_that_drops_connections_falls_back_within_the_connect_deadline(port: Port) -> None:
    # A listener whose accept queue is full drops new SYNs, as a firewall that drops the port does.
    with socket.socket() as hole, socket.socket() as filler:
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)
        filler.connect(hole.getsockname())
        lane = port.offer()
        start = time.monotonic()
        port.dial(lane, port=hole.getsockname()[1], timeout_s=0.5)
        await until(lambda: bool(port.fallbacks), timeout_s=3)
        elapsed = time.monotonic() - start
    assert 0.45 < elapsed < 1.5
    assert "did not connect and take the token within 0.5 s" in port.fallbacks[0]


def _congestion(lane: OutboundLane) -> str:
    assert lane.conn is not None
    return lane.conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="TCP_CONGESTION is Linux's")
async def test_the_lane_sends_with_the_congestion_control_asked_and_keeps_the_hosts_where_refused(
        port: Port, caplog: pytest.LogCaptureFixture) -> None:
    port.server.congestion = "reno"  # built into every Linux kernel
    lane = port.offer()
    port.dial(lane)
    await until(lambda: lane.attached)
    assert _congestion(lane) == "reno"
    port.server.congestion = "no_such_cc"
    refused = [port.offer(), port.offer()]
    for other in refused:
        port.dial(other)
    await until(lambda: all(other.attached for other in refused))
    system = pathlib.Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    assert [_congestion(other) for other in refused] == [system, system]
    said = [r.getMessage() for r in caplog.records if "congestion control" in r.getMessage()]
    assert len(said) == 1 and "no_such_cc refused" in said[0], said


async def test_a_lane_closed_while_it_dials_fails_the_stream_waiting_for_it_with_an_error_not_a_cancellation() -> None:
    # A listener that takes the connection and never answers: the lane is still dialling when
    # its stream's view ends and the lane is closed. The stream waiting in ``ready`` (it requires
    # the lane) was cancelled along with the dial (issue 40).
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    try:
        port = silent.sockets[0].getsockname()[1]
        inbound = InboundLane(host="127.0.0.1", port=port, token=b"t" * 16, context=None, server_name="127.0.0.1",
                              timeout_s=20.0, buffers=LaneBuffers(MiB), max_bytes=4 * MiB, fell_back=lambda why: None,
                              attached_late=lambda: None)
        waiting = asyncio.ensure_future(inbound.ready())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        inbound.close()
        with pytest.raises(ConnectionError, match="closed while it dialled"):
            await asyncio.wait_for(waiting, 5)
        await inbound.wait_closed()
    finally:
        silent.close()
        await silent.wait_closed()
