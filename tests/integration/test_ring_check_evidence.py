"""A ring check hears that the links are up as soon as they are (ringcheck.py, peers.py's on_linked).

When a worker reports a broken stream while the suspect still answers the coordinator, the
coordinator publishes a bump (the same members) and checks that every ring link of it comes up
within its window (half the heartbeat timeout). Each receiver heartbeats the moment its
predecessor's stream of the new view reaches it, so the check passes within a dial and a round
trip, not at the next heartbeat: here the interval is 3 s and the check must pass in under one.
Without that heartbeat the window would close first and cut off a healthy worker.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from worlds import start_world

from ringserve.coordinator import membership

pytestmark = pytest.mark.timeout(60)


async def test_a_bumped_views_links_are_heard_up_before_the_next_heartbeat_so_no_healthy_worker_is_cut() -> None:
    world = await start_world(3, coordinator={"heartbeat_interval_s": 3.0, "heartbeat_timeout_s": 10.0})
    try:
        service = world.coordinator.service
        view = world.workers[0].running_view
        reporter = world.workers[0]
        assert reporter.node.lifeline is not None
        # A stream "broke" (the suspect still heartbeats): the coordinator bumps and checks the ring.
        await reporter.node.control.report_failure(reporter.worker_id, view, 1, "its stream to rank 1 broke")
        began = time.monotonic()
        async with asyncio.timeout(10):
            while not membership.checking(service._state) or service._state.view.view_id == view:
                await asyncio.sleep(0.005)
            bumped = service._state.view.view_id
            while membership.checking(service._state):
                await asyncio.sleep(0.005)
        passed_s = time.monotonic() - began
        assert passed_s < 1.0, f"the check took {passed_s:.2f} s: the links' evidence waited for a heartbeat"
        assert service._state.view.view_id == bumped and len(service._state.view.members) == 3  # nobody cut
    finally:
        await world.close()
