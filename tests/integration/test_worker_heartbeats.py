"""Real workers heartbeat on one stream each, and a coordinator restart is survived as before: the
workers rejoin with their view, the new coordinator adopts it, and they heartbeat on new streams."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from worlds import coordinator_config, free_port

from ringserve import Coordinator


async def until(predicate: object, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_each_worker_heartbeats_on_one_stream_of_its_own(world) -> None:
    service = world.coordinator.service
    await until(lambda: service.heartbeat_streams.open == 3, 10)
    beats = service.counts["heartbeats"]
    await asyncio.sleep(1.0)  # five heartbeat intervals
    assert service.counts["heartbeats"] >= beats + 3 * 3
    assert service.heartbeat_streams.open == 3
    assert all(service.heartbeat_streams.owner(w.worker_id) is not None for w in world.workers)


async def test_after_a_coordinator_restart_the_workers_rejoin_in_their_view_and_heartbeat_on_new_streams(
    world_factory,
) -> None:
    port = free_port()
    world = await world_factory(2, coordinator={"port": port})
    view = world.workers[0].view_id
    await until(lambda: world.coordinator.service.heartbeat_streams.open == 2, 10)
    await world.coordinator.stop()
    await asyncio.sleep(0.5)  # some heartbeats fail meanwhile
    world.coordinator = await Coordinator(coordinator_config(min_workers=2, port=port)).start()
    service = world.coordinator.service
    # The rejoin follows the first answered heartbeat ("known: false"), a stream after the backoff.
    await until(lambda: service.view.view_id == view and len(service.view.members) == 2, 15)
    await until(lambda: service.heartbeat_streams.open == 2, 15)
    assert [w.view_id for w in world.workers] == [view, view]
    outs = await world.each(lambda w: w.allreduce(np.full(3, w.rank + 1.0), op="sum"))
    assert [o.tolist() for o in outs] == [[3.0] * 3] * 2


@pytest.mark.parametrize(
    "world", [{"n": 3, "coordinator": {"heartbeat_interval_s": 0.1, "max_heartbeats_per_s": 6.0}}], indirect=True,
    ids=["3 workers, 6 beats a second"],
)
async def test_workers_heartbeat_at_the_interval_the_coordinator_stretched(world) -> None:
    service = world.coordinator.service
    await asyncio.sleep(1.0)  # every worker has had an answer with the stretched interval (0.5 s)
    beats = service.counts["heartbeats"]
    await asyncio.sleep(3.0)
    # 3 workers at 0.5 s: about 18 beats (the configured 0.1 s would make about 90).
    assert 9 <= service.counts["heartbeats"] - beats <= 30


async def test_after_a_long_coordinator_outage_the_workers_dial_the_restarted_one_within_a_second(world_factory) -> None:
    # Down for 11 s, gRPC's own reconnect backoff (1 s, growing 1.6x a failed dial, up to 120 s)
    # would next dial about 5 s after the restart; a worker that late was left out of the view
    # the restarted coordinator rebuilt from the others (issue 40). The control channel's backoff
    # stays under a second (transport.MAX_RECONNECT_BACKOFF_MS).
    port = free_port()
    world = await world_factory(2, coordinator={"port": port})
    view = world.workers[0].view_id
    await until(lambda: world.coordinator.service.heartbeat_streams.open == 2, 10)
    await world.coordinator.stop()
    await asyncio.sleep(11.0)
    world.coordinator = await Coordinator(coordinator_config(min_workers=2, port=port)).start()
    restarted = asyncio.get_running_loop().time()
    service = world.coordinator.service
    await until(lambda: service.counts["heartbeats"] >= 2, 10)
    assert asyncio.get_running_loop().time() - restarted < 2.5
    await until(lambda: service.view.view_id == view and len(service.view.members) == 2, 15)
