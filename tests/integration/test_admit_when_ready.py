"""A worker that comes to a running world with ``admit_when_ready``, over real sockets: its start
returns at once with where it would stand, the members do not hear of it until it is ready, and
its first collective says it is, then waits until the members' admission takes it in."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from worlds import coordinator_config, worker_config

from ringserve import Coordinator, Worker

pytestmark = pytest.mark.timeout(60)


async def test_a_joiner_is_counted_only_at_its_first_collective_which_waits_for_its_admission() -> None:
    coordinator = await Coordinator(coordinator_config(min_workers=2, max_workers=3, heartbeat_timeout_s=5.0)).start()
    members = [Worker(config=worker_config(coordinator.address, rank_hint=i)) for i in range(2)]
    joiner = Worker(config=worker_config(coordinator.address, admit_when_ready=True))
    try:
        await asyncio.gather(*(w.start() for w in members))
        async with asyncio.timeout(5):
            await joiner.start()  # returns although no view takes it
        assert joiner.node.planes.current is None and joiner.node.preparing
        assert (joiner.rank, joiner.size, joiner.local_rank, joiner.local_size) == (2, 3, 2, 3)
        await asyncio.sleep(1.0)  # heartbeats come and go: nobody is told of a joiner that prepares
        assert [w.pending_workers for w in members] == [0, 0]
        assert coordinator.service.metrics()["workers_preparing"] == 1

        call = asyncio.ensure_future(joiner.allreduce(np.full(8, 3.0), op="sum", name="first"))
        async with asyncio.timeout(10):
            while not members[0].pending_workers:  # its first collective said it is ready
                await asyncio.sleep(0.02)
        assert not call.done()  # and waits to be admitted
        await members[0].admit_waiting()
        async with asyncio.timeout(10):
            while not all(w.node.planes.current is not None and w.size == 3 for w in [*members, joiner]):
                await asyncio.sleep(0.02)
        outs = await asyncio.wait_for(asyncio.gather(
            *(w.allreduce(np.full(8, float(w.rank + 1)), op="sum", name="first") for w in members), call), 20)
        assert [o.tolist() for o in outs] == [[6.0] * 8] * 3
        assert joiner.rank == 2 and not joiner.node.preparing
    finally:
        await asyncio.gather(*(w.close() for w in [*members, joiner]), return_exceptions=True)
        await coordinator.stop()
