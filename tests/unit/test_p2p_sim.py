"""Point-to-point messages (worker/ops/p2p.py), proved by the simulator (tests/ringsim.py).

A message is a collective of the ring (sender, receiver) on the view's planes and links, so the
simulator runs it exactly as it ships, beside the whole view's collectives, under random
interleavings: both directions of a pair at once, several tags, recvs posted before or long after
their sends. Nothing here opens a socket.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
from ringsim import make_ring, shut, simulate
from test_ring import case_seed

from ringserve.errors import InvalidArgumentError, MismatchError, PeerUnavailableError
from ringserve.worker.dataplane import programs
from ringserve.worker.dataplane.programs import Ring
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import collectives, p2p

T = 10.0


def payload(src: int, dst: int, tag: int, n: int, size: int) -> np.ndarray:
    """The n-th message from src to dst under tag: known to both ends."""
    return (np.arange(size, dtype=np.float64) + 1000 * src + 100 * dst + 10 * tag + n) * (n + 1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("world", [2, 4])
async def test_messages_both_ways_at_once_under_several_tags_arrive_in_order_beside_an_allreduce(
    world: int, seed: int
) -> None:
    # Ranks 0 and world - 1 exchange 3 messages each way under each of 2 tags, all in flight at
    # once, with recvs posted in another order than the sends (tag 1 first), and the whole view
    # runs an allreduce meanwhile.
    a, b, sizes = 0, world - 1, [0, 1, 9, 40]

    async def call(session: Session, rank: int) -> Any:
        ops: list[Any] = []
        got: dict[tuple[int, int], list[np.ndarray]] = {}
        if rank in (a, b):
            peer = b if rank == a else a
            out, back = session.plane.session(p2p.pair(rank, peer)), session.plane.session(p2p.pair(peer, rank))
            for tag in (0, 1):
                for n in range(3):
                    ops.append(p2p.send(out, payload(rank, peer, tag, n, sizes[n + tag]), name=f"t{tag}",
                                        chunk_bytes=24, timeout_s=T))
            for tag in (1, 0):
                got[(peer, tag)] = [np.empty(sizes[n + tag]) for n in range(3)]
                ops += [p2p.recv(back, buf, name=f"t{tag}", chunk_bytes=24, timeout_s=T) for buf in got[(peer, tag)]]
        ops.append(collectives.allreduce(session, np.ones(5) * rank, op="sum", name="w", chunk_bytes=16, timeout_s=T))
        results = await asyncio.gather(*ops)
        assert (results[-1] == sum(range(world))).all()
        for (peer, tag), bufs in got.items():
            for n, buf in enumerate(bufs):
                np.testing.assert_array_equal(buf, payload(peer, rank, tag, n, sizes[n + tag]),
                                              err_msg=f"rank {rank}: message {n} from {peer} with tag {tag}")
        return len(got)

    counts = await simulate(world, call, seed=case_seed("p2p", world, seed))
    assert counts[a] == counts[b] == 2


async def test_a_recv_posted_long_after_its_send_finds_the_message_waiting() -> None:
    async def call(session: Session, rank: int) -> Any:
        if rank == 2:
            await p2p.send(session.plane.session((2, 0)), np.arange(7, dtype=np.int32), name="late", chunk_bytes=8,
                           timeout_s=T)
            return "sent"
        if rank == 0:
            for _ in range(50):
                await asyncio.sleep(0)
            buf = np.zeros(7, dtype=np.int32)
            return (await p2p.recv(session.plane.session((2, 0)), buf, name="late", chunk_bytes=8, timeout_s=T)).tolist()
        return None

    assert await simulate(3, call, seed=3) == [list(range(7)), None, "sent"]


async def test_a_recv_of_another_size_fails_naming_both_not_by_its_deadline() -> None:
    async def call(session: Session, rank: int) -> Any:
        ring = session.plane.session((0, 1))
        if rank == 0:
            await p2p.send(ring, np.ones(5), name="m", chunk_bytes=64, timeout_s=T)
            return None
        with pytest.raises(MismatchError, match=r"rank 0: message float64 x5; rank 1: message float64 x4"):
            await p2p.recv(ring, np.zeros(4), name="m", chunk_bytes=64, timeout_s=T)
        return "refused"

    assert (await asyncio.wait_for(simulate(2, call, seed=1, aborts=True), 5.0))[1] == "refused"


async def test_a_recv_fails_when_its_senders_stream_ends() -> None:
    planes = make_ring(3, random.Random(2))
    try:
        pending = asyncio.ensure_future(p2p.recv(planes[1].session((2, 1)), np.zeros(3), name="m", chunk_bytes=8,
                                                 timeout_s=T))
        await asyncio.sleep(0.05)
        assert not pending.done()
        planes[1].stream_ended(2, clean=False)
        with pytest.raises(PeerUnavailableError, match=r"rank 2"):
            await asyncio.wait_for(pending, 2.0)
    finally:
        await shut(planes)


def test_a_message_needs_two_distinct_ranks_and_the_right_ends() -> None:
    with pytest.raises(InvalidArgumentError, match=r"rank 3 to itself"):
        p2p.pair(3, 3)
    with pytest.raises(ValueError, match=r"ring of two"):
        list(programs.message(Ring((0, 1, 2), 0), 4, 2))


async def test_a_send_on_the_receivers_end_is_refused_before_anything_is_sent() -> None:
    planes = make_ring(2, random.Random(4))
    try:
        with pytest.raises(InvalidArgumentError, match=r"A send runs on the ring"):
            await p2p.send(planes[1].session((0, 1)), np.ones(2), name="m", chunk_bytes=8, timeout_s=T)
        with pytest.raises(InvalidArgumentError, match=r"writable, C-contiguous"):
            await p2p.recv(planes[1].session((0, 1)), np.ones((4, 4))[:, ::2], name="m", chunk_bytes=8, timeout_s=T)
    finally:
        await shut(planes)
