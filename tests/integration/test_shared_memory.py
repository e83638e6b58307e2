"""The same-host fast path between real workers: payloads through shared memory, headers over the
stream, and the stream whenever the ring cannot take a payload.

The collectives of tests/integration/test_collectives.py already run over both paths (one worker
per world has shared memory off); these tests pin down which path carried what, and the refusals.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np
import pytest

from ringserve import wire
from ringserve._proto import peer_pb2
from ringserve.worker.dataplane.links import shared
from ringserve.worker.dataplane.links.shared import OutboundRing

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not shared.supported(), reason="the fast path needs Linux memfd seals, /proc and x86-64")]

STREAM = "/ringserve.v1.Peer/Stream"


def payload_bytes_sent(world) -> list[tuple[int, int]]:
    return [(w.counters.bytes_sent, w.counters.shared_bytes_sent) for w in world.workers]


async def test_payloads_between_workers_of_one_host_go_through_shared_memory(world_factory) -> None:
    # The ring, whatever the links measure: at about 3 ms auto plans a tree, which sends other bytes.
    world = await world_factory(3, chunk_bytes=64 << 10, algorithm="ring")
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(300_000).astype(np.float32) for _ in range(3)]
    # Until the receiver has mapped the ring (it does on the stream's HELLO), payloads go in frames.
    await world.map("allreduce", [np.ones(1000)] * 3, op="sum", name="warm-up")
    before = payload_bytes_sent(world)
    outs = await world.map("allreduce", inputs, op="sum", name="big")
    expected = (inputs[0] + inputs[1]) + inputs[2]
    for out in outs:
        assert out.tobytes() == outs[0].tobytes()
    np.testing.assert_allclose(outs[0], expected, rtol=1e-5, atol=1e-5)
    for (sent0, shared0), (sent1, shared1) in zip(before, payload_bytes_sent(world), strict=True):
        # 2(N-1)/N of the tensor, all but the headers through shared memory.
        assert shared1 - shared0 == 2 * 2 * 300_000 * 4 // 3
        assert (sent1 - sent0) - (shared1 - shared0) < 0.01 * (sent1 - sent0)


async def test_slots_are_freed_as_payloads_are_used_so_the_ring_never_runs_dry(world_factory) -> None:
    world = await world_factory(2, chunk_bytes=4096, shared_slots=4)
    for i in range(100):
        outs = await world.map("allreduce", [np.full(2048, i, dtype=np.int32)] * 2, op="sum", name=f"r{i}")
        assert all((o == 2 * i).all() for o in outs)
    # Once every rank is past the barrier, every earlier frame has been used and dropped; the
    # barrier's own frames may still hold two slots, which leaves two for the last allreduce.
    await world.each(lambda w: w.barrier())
    before = payload_bytes_sent(world)
    await world.map("allreduce", [np.ones(1024, dtype=np.int32)] * 2, op="sum", name="last")
    for (_, shared0), (_, shared1) in zip(before, payload_bytes_sent(world), strict=True):
        assert shared1 - shared0 == 4096  # a leaked slot would have sent it over the stream


async def test_when_the_ring_is_full_payloads_travel_in_the_frame_and_results_stay_exact(world_factory) -> None:
    world = await world_factory(4, chunk_bytes=1024, shared_slots=1)
    rng = np.random.default_rng(2)
    inputs = {k: [rng.integers(-1000, 1000, 5000).astype(np.int64) for _ in range(4)] for k in range(8)}

    async def many(w):
        return await asyncio.gather(*(w.allreduce(inputs[k][w.rank], op="sum", name=f"c{k}") for k in range(8)))

    results = await world.each(many)
    for k in range(8):
        expected = sum(inputs[k])
        for rank_results in results:
            np.testing.assert_array_equal(rank_results[k], expected)
    for sent, shared_sent in payload_bytes_sent(world):
        assert 0 < shared_sent < sent  # both paths carried payloads


async def test_a_worker_with_shared_memory_off_gets_and_sends_every_payload_over_the_stream(world_factory) -> None:
    world = await world_factory(2, each=lambda i: {"shared_memory": i == 0})
    outs = await world.map("allreduce", [np.arange(10_000, dtype=np.float64)] * 2, op="sum", name="x")
    np.testing.assert_array_equal(outs[0], 2 * np.arange(10_000, dtype=np.float64))
    assert [s for _, s in payload_bytes_sent(world)] == [0, 0]


async def test_a_frame_naming_a_slot_on_a_stream_without_a_ring_is_refused(world_factory) -> None:
    world = await world_factory(2)
    target = world.workers[1]
    # View 0 is no view the worker runs: the stream is refused without touching the real ring.
    async with grpc.aio.insecure_channel(target.address) as channel:
        call = channel.stream_unary(STREAM, response_deserializer=peer_pb2.StreamSummary.FromString)()
        header = wire.FrameHeader(kind=wire.DATA, view_id=0, sender_rank=0, op_key="x#1",
                                  descriptor="allreduce", shm_slot=0, shm_bytes=16)
        for frame in (wire.encode(wire.FrameHeader(kind=wire.HELLO, view_id=0, sender_rank=0)),
                      wire.encode(header)):
            try:
                await call.write(frame)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(5):
                await call.done_writing()
                await call
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shared ring that this stream never set up" in (caught.value.details() or "")
    outs = await world.map("allreduce", [np.ones(3)] * 2, op="sum", name="after")
    assert outs[1].tolist() == [2.0] * 3


async def test_a_ring_offered_by_a_stream_that_is_not_the_predecessor_is_never_mapped(world_factory) -> None:
    world = await world_factory(2)
    target = world.workers[1]
    ring = OutboundRing(slots=2, slot_bytes=1024)
    try:
        async with grpc.aio.insecure_channel(target.address) as channel:
            call = channel.stream_unary(STREAM, response_deserializer=peer_pb2.StreamSummary.FromString)()
            # A stream that claims the target's own rank in its view: refused, ring untouched.
            hello = wire.FrameHeader(kind=wire.HELLO, view_id=target.view_id, sender_rank=1)
            hello.shared_ring.CopyFrom(ring.offer())
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(wire.encode(hello))
                await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async with asyncio.timeout(5):
                    await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not ring.attached
    finally:
        ring.close()
