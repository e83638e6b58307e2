"""Integrity without TLS: a byte flipped on the link between two workers, by a relay.

With checksums on, the damaged chunk aborts its collective on every rank with CorruptFrameError
and is never summed, and the next collective runs normally. With checksums off the same flip goes
unnoticed and the sum is wrong, which shows the relay damages real tensor bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from relay import Relay
from worlds import coordinator_config, free_port, worker_config

from ringserve import Coordinator, Worker
from ringserve.errors import CorruptFrameError

pytestmark = pytest.mark.timeout(60)

ONES = np.ones(1 << 16, dtype=np.float32)
PATTERN = ONES[:8].tobytes()  # eight float32 1.0s in a row: found only inside tensor data
# Eight 2.0s: with every rank's input all ones, only the allgather phase carries the sum.
GATHERED = (2 * ONES[:8]).tobytes()



class Pair:
    """Two workers; the stream into the second one runs through a relay that flips a byte once."""

    def __init__(self) -> None:
        self.coordinator: Coordinator | None = None
        self.workers: list[Worker] = []
        self.relay: Relay | None = None

    async def start(self, checksums: tuple[bool, bool], flip_after: bytes = PATTERN) -> None:
        self.coordinator = await Coordinator(coordinator_config(min_workers=2, max_workers=2)).start()
        port = free_port()
        self.relay = Relay(port, flip_after=flip_after)
        relay_port = await self.relay.start()
        configs = [
            # The relay sits on the TCP stream, so payloads must travel in it, not in shared memory.
            # The ring's steps: the damage is placed by them (its last allgather step).
            worker_config(self.coordinator.address, checksum=checksums[0], shared_memory=False, algorithm="ring"),
            worker_config(self.coordinator.address, checksum=checksums[1], bind_port=port, advertise_port=relay_port,
                          shared_memory=False, algorithm="ring"),
        ]
        self.workers = [Worker(config=c) for c in configs]
        await asyncio.gather(*(w.start() for w in self.workers))

    async def allreduce(self, name: str) -> list[object]:
        async with asyncio.timeout(30):
            return list(await asyncio.gather(
                *(w.allreduce(ONES, op="sum", name=name) for w in self.workers), return_exceptions=True))

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)
        if self.relay is not None:
            await self.relay.close()
        if self.coordinator is not None:
            await self.coordinator.stop()


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[Pair]:
    p = Pair()
    yield p
    await p.close()


async def test_a_corrupted_chunk_aborts_the_collective_on_every_rank_and_the_next_one_runs(pair: Pair) -> None:
    await pair.start(checksums=(True, True))
    outcomes = await pair.allreduce("damaged")
    assert pair.relay is not None and pair.relay.flipped == 1
    for outcome in outcomes:
        assert isinstance(outcome, CorruptFrameError), outcome
        assert "corrupted (crc32 mismatch); it was not used" in str(outcome)
        assert "'damaged#1'" in str(outcome)
    again = await pair.allreduce("after")
    for out in again:
        assert isinstance(out, np.ndarray) and np.array_equal(out, 2 * ONES)
    assert pair.workers[1].counters.frames_rejected >= 1


async def test_without_checksums_the_same_flip_goes_unnoticed_and_the_sum_is_wrong(pair: Pair) -> None:
    await pair.start(checksums=(False, False))
    outs = await pair.allreduce("damaged")
    assert pair.relay is not None and pair.relay.flipped == 1
    assert all(isinstance(o, np.ndarray) for o in outs)
    assert not all(np.array_equal(o, 2 * ONES) for o in outs)  # type: ignore[arg-type]


async def test_a_worker_that_requires_checksums_refuses_frames_without_one(pair: Pair) -> None:
    await pair.start(checksums=(False, True))
    pair.relay.flip_after = b""  # type: ignore[union-attr]
    outcomes = await pair.allreduce("unchecked")
    for outcome in outcomes:
        assert isinstance(outcome, CorruptFrameError), outcome
        assert "without a checksum, but this worker requires checksums" in str(outcome)


async def test_a_chunk_damaged_in_the_last_allgather_step_fails_the_collective_on_every_rank(pair: Pair) -> None:
    """Only the damaged rank sees it; the confirmation lap keeps the other from returning first."""
    await pair.start(checksums=(True, True), flip_after=GATHERED)
    outcomes = await pair.allreduce("gathered")
    assert pair.relay is not None and pair.relay.flipped == 1
    for outcome in outcomes:
        assert isinstance(outcome, CorruptFrameError), outcome


async def test_a_damaged_collective_name_fails_the_collective_on_every_rank_without_waiting_for_its_timeout(pair: Pair) -> None:
    await pair.start(checksums=(True, True), flip_after=b"damaged")
    started = asyncio.get_running_loop().time()
    outcomes = await pair.allreduce("damaged")
    assert pair.relay is not None and pair.relay.flipped == 1
    for outcome in outcomes:
        assert isinstance(outcome, CorruptFrameError), outcome
    assert asyncio.get_running_loop().time() - started < 10  # the collective timeout is 30 s
    assert all(not w.node.planes.current._inboxes for w in pair.workers)  # type: ignore[union-attr]
    again = await pair.allreduce("after")
    assert all(isinstance(o, np.ndarray) and np.array_equal(o, 2 * ONES) for o in again)
