"""The payload lane under TLS (lanes/tcp/server.py): the lane speaks the job's TLS with the gRPC server's
certificate, CA and client-auth rule; a plaintext lane never carries a TLS job's payloads; a
plaintext client on a TLS lane, and a client the CA did not sign under mTLS, are refused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator

import numpy as np
import pytest
from _secure import TOKEN, Pki, client
from worlds import free_port, warm_lanes

from ringserve import PayloadLaneError, PeerUnavailableError, ProtocolError, wire
from ringserve._proto import peer_pb2
from ringserve.config import WorkerConfig
from ringserve.observe import Counters
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.hub import Lanes
from ringserve.worker.dataplane.lanes.tcp.inbound import InboundLane, LaneBuffers
from ringserve.worker.dataplane.lanes.tcp.outbound import OutboundLane
from ringserve.worker.dataplane.lanes.tcp.server import LaneServer, client_context, server_context
from ringserve.worker.dataplane.lanes.tcp.sockets import MAGIC

pytestmark = pytest.mark.timeout(60)

LANE = dict(shared_memory=False, chunk_bytes=64 << 10)


class Tap:
    """A relay in front of a worker's payload port that keeps every byte the worker sends."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.seen = bytearray()
        self.flip_at: int | None = None  # the offset in ``seen`` of a byte to damage on its way
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        for pipe in (self._pipe(reader, up_writer, keep=False), self._pipe(up_reader, writer, keep=True)):
            task = asyncio.get_running_loop().create_task(pipe)
            self._tasks.add(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, keep: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                if keep:
                    at, self.seen = self.flip_at, self.seen + data
                    if at is not None and len(self.seen) - len(data) <= at < len(self.seen):
                        data = bytearray(data)
                        data[at - (len(self.seen) - len(data))] ^= 0x01
                        self.flip_at = None
                writer.write(data)
                await writer.drain()
        writer.close()


@pytest.fixture
async def tap() -> AsyncIterator[list[Tap]]:
    taps: list[Tap] = []
    yield taps
    for t in taps:
        await t.close()


async def test_under_mtls_payloads_take_a_tls_lane_that_never_shows_them_in_the_clear(pki: Pki, world_factory, tap) -> None:
    settings = pki.settings(token=TOKEN)
    port = free_port()
    taps = Tap(port)
    tap.append(taps)
    relay = await taps.start()
    world = await world_factory(2, coordinator=settings, **settings, **LANE, each=lambda i: {
        "rank_hint": i, **({"payload_port": port, "payload_advertise_port": relay} if i == 0 else {})})
    await warm_lanes(world)
    marker = np.frombuffer(b"PLAINTEXT-MARKER" * 4096, dtype=np.float32)  # 64 KiB of a pattern no cipher shows
    for k in range(3):
        outs = await world.map("allreduce", [marker.copy(), np.zeros_like(marker)], op="sum", name=f"m{k}")
        assert all(o.tobytes() == marker.tobytes() for o in outs)
    assert world.workers[0].counters.lane_bytes_sent > 0 and len(taps.seen) > world.workers[0].counters.lane_bytes_sent // 2
    assert b"PLAINTEXT-MARKER" not in taps.seen and taps.seen[:1] == b"\x16"  # a TLS record, never the payload


async def test_a_bit_flipped_on_a_tls_lanes_wire_fails_the_collective_by_name_and_never_reaches_a_result(
    pki: Pki, world_factory, tap
) -> None:
    settings = pki.settings(token=TOKEN)
    port = free_port()
    taps = Tap(port)
    tap.append(taps)
    relay = await taps.start()
    world = await world_factory(2, coordinator=settings, **settings, **LANE, collective_timeout_s=10, each=lambda i: {
        "rank_hint": i, **({"payload_port": port, "payload_advertise_port": relay} if i == 0 else {})})
    await warm_lanes(world)
    xs = [np.full(1 << 18, 1.0 + r, dtype=np.float32) for r in range(2)]
    assert all(np.array_equal(o, xs[0] + xs[1]) for o in await world.map("allreduce", xs, op="sum", name="clean"))
    taps.flip_at = len(taps.seen) + (100 << 10)  # inside the next collective's sealed records
    started = asyncio.get_running_loop().time()
    outcomes = await world.each_outcome(lambda w: w.allreduce(xs[w.rank], op="sum", name="flipped"), timeout_s=30)
    assert asyncio.get_running_loop().time() - started < 15
    # No rank got a result from damaged bytes: the receiver names the record, the sender its lost lane.
    assert isinstance(outcomes[1], ProtocolError) and "failed its authentication" in str(outcomes[1]), outcomes
    assert isinstance(outcomes[0], PeerUnavailableError) and f"port {relay}" in str(outcomes[0]), outcomes


async def test_a_plaintext_client_on_a_tls_lane_is_refused_with_a_named_reason_and_the_job_goes_on(
    pki: Pki, world_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "ringserve.worker")
    settings = pki.settings(token=TOKEN)
    port = free_port()
    world = await world_factory(2, coordinator=settings, **settings, **LANE,
                                each=lambda i: {"rank_hint": i, **({"payload_port": port} if i == 0 else {})})
    await world.map("allreduce", [np.ones(100_000)] * 2, op="sum", name="warm")
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, MAGIC + bytes(16))
        async with asyncio.timeout(5):
            # closed (or reset: its hello unread), with nothing said in the clear
            with contextlib.suppress(ConnectionResetError):
                assert await loop.sock_recv(sock, 64) == b""
    assert "a plaintext client reached this TLS payload lane and was refused" in caplog.text
    assert world.workers[0].counters.lane_refused == 1
    outs = await world.map("allreduce", [np.full(100_000, 1.0), np.full(100_000, 2.0)], op="sum", name="after")
    assert all(np.array_equal(o, np.full(100_000, 3.0)) for o in outs)


