"""Worker and coordinator lifecycles: clean shutdown, graceful leaves, the parameter store, counters."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ringserve import Coordinator, RingChangedError, Worker
from ringserve._proto import coordinator_pb2 as pb


def other_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]


async def test_closing_the_workers_and_the_coordinator_leaves_no_task_running(make_coordinator_config, make_worker_config) -> None:
    before = set(other_tasks())
    coord = await Coordinator(make_coordinator_config(min_workers=3)).start()
    workers = [Worker(config=make_worker_config(coord.address, chunk_bytes=512)) for _ in range(3)]
    await asyncio.gather(*(w.start() for w in workers))
    await asyncio.gather(*(w.allreduce(np.ones(10_000), op="sum") for w in workers))
    await asyncio.gather(*(w.close() for w in workers))
    await coord.stop()
    await asyncio.sleep(0)
    assert set(other_tasks()) - before == set()


async def test_close_can_be_called_twice_and_the_async_context_manager_closes(make_coordinator_config, make_worker_config) -> None:
    async with Coordinator(make_coordinator_config(min_workers=1)) as coord:
        async with Worker(config=make_worker_config(coord.address)) as w:
            assert (w.rank, w.size) == (0, 1)
            assert (await w.allreduce(np.arange(3), op="sum")).tolist() == [0, 1, 2]
        await w.close()
        status = await coord.service.Status(pb.StatusRequest(), None)
        assert list(status.view.members) == [] and status.pending_workers == 0


async def test_the_worker_constructor_accepts_a_plain_coordinator_address(make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(min_workers=1)) as coord, Worker(coord.address) as w:
        assert w.config.coordinator == coord.address and w.size == 1


@pytest.mark.parametrize("world", [{"n": 3, "coordinator": {"min_workers": 2}}], indirect=True, ids=["3 of min 2"])
async def test_after_a_graceful_leave_the_others_get_a_smaller_view_and_keep_working(world) -> None:
    leaver, stay = world.workers[1], [world.workers[0], world.workers[2]]
    old_view = stay[0].view_id
    await leaver.close()
    async with asyncio.timeout(10):
        while any(w.view_id == old_view for w in stay):
            await asyncio.sleep(0.02)
    assert {w.view_id for w in stay} == {old_view + 1}
    assert sorted(w.rank for w in stay) == [0, 1] and {w.size for w in stay} == {2}
    # The longest-lived member keeps rank 0.
    assert world.workers[0].rank == 0
    outs = await asyncio.gather(*(w.allreduce(np.full(4, 1 + w.rank, dtype=np.int64), op="sum") for w in stay))
    assert [o.tolist() for o in outs] == [[3] * 4] * 2
    # Rank 0 streamed to the leaver; once that stream has drained, its channel is closed.
    async with asyncio.timeout(10):
        while leaver.address in world.workers[0].node.channels.addresses:
            await asyncio.sleep(0.05)
    assert world.workers[0].node.channels.addresses == {world.workers[2].address}


@pytest.mark.parametrize("world", [2], indirect=True)
async def test_after_a_peer_shuts_down_rank_and_size_still_answer_but_collectives_fail(world) -> None:
    # A job's ranks finish at different times: one that prints its rank after another has shut
    # down (the world fell below min_workers, so the new view is empty) must not crash.
    stay, leaver = world.workers
    old_view = stay.view_id
    await leaver.close()
    async with asyncio.timeout(10):
        while stay.latest_view == old_view:
            await asyncio.sleep(0.02)
    assert (stay.rank, stay.size, stay.local_rank) == (0, 2, 0)
    with pytest.raises(RingChangedError):
        await stay.allreduce(np.ones(2), name="alone")


@pytest.mark.parametrize("world", [2], indirect=True)
async def test_params_stored_by_one_worker_are_read_back_by_another(world) -> None:
    blob = bytes(range(256)) * 9000  # about 2.3 MB: several chunks
    version = await world.workers[0].put_params("init", blob)
    assert version == 1
    assert await world.workers[1].get_params("init") == blob


@pytest.mark.parametrize("n", [2, 4])
async def test_an_allreduce_sends_no_more_than_2_percent_over_the_ring_optimum(world_factory, n: int) -> None:
    # The ring's bytes (auto may trade bytes for steps: tests/integration/test_algorithms.py).
    world = await world_factory(n, chunk_bytes=64 * 1024, algorithm="ring")
    x = np.ones(256 * 1024, dtype=np.float32)  # 1 MiB
    before = [w.counters.bytes_sent for w in world.workers]
    await world.each(lambda w: w.allreduce(x, op="sum", name="measured"))
    optimum = 2 * (n - 1) / n * x.nbytes
    for r, w in enumerate(world.workers):
        sent = w.counters.bytes_sent - before[r]
        assert optimum <= sent <= 1.02 * optimum, f"rank {r} sent {sent} bytes; the ring optimum is {optimum:.0f}"


@pytest.mark.parametrize("world", [2], indirect=True)
async def test_heartbeats_carry_each_workers_counters_to_the_coordinator_status(world) -> None:
    await world.each(lambda w: w.allreduce(np.ones(100), op="sum"))
    async with asyncio.timeout(10):
        while True:
            status = await world.coordinator.service.Status(pb.StatusRequest(), None)
            if all(m.counters.collectives_done >= 1 for m in status.members):
                break
            await asyncio.sleep(0.05)
    assert all(m.counters.bytes_sent > 0 for m in status.members)


@pytest.mark.parametrize("lane", ["off", "tcp"])
async def test_close_returns_once_the_streams_it_served_have_ended(world_factory, lane: str) -> None:
    # Worker 1 closes while worker 0 keeps its stream into it open: the server's stop cancels that
    # call, but the task serving it still runs its end (a lane's reader to join) after stop returns.
    world = await world_factory(2, shared_memory=False, payload_lane=lane)
    await world.each(lambda w: w.allreduce(np.ones(50_000, dtype=np.float32), op="sum"))
    leaving = world.workers[1]
    serving = leaving.node.peers.serving()
    assert serving, "no task serves the stream from rank 0"
    # With the coordinator gone, rank 0 hears of no new view and keeps its stream open, so that the
    # server's stop has to cancel its call.
    await world.coordinator.stop()
    await leaving.close()
    assert [t.get_name() for t in serving if not t.done()] == []
