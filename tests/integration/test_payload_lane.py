"""The TCP payload lane between real workers (lanes/tcp/outbound.py): a coordinator and workers over loopback,
with shared memory off, so that every payload between them takes the lane (as between hosts)
unless the lane cannot attach, when it takes the gRPC stream.

What must hold: every collective and codec gives bit-identical results over the lane and over the
stream; an edge whose lane cannot attach (a closed port, a port that drops connections, an nginx
gRPC proxy in front of the worker) falls back within the connect deadline, says so once and counts
it, and nothing waits for it; with the lane required, such an edge fails with PayloadLaneError
naming the port; a lane killed mid-collective fails that collective as a broken stream does, and
the next view goes on; a damaged lane payload is caught by the frame checksum on every rank; and
garbage or silence on the payload port never affects the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from worlds import World, free_port, warm_lanes

from ringserve import PayloadLaneError, PeerUnavailableError, RingChangedError, Worker, cli
from ringserve._proto import coordinator_pb2 as cpb
from ringserve.coordinator.statusview import snapshot
from ringserve.errors import CorruptFrameError
from ringserve.metrics import WorkerCollector
from ringserve.worker.dataplane.lanes.tcp.sockets import MAGIC

pytestmark = pytest.mark.timeout(90)

LANE = dict(shared_memory=False, chunk_bytes=64 << 10)  # as between hosts: no shared memory; many chunks
STREAM = dict(LANE, payload_lane="off")


def totals(world: World) -> list[tuple[int, int]]:
    return [(w.counters.bytes_sent, w.counters.lane_bytes_sent) for w in world.workers]


async def test_without_shared_memory_every_payload_byte_goes_on_the_lane(world_factory) -> None:
    world = await world_factory(3, **LANE, algorithm="ring")  # the ring's bytes, whatever the links measure
    await warm_lanes(world)
    before = totals(world)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(300_000).astype(np.float32) for _ in range(3)]
    outs = await world.map("allreduce", xs, op="sum", name="big")
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)
    np.testing.assert_allclose(outs[0], (xs[0] + xs[1]) + xs[2], rtol=1e-5, atol=1e-5)
    for (sent0, lane0), (sent1, lane1) in zip(before, totals(world), strict=True):
        assert lane1 - lane0 == 2 * 2 * 300_000 * 4 // 3  # 2(N-1)/N of the tensor, all of it on the lane
        assert (sent1 - sent0) - (lane1 - lane0) < 0.02 * (sent1 - sent0)  # the rest: headers
    assert all(w.counters.lane_fallbacks == 0 for w in world.workers)


async def script(w: Worker, n: int) -> list[Any]:
    """Every collective and codec, with inputs that depend on the rank only; returns the results."""
    rng = np.random.default_rng(1000 + w.rank)
    f32 = rng.standard_normal(100_003).astype(np.float32)
    out: list[Any] = []
    for op in ("sum", "average", "min", "max"):
        out.append(await w.allreduce(f32, op=op, name=f"f32/{op}"))
    out.append(await w.allreduce(rng.standard_normal(30_001), op="average", name="f64"))
    out.append(await w.allreduce(rng.integers(-1000, 1000, 40_001).astype(np.int32), op="sum", name="i32"))
    out.append(await w.allreduce(rng.integers(-9, 9, 20_001).astype(np.int64), op="max", name="i64"))
    for codec in ("fp16", "bf16", "int8"):
        residual = np.zeros_like(f32)  # error feedback: what the encodings lost carries over
        for step in range(2):
            out.append(await w.allreduce(f32 * (step + 1), op="average", name=f"{codec}/{step}",
                                         compression=codec, residual=residual))
        out.append(residual.copy())
    out.append(await w.allreduce(f32, op="adasum", name="adasum"))
    out.append(await w.broadcast(f32, root=2, name="bcast"))
    out.append(await w.allgather(rng.standard_normal((w.rank + 1) * 7_001).astype(np.float32), name="ag"))
    out.append(await w.reduce_scatter(f32, op="sum", name="rs"))
    out.append(await w.reduce_scatter(f32, op="average", name="rs-bf16", compression="bf16"))
    splits = [((w.rank + d) % 3) * 5_000 for d in range(n)]
    received, counts = await w.alltoall(rng.standard_normal(sum(splits)).astype(np.float32), splits=splits, name="a2a")
    out += [received, counts]
    out += await w.grouped_allgather([f32[: 9_000 + w.rank], rng.integers(0, 9, 3_000 + w.rank)], name="gag")
    out += await w.grouped_reduce_scatter([f32, f32[:50_000] * 2], op="sum", name="grs", compression="int8")
    await w.barrier()
    out.append(await w.broadcast_object({"from": w.rank, "blob": rng.bytes(200_000)}, root=1, name="bobj"))
    out.append(await w.allgather_object(("rank", w.rank, rng.bytes(70_000)), name="agobj"))
    subset = await w.add_process_set([0, 2, 3])
    if w.rank in (0, 2, 3):
        out.append(await w.allreduce(f32, op="sum", name="set", process_set=subset))
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(a == b)


async def test_every_collective_and_codec_is_bit_identical_over_the_lane_and_over_the_stream(world_factory) -> None:
    # One algorithm for both: under auto each world plans by its own measured links, and another
    # algorithm adds floats in another order.
    lane, stream = await asyncio.gather(world_factory(4, **LANE, algorithm="ring"),
                                        world_factory(4, **STREAM, algorithm="ring"))
    over_lane, over_stream = await asyncio.gather(lane.each(lambda w: script(w, 4), timeout_s=60),
                                                  stream.each(lambda w: script(w, 4), timeout_s=60))
    for rank, (a, b) in enumerate(zip(over_lane, over_stream, strict=True)):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert same(x, y), f"result {i} of rank {rank} differs between the lane and the stream"
    assert all(w.counters.lane_bytes_sent > 1 << 20 for w in lane.workers)
    assert all(w.counters.lane_bytes_sent == 0 for w in stream.workers)


async def test_hierarchical_allreduce_runs_its_rings_on_the_lane_and_matches_the_stream(world_factory) -> None:
    hosts = {"each": lambda i: {"hostname": f"h{i // 2}", "rank_hint": i}, "hierarchical": "1"}
    lane, stream = await asyncio.gather(world_factory(4, **LANE, **hosts), world_factory(4, **STREAM, **hosts))
    xs = [np.random.default_rng(r).integers(-99, 99, 250_001).astype(np.int64) for r in range(4)]
    a, b = await asyncio.gather(lane.map("allreduce", xs, op="sum", name="h"), stream.map("allreduce", xs, op="sum", name="h"))
    exact = sum(xs)
    wrong = {(kind, r): int(np.count_nonzero(got != exact))
             for kind, outs in (("lane", a), ("stream", b)) for r, got in enumerate(outs) if not np.array_equal(got, exact)}
    assert not wrong, f"(world, rank): wrong elements of {exact.size}: {wrong}"
    assert all(w.counters.lane_bytes_sent > 0 for w in lane.workers)


def landed(world: World) -> list[int]:
    return [w.node.planes.lanes.buffers.landings.landed for w in world.workers]


@pytest.mark.parametrize("world_size", [2, 3])
async def test_large_allgather_chunks_land_straight_in_the_result_and_match_the_stream_bit_for_bit(
        world_factory, world_size: int) -> None:
    big = dict(chunk_bytes=256 << 10, algorithm="ring")
    lane, stream = await asyncio.gather(world_factory(world_size, **{**LANE, **big}),
                                        world_factory(world_size, **{**STREAM, **big}))
    await warm_lanes(lane)
    before = landed(lane)
    rng = [np.random.default_rng(r) for r in range(world_size)]
    inputs = [(r.standard_normal(3_000_001).astype(np.float32), r.standard_normal(700_001),
               r.integers(-99, 99, 1_000_003)) for r in rng]

    async def ops(w: Worker) -> list[np.ndarray]:
        f32, f64, i64 = (x.copy() for x in inputs[w.rank])
        out = [await w.allreduce(f32, op="average", name="f32")]
        await w.allreduce(f64, op="sum", name="f64", out=f64)
        out.append(f64)
        into = np.full_like(i64, 7)
        await w.allreduce(i64, op="max", name="i64", out=into)
        return [*out, into, await w.allreduce(f32[: 100_000], op="sum", name="small")]

    over_lane, over_stream = await asyncio.gather(lane.each(ops, timeout_s=60), stream.each(ops, timeout_s=60))
    for rank, (a, b) in enumerate(zip(over_lane, over_stream, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert same(x, y), f"result {i} of rank {rank} differs between the lane and the stream"
    np.testing.assert_array_equal(over_lane[0][2], np.max([x[2] for x in inputs], axis=0))
    # Every allgather chunk of the three large ones landed: (N-1) segments of each, in 256 KiB chunks.
    # Every whole 256 KiB chunk that a rank's allgather received landed (a segment's last, shorter
    # chunk is copied); the small op's chunks are too small to land.
    whole = sum((world_size - 1) * ((nbytes // world_size - 16) // (256 << 10))
                for nbytes in (3_000_001 * 4, 700_001 * 8, 1_000_003 * 8))
    assert all(b1 - b0 >= whole for b0, b1 in zip(before, landed(lane), strict=True)), (whole, before, landed(lane))
    assert landed(stream) == [0] * world_size


# -- when the lane cannot attach ---------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def dropping_port() -> Any:
    """A port that drops every new connection, as a firewall does: a listener whose accept queue
    is full, so the kernel drops further SYNs."""
    with socket.socket() as hole, socket.socket() as filler:
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)
        filler.connect(hole.getsockname())
        yield hole.getsockname()[1]


def rank_of(i: int, **extra: Any) -> dict[str, Any]:
    return {"rank_hint": i, **extra}


async def test_a_closed_payload_port_falls_back_at_once_and_the_collective_stays_exact(world_factory, caplog) -> None:
    caplog.set_level(logging.WARNING, "ringserve.worker")
    # Rank 1 advertises a payload port where nothing listens: rank 2, which receives from it, falls back.
    # (The ring alone: under auto, a probe of the links would make rank 0 receive from rank 1 too.)
    world = await world_factory(3, **LANE, algorithm="ring", each=lambda i: rank_of(i, **({"payload_advertise_port": closed_port()} if i == 1 else {})))
    xs = [np.full(200_000, r + 1.0, dtype=np.float32) for r in range(3)]
    for k in range(3):
        outs = await world.map("allreduce", xs, op="sum", name=f"x{k}")
        assert all(np.array_equal(o, np.full(200_000, 6.0, dtype=np.float32)) for o in outs)
    w0, w1, w2 = world.workers
    assert w2.counters.lane_fallbacks == 1 and w0.counters.lane_fallbacks == w1.counters.lane_fallbacks == 0
    assert w1.counters.lane_bytes_sent == 0 and w0.counters.lane_bytes_sent > 0 and w2.counters.lane_bytes_sent > 0
    logged = [r.getMessage() for r in caplog.records if "take the gRPC stream" in r.getMessage()]
    assert len(logged) == 1, logged
    assert f"rank 1 ({w1.address}) -> rank 2 of view" in logged[0] and "Connection refused" in logged[0]


async def test_a_payload_port_that_drops_connections_falls_back_within_the_deadline_and_nothing_waits(world_factory, caplog) -> None:
    caplog.set_level(logging.WARNING, "ringserve.worker")
    with dropping_port() as port:
        world = await world_factory(2, **LANE, payload_connect_timeout_s=0.5,
                                    each=lambda i: rank_of(i, **({"payload_advertise_port": port} if i == 0 else {})))
        xs = [np.full(300_000, r + 1.0, dtype=np.float32) for r in range(2)]
        start = time.monotonic()
        outs = await world.map("allreduce", xs, op="sum", name="first")
        first = time.monotonic() - start
        assert all(np.array_equal(o, np.full(300_000, 3.0, dtype=np.float32)) for o in outs)
        async with asyncio.timeout(5):
            while not world.workers[1].counters.lane_fallbacks:
                await asyncio.sleep(0.02)
        fell_back = time.monotonic() - start
        outs = await world.map("allreduce", xs, op="sum", name="second")
        assert all(np.array_equal(o, np.full(300_000, 3.0, dtype=np.float32)) for o in outs)
    assert first < 0.5  # no collective waits for the lane: its payloads took the stream meanwhile
    assert fell_back < 0.5 + 1.5
    assert "did not connect and take the token within 0.5 s" in caplog.text
    assert world.workers[0].counters.lane_bytes_sent == 0 and world.workers[1].counters.lane_bytes_sent > 0


async def test_with_the_lane_required_an_edge_without_it_fails_with_an_error_naming_the_port(world_factory) -> None:
    port = closed_port()
    # The receiver (rank 1) knows at once; the sender (rank 0) by its own deadline: the receiver's
    # HELLO deadline and connect deadline (1 s each here).
    world = await world_factory(2, **LANE, payload_lane="tcp", peer_hello_timeout_s=1.0,
                                each=lambda i: rank_of(i, **({"payload_advertise_port": port} if i == 0 else {})))
    start = time.monotonic()
    outcomes = await world.each_outcome(lambda w: w.allreduce(np.ones(100_000), op="sum", name="x"), timeout_s=20)
    assert time.monotonic() - start < 2.0 + 3
    for outcome in outcomes:
        assert isinstance(outcome, PayloadLaneError), outcome
        assert f"port {port}" in str(outcome) or f"127.0.0.1:{port}" in str(outcome), outcome
        assert "RINGSERVE_PAYLOAD_LANE=tcp requires it" in str(outcome)


# -- faults on the lane ------------------------------------------------------------------------


class LaneRelay:
    """A TCP relay in front of one worker's payload port (the worker advertises the relay's port):
    ``kill`` resets every connection through it; ``flip_at`` flips one byte of what the worker sends
    (a payload: the lane's first byte is its answer to the token)."""

    def __init__(self, target: int, *, flip_at: int = -1) -> None:
        self.target = target
        self.flip_at = flip_at
        self.flipped = 0
        self.passed = 0  # bytes the worker sent through the relay
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def kill(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.kill()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._writers += [writer, up_writer]
        for pipe in (self._pipe(reader, up_writer, replies=False), self._pipe(up_reader, writer, replies=True)):
            task = asyncio.get_running_loop().create_task(pipe)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, replies: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                if replies:
                    at = self.flip_at - self.passed
                    if 0 <= at < len(data) and not self.flipped:
                        data = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]
                        self.flipped += 1
                    self.passed += len(data)
                writer.write(data)
                await writer.drain()
        writer.close()


@pytest.fixture
async def relayed() -> AsyncIterator[list[LaneRelay]]:
    relays: list[LaneRelay] = []
    yield relays
    for relay in relays:
        await relay.close()


async def relayed_world(world_factory, relays: list[LaneRelay], *, flip_at: int = -1, **config: Any) -> World:
    """Two workers; rank 0's payload port is behind a relay, so rank 1 receives through it."""
    port = free_port()
    relay = LaneRelay(port, flip_at=flip_at)
    relays.append(relay)
    relay_port = await relay.start()
    return await world_factory(2, **{**LANE, **config}, each=lambda i: rank_of(i, **(
        {"payload_port": port, "payload_advertise_port": relay_port} if i == 0 else {})))


# 64 KiB chunks travel through pooled buffers; 1 MiB ones land straight in the result (Landings).
@pytest.mark.parametrize("chunk_bytes", [64 << 10, 1 << 20])
async def test_a_lane_killed_mid_collective_fails_it_as_a_broken_stream_and_the_next_view_goes_on(
        world_factory, relayed, chunk_bytes: int) -> None:
    world = await relayed_world(world_factory, relayed, coordinator={"heartbeat_timeout_s": 2.0},
                                chunk_bytes=chunk_bytes)
    await warm_lanes(world)
    relay = relayed[0]
    first_view = world.workers[0].view_id
    big = [np.full(8 << 20, r + 1.0, dtype=np.float32) for r in range(2)]  # 32 MiB: 512 chunks of 64 KiB

    async def kill_when_flowing() -> None:
        start = relay.passed
        while relay.passed - start < 4 << 20:
            await asyncio.sleep(0.001)
        relay.kill()

    killer = asyncio.ensure_future(kill_when_flowing())
    started = time.monotonic()
    outcomes = await world.each_outcome(lambda w: w.allreduce(big[w.rank], op="sum", name="big"), timeout_s=30)
    failed_after = time.monotonic() - started
    await killer
    assert all(isinstance(o, PeerUnavailableError | RingChangedError) for o in outcomes), outcomes
    assert failed_after < 10
    # Both workers live, so the coordinator tries the ring again in a new view, whose lanes attach anew.
    async with asyncio.timeout(20):
        while not all(w.node.planes.current is not None and w.view_id > first_view for w in world.workers):
            await asyncio.sleep(0.05)
    outs = await world.map("allreduce", [np.full(100_000, r + 1.0) for r in range(2)], op="sum", name="after")
    assert all(np.array_equal(o, np.full(100_000, 3.0)) for o in outs)


async def test_a_damaged_lane_payload_is_caught_by_the_checksum_and_aborts_the_collective_on_every_rank(world_factory, relayed) -> None:
    world = await relayed_world(world_factory, relayed, checksum=True)
    await warm_lanes(world)  # the links' measure and the warm-up: whatever they sent, none of it is damaged
    relayed[0].flip_at = relayed[0].passed + (1 << 20)  # inside the next collective's payloads
    xs = [np.full(1 << 20, r + 1.0, dtype=np.float32) for r in range(2)]
    outcomes = await world.each_outcome(lambda w: w.allreduce(xs[w.rank], op="sum", name="damaged"), timeout_s=30)
    assert relayed[0].flipped == 1
    assert all(isinstance(o, CorruptFrameError) for o in outcomes), outcomes
    outs = await world.map("allreduce", xs, op="sum", name="after")  # the same view goes on
    assert all(np.array_equal(o, np.full(1 << 20, 3.0, dtype=np.float32)) for o in outs)


async def test_garbage_and_silence_on_the_payload_port_never_affect_the_job(world_factory) -> None:
    port = free_port()
    world = await world_factory(2, **LANE, peer_hello_timeout_s=1.0, max_unverified_streams=4,
                                each=lambda i: rank_of(i, **({"payload_port": port} if i == 0 else {})))
    await warm_lanes(world)
    loop = asyncio.get_running_loop()
    socks = []
    for payload in (b"\x16\x03\x01garbage", b"GET / HTTP/1.0\r\n\r\n", MAGIC + bytes(16),
                    b"RSLANE1\x00" + bytes(16), b"", b"", b"", b""):  # a wrong token; the first version's hello
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        if payload:
            await loop.sock_sendall(sock, payload)
        socks.append(sock)
    try:
        xs = [np.random.default_rng(r).standard_normal(400_000).astype(np.float32) for r in range(2)]
        for k in range(3):
            outs = await world.map("allreduce", xs, op="sum", name=f"during/{k}")
            assert outs[0].tobytes() == outs[1].tobytes()
            np.testing.assert_allclose(outs[0], xs[0] + xs[1], rtol=1e-6)
        async with asyncio.timeout(5):  # five silent ones: one evicted at once (cap 4), four at their deadline
            while world.workers[0].counters.lane_refused < 8:
                await asyncio.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
    assert world.workers[0].counters.lane_bytes_sent > 0 and world.workers[1].counters.lane_fallbacks == 0


async def test_status_and_metrics_show_the_lane_bytes_and_the_fallbacks(world_factory, capsys) -> None:
    world = await world_factory(2, **LANE, each=lambda i: rank_of(i, **({"payload_advertise_port": closed_port()} if i == 0 else {})))
    await warm_lanes(world, senders=(1,))
    await world.map("allreduce", [np.ones(200_000)] * 2, op="sum", name="x")
    w1 = world.workers[1]
    metrics = {m.name: m.samples[0].value for m in WorkerCollector(w1.counters, lambda: (1, w1.view_id)).collect()
               if m.name.startswith("ringserve_lane")}
    assert metrics["ringserve_lane_fallbacks"] == 1 and metrics["ringserve_lane_sent_bytes"] == w1.counters.lane_bytes_sent > 0
    async with asyncio.timeout(10):  # the counters reach the coordinator with the heartbeats, each rank's with its own
        while True:
            status = await world.coordinator.service.Status(cpb.StatusRequest(), None)
            by_rank = {m.member.rank: m.counters for m in status.members}
            page = snapshot(status, [])  # the status page's JSON: each edge names its lane
            if by_rank[1].lane_fallbacks == 1 and by_rank[1].lane_bytes_sent > 0 and len(page["edges"]) == 2:
                break
            await asyncio.sleep(0.05)
    assert {(e["from"], e["to"]): e["lane"] for e in page["edges"]} == {(1, 0): "tcp lane", (0, 1): "stream"}
    assert [(m["rank"], m["lane_fallbacks"]) for m in page["members"]] == [(0, 0), (1, 1)]
    assert await asyncio.to_thread(cli.main, ["status", "--coordinator", world.coordinator.address]) == 0
    out = capsys.readouterr().out
    assert "lane fallbacks" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("1 ") and w1.address in line)
    assert row.split()[-1] == "1"
