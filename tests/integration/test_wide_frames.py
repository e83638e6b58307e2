"""A ring whose ranks are all on hosts of their own runs large allreduces in wider frames
(selection.ring_chunk): half a block, up to four chunks. Real workers over loopback, each with a
hostname of its own (RINGSERVE_HOSTNAME) and shared memory off, as between hosts.

What must hold (allreduce, and reduce-scatter by the ring): the wide frames are really sent (fewer DATA frames than the same call on one
host), over the payload lane and over the gRPC stream alike (the stream's message cap and the
lane's payload cap admit them); the results are bit-identical to the narrow frames'; a joined rank
that stands in chunks as the others do; containers of one host (hostnames of their own) pass
their wide frames through shared memory, whose slots hold one; and the cross-host ring of a hierarchical allreduce widens
while its local rings keep their chunks.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from worlds import World, warm_lanes

from ringserve import Worker

pytestmark = pytest.mark.timeout(90)

CHUNK = 64 << 10
APART = dict(shared_memory=False, chunk_bytes=CHUNK, algorithm="ring", each=lambda i: {"hostname": f"h{i}"})
TOGETHER = dict(shared_memory=False, chunk_bytes=CHUNK, algorithm="ring")
COUNT = 1 << 20  # float32: 4 MiB, a block of 2 MiB at world 2, 1 MiB at world 4


def frames(world: World) -> list[int]:
    return [w.counters.frames_sent for w in world.workers]


async def sent_frames(world: World, xs: list[np.ndarray], name: str) -> tuple[list[np.ndarray], list[int]]:
    before = frames(world)
    outs = await world.map("allreduce", xs, op="sum", name=name)
    return outs, [b - a for a, b in zip(before, frames(world), strict=True)]


@pytest.mark.parametrize("lane", ["tcp", "off"])
@pytest.mark.parametrize("n", [2, 4])
async def test_a_ring_of_hosts_sends_a_large_allreduce_in_four_chunk_frames_with_the_same_bits(
        world_factory, lane: str, n: int) -> None:
    apart, together = await asyncio.gather(world_factory(n, **APART, payload_lane=lane),
                                           world_factory(n, **TOGETHER, payload_lane=lane))
    if lane == "tcp":
        await asyncio.gather(warm_lanes(apart), warm_lanes(together))
    xs = [np.random.default_rng(r).standard_normal(COUNT).astype(np.float32) for r in range(n)]
    (wide, wide_frames), (narrow, narrow_frames) = await asyncio.gather(sent_frames(apart, xs, "w"),
                                                                        sent_frames(together, xs, "w"))
    for r in range(n):
        assert wide[r].tobytes() == narrow[r].tobytes() == narrow[0].tobytes(), f"rank {r} differs"
    # 2 (n - 1) steps of a block each: 64 KiB frames on one host, 256 KiB (four chunks) between hosts
    block = COUNT * 4 // n
    assert narrow_frames == [2 * (n - 1) * block // CHUNK] * n
    assert wide_frames == [2 * (n - 1) * block // (4 * CHUNK)] * n
    if lane == "tcp":
        assert all(w.counters.lane_fallbacks == 0 and w.counters.lane_bytes_sent > block for w in apart.workers)


@pytest.mark.parametrize("n", [2, 4])
async def test_a_ring_of_hosts_runs_a_large_reduce_scatter_in_wide_frames_too(world_factory, n: int) -> None:
    apart, together = await asyncio.gather(world_factory(n, **APART), world_factory(n, **TOGETHER))
    xs = [np.random.default_rng(r).standard_normal((COUNT // 256, 256)).astype(np.float32) for r in range(n)]

    async def scattered(world: World) -> tuple[list[np.ndarray], list[int]]:
        before = frames(world)
        outs = await world.each(lambda w: w.reduce_scatter(xs[w.rank], op="sum", name="rs"))
        return outs, [b - a for a, b in zip(before, frames(world), strict=True)]

    (wide, wide_frames), (narrow, narrow_frames) = await asyncio.gather(scattered(apart), scattered(together))
    for r in range(n):
        assert wide[r].tobytes() == narrow[r].tobytes(), f"rank {r} differs"
    block = COUNT * 4 // n  # n - 1 steps of a block each
    assert narrow_frames == [(n - 1) * block // CHUNK] * n
    assert wide_frames == [(n - 1) * block // (4 * CHUNK)] * n


async def test_containers_of_one_host_pass_their_wide_frames_through_shared_memory(world_factory) -> None:
    # docker compose: every container has a hostname of its own, and their rings meet in shared memory
    world = await world_factory(2, **{**APART, "shared_memory": True})
    xs = [np.random.default_rng(r).standard_normal(COUNT).astype(np.float32) for r in range(2)]
    payload = 2 * (COUNT * 4 // 2)  # 2 (n - 1) / n of the tensor: every byte of it in a slot
    shared: list[int] = []
    async with asyncio.timeout(20):  # a ring attaches a moment after the view's first HELLO
        for k in range(1 << 20):
            before = [w.counters.shared_bytes_sent for w in world.workers]
            outs, sent = await sent_frames(world, xs, f"c{k}")
            assert all(o.tobytes() == (xs[0] + xs[1]).tobytes() for o in outs)
            assert sent == [2 * (COUNT * 4 // 2) // (4 * CHUNK)] * 2
            shared = [w.counters.shared_bytes_sent - b for w, b in zip(world.workers, before, strict=True)]
            if shared == [payload] * 2:
                break
    assert shared == [payload] * 2


async def test_a_small_allreduce_between_hosts_keeps_its_chunks(world_factory) -> None:
    world = await world_factory(2, **APART)
    xs = [np.full(64 << 10, r + 1, dtype=np.float32) for r in range(2)]  # a block of 128 KiB: two chunks
    outs, sent = await sent_frames(world, xs, "small")
    assert all(np.array_equal(o, np.full(64 << 10, 3, dtype=np.float32)) for o in outs)
    assert sent == [2 * 2, 2 * 2]


async def test_a_joined_rank_between_hosts_stands_in_with_the_same_wide_frames(world_factory) -> None:
    n = 3
    world = await world_factory(n, **APART)

    async def call(w: Worker) -> tuple[list[np.ndarray], int]:
        sums = [await w.allreduce(np.full(COUNT, w.rank + 1.0, dtype=np.float32), op="sum", name=f"j/{step}")
                for step in range(w.rank + 1)]
        return sums, await w.join()

    before = frames(world)
    for sums, last in await world.each(call, timeout_s=60):
        assert last == n - 1
        for step, got in enumerate(sums):
            np.testing.assert_array_equal(got, np.full(COUNT, float(sum(k + 1 for k in range(step, n)))))
    # Every rank took part in three allreduces, rank 0 in two of them as a stand-in (a stand-in that
    # chunked otherwise would have failed them with a ProtocolError): blocks of 1.33 MiB in 256 KiB
    # frames, 6 a step and 24 an allreduce, where 64 KiB frames would be 22 a step and 88
    assert all(3 * 24 <= b - a < 3 * 88 // 2 for a, b in zip(before, frames(world), strict=True))


async def test_the_cross_host_ring_of_a_hierarchical_allreduce_widens_and_stays_exact(world_factory) -> None:
    hosts = dict(shared_memory=False, chunk_bytes=CHUNK, hierarchical="1", algorithm="ring",
                 each=lambda i: {"hostname": f"h{i // 2}", "rank_hint": i})
    world = await world_factory(4, **hosts)
    xs = [np.random.default_rng(r).integers(-99, 99, COUNT).astype(np.int64) for r in range(4)]
    outs, sent = await sent_frames(world, xs, "hier")
    exact = sum(xs)
    assert all(np.array_equal(o, exact) for o in outs)
    # local reduce-scatter and allgather: 1 step of 4 MiB each, in 64 KiB frames (128); the cross ring
    # over 2 hosts: 2 steps of 2 MiB, in 256 KiB frames (16), where 64 KiB frames would be 64
    local = 2 * (COUNT * 8 // 2) // CHUNK
    assert sent == [local + 2 * (COUNT * 8 // 4) // (4 * CHUNK)] * 4
