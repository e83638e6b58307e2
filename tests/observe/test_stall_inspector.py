"""The stall inspector: a collective that some ranks wait on is reported with the ranks missing."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from ringserve import Coordinator, CoordinatorConfig, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(60)


async def test_a_collective_some_ranks_never_submit_is_reported_naming_the_missing_rank(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ringserve")
    config = CoordinatorConfig(min_workers=3, settle_s=0.1, heartbeat_interval_s=0.2, heartbeat_timeout_s=5)
    async with Coordinator(config) as coord:
        workers = [Worker(config=WorkerConfig(coordinator=coord.address, stall_warning_s=0.3)) for _ in range(3)]
        await asyncio.gather(*(w.start() for w in workers))
        try:
            workers.sort(key=lambda w: w.rank)
            a = np.ones(8, np.float32)
            early = [asyncio.ensure_future(w.allreduce(a, op="sum", name="grad.w")) for w in workers[:2]]
            deadline = asyncio.get_running_loop().time() + 10
            # The stall of grad.w itself: under load, the measure of the links before it (auto) may
            # be reported first.
            while not any("'grad.w#1'" in r.getMessage() for r in caplog.records if r.name == "ringserve.coordinator"):
                assert asyncio.get_running_loop().time() < deadline, "no stall was reported"
                await asyncio.sleep(0.1)
            late = await workers[2].allreduce(a, op="sum", name="grad.w")
            results = await asyncio.gather(*early)
        finally:
            await asyncio.gather(*(w.close() for w in workers))
    assert all(np.array_equal(r, late) for r in results) and late[0] == 3
    warnings = [r.getMessage() for r in caplog.records if "stalled collective" in r.getMessage()]
    assert any("'grad.w#1': ranks 2 have not submitted it; ranks 0, 1 wait" in w for w in warnings), warnings
    assert sum(w.counters.stall_warnings for w in workers[:2]) >= 1