async def offered(security_server, counters: Counters) -> tuple[LaneServer, OutboundLane]:
    server = LaneServer("127.0.0.1", 0, context=server_context(security_server), hello_timeout_s=2, cap=4,
                        counters=counters, tag=lambda: "test worker")
    lane = OutboundLane(counters, port=server.port, tls=server.tls, withdraw=server.withdraw)
    server.offer(lane)
    return server, lane


async def dial(context: ssl.SSLContext | None, port: int, token: bytes, fallbacks: list[str],
               frames: asyncio.Queue[Received] | None = None) -> InboundLane:
    return InboundLane(host="127.0.0.1", port=port, token=token, context=context, server_name="127.0.0.1",
                       timeout_s=2, buffers=LaneBuffers(1 << 20), max_bytes=1 << 20, fell_back=fallbacks.append,
                       attached_late=lambda: None, on_frame=(frames or asyncio.Queue()).put_nowait)


@pytest.mark.parametrize("who", ["no certificate", "another CA"])
async def test_under_mtls_a_lane_refuses_a_client_without_a_certificate_of_the_jobs_ca(pki: Pki, who: str) -> None:
    counters, fallbacks = Counters(), []
    server_side = client(ca=pki.node.ca, cert=pki.node)
    server_side = type(server_side)(cert=server_side.cert, key=server_side.key, ca=server_side.ca, require_client_auth=True)
    server, lane = await offered(server_side, counters)
    stranger = client(ca=pki.node.ca, cert=None if who == "no certificate" else pki.other)
    inbound = await dial(client_context(stranger), server.port, lane.token, fallbacks)
    try:
        async with asyncio.timeout(5):
            while not fallbacks:
                await asyncio.sleep(0.01)
        assert not lane.attached and counters.lane_refused == 1
        # The job's own certificate gets in.
        frames: asyncio.Queue[Received] = asyncio.Queue()
        member = await dial(client_context(client(ca=pki.node.ca, cert=pki.node)), server.port, lane.token, fallbacks,
                            frames)
        async with asyncio.timeout(5):
            while not lane.attached:
                await asyncio.sleep(0.01)
        data = np.arange(100_000, dtype=np.float64)
        lane.frame(wire.encode(wire.FrameHeader(kind=wire.DATA, view_id=1, lane_bytes=data.nbytes)), data)
        async with asyncio.timeout(5):
            assert bytes((await frames.get()).payload) == data.tobytes()
        member.close()
    finally:
        inbound.close()
        lane.close()
        await server.close()


async def test_a_tls_worker_never_dials_a_plaintext_lane_and_a_plaintext_one_never_a_tls_lane(pki: Pki) -> None:
    offer = peer_pb2.PayloadLane(port=1, token=bytes(16), tls=False)
    tls = WorkerConfig(**pki.settings(), **LANE)
    lanes = Lanes(tls, Counters(), tag=lambda: "test worker")
    assert lanes.inbound(offer, address="127.0.0.1:5", edge="rank 0 -> rank 1 of view 1") is None
    assert lanes.counters.lane_fallbacks == 1
    plain = Lanes(WorkerConfig(**LANE), Counters(), tag=lambda: "test worker")
    assert plain.inbound(peer_pb2.PayloadLane(port=1, token=bytes(16), tls=True), address="127.0.0.1:5",
                         edge="rank 0 -> rank 1 of view 1") is None
    required = Lanes(WorkerConfig(**pki.settings(), **LANE, payload_lane="tcp"), Counters(), tag=lambda: "test worker")
    with pytest.raises(PayloadLaneError, match=r"plaintext lane at 127\.0\.0\.1:1 and this worker runs with TLS"):
        required.inbound(offer, address="127.0.0.1:5", edge="rank 0 -> rank 1 of view 1")


async def test_under_mtls_large_chunks_are_deciphered_straight_into_the_result(pki: Pki, world_factory) -> None:
    settings = pki.settings(token=TOKEN)
    world = await world_factory(2, coordinator=settings, **settings, **{**LANE, "chunk_bytes": 512 << 10},
                                algorithm="ring")
    await warm_lanes(world)
    landings = [w.node.planes.lanes.buffers.landings for w in world.workers]
    before = [x.landed for x in landings]
    xs = [np.random.default_rng(r).integers(-1000, 1000, 1 << 22).astype(np.float32) for r in range(2)]
    outs = await world.map("allreduce", xs, op="sum", name="big")
    assert all(np.array_equal(o, xs[0] + xs[1]) for o in outs)
    # Each rank's allgather receives the other's 8 MiB segment: 16 chunks of 512 KiB, all landed.
    assert [x.landed - b for x, b in zip(landings, before, strict=True)] == [16, 16]
