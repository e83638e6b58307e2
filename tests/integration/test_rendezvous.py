"""Rendezvous of real workers: staggered starts settle into one view; hints order the first view."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from ringserve import Coordinator, RendezvousTimeoutError, Worker, WorkerConfig


async def start_staggered(address: str, make_worker_config, delays: list[float], **overrides) -> list[Worker]:
    workers = [Worker(config=make_worker_config(address, **overrides)) for _ in delays]

    async def start(w: Worker, delay: float) -> None:
        await asyncio.sleep(delay)
        await w.start()

    try:
        async with asyncio.timeout(30):
            await asyncio.gather(*(start(w, d) for w, d in zip(workers, delays, strict=True)))
    except BaseException:
        await asyncio.gather(*(w.close() for w in workers))
        raise
    return workers


async def test_four_workers_that_start_over_two_seconds_form_one_view_of_four(make_coordinator_config, make_worker_config) -> None:
    # min_workers=1: without the settle window the first worker would form a view of its own.
    config = make_coordinator_config(min_workers=1, settle_s=1.0)
    async with Coordinator(config) as coord:
        workers = await start_staggered(coord.address, make_worker_config, [0.0, 0.6, 1.2, 1.8])
        try:
            assert coord.service.views_formed == 1
            assert {w.size for w in workers} == {4}
            assert {w.view_id for w in workers} == {1}
            assert sorted(w.rank for w in workers) == [0, 1, 2, 3]
            # The earliest joiner is rank 0: ranks follow join order without hints.
            assert [w.rank for w in workers] == [0, 1, 2, 3]
            outs = await asyncio.gather(*(w.allreduce(np.ones(3), op="sum") for w in workers))
            assert all(o.tolist() == [4.0] * 3 for o in outs)
        finally:
            await asyncio.gather(*(w.close() for w in workers))


async def test_rank_hints_decide_the_ranks_of_the_first_view(make_coordinator_config, make_worker_config) -> None:
    async with Coordinator(make_coordinator_config(min_workers=3, settle_s=0.2)) as coord:
        hints = [2, 0, 1]
        workers = [Worker(config=make_worker_config(coord.address, rank_hint=h)) for h in hints]
        try:
            await asyncio.gather(*(w.start() for w in workers))
            assert [w.rank for w in workers] == hints
        finally:
            await asyncio.gather(*(w.close() for w in workers))


async def test_workers_beyond_max_workers_wait_outside_the_view(make_coordinator_config, make_worker_config) -> None:
    async with Coordinator(make_coordinator_config(min_workers=2, max_workers=2, settle_s=0.1)) as coord:
        members = await start_staggered(coord.address, make_worker_config, [0.0, 0.0])
        extra = Worker(config=make_worker_config(coord.address, rendezvous_timeout_s=0.6))
        try:
            with pytest.raises(RendezvousTimeoutError):
                await extra.start()
            assert {w.size for w in members} == {2}
            assert coord.service.views_formed == 1
        finally:
            await asyncio.gather(*(w.close() for w in members))


# init() returns at once in a running world (admit_when_ready); the barrier says it is ready, and waits.
WAITER = "import ringserve as rs; rs.init(); rs.barrier(); print('admitted', flush=True)"


async def test_a_waiting_worker_that_dies_is_dropped_at_once_and_never_admitted(make_coordinator_config) -> None:
    # A worker waiting to be admitted that dies (`docker stop` before its elastic loop handles
    # SIGTERM, a kill) was admitted at the next commit as if alive, and its members' sync then
    # failed on it: now its watch stream's end drops it, long before the heartbeat timeout (60 s).
    config = make_coordinator_config(min_workers=1, settle_s=0.1, heartbeat_timeout_s=60.0)
    async with Coordinator(config) as coord:
        member = await Worker(config=WorkerConfig(coordinator=coord.address, use_uvloop=False)).start()
        env = {**os.environ, "RINGSERVE_COORDINATOR": coord.address, "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60"}
        waiter = subprocess.Popen([sys.executable, "-c", WAITER], env=env, stdout=subprocess.PIPE)
        try:
            async with asyncio.timeout(30):
                while member.pending_workers != 1:  # its heartbeats' count of admissible workers
                    await asyncio.sleep(0.05)
            waiter.send_signal(signal.SIGTERM)  # no handler yet: the default action ends it
            assert await asyncio.to_thread(waiter.wait, 10) == -signal.SIGTERM
            async with asyncio.timeout(5):
                while member.pending_workers:
                    await asyncio.sleep(0.05)
            assert await member.admit_waiting() == 0
            assert coord.service.view.members[0].worker_id == member.worker_id and len(coord.service.view.members) == 1
        finally:
            if waiter.poll() is None:
                waiter.kill()
                waiter.wait()
            await member.close()
