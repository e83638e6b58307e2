"""Collectives over sub-rings of a view, proved by the simulator (tests/ringsim.py).

A sub-ring runs the shipped programs over some of the view's ranks, on the same planes, links and
inbound streams as the whole view's collectives, at the same time. The simulator runs both under
random interleavings and checks every result; a wrong program, and frames sent on the wrong link,
fail it. Nothing here opens a socket.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
from reference import numpy_reduce
from ringsim import make_ring, shut, simulate, simulate_rings
from test_ring import case_seed, check_every_collective, every_collective

from ringserve.errors import (
    CollectiveTimeoutError,
    InvalidArgumentError,
    PeerUnavailableError,
    ProtocolError,
    RingChangedError,
)
from ringserve.ring import reduce_scatter_step, segment_bounds
from ringserve.worker.dataplane import keys, programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import Program, Ring, executor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Raw
from ringserve.worker.ops import collectives

T = 10.0
RINGS = [
    (3, (0, 2)),
    (5, (0, 2, 3)),
    (5, (3, 0, 2)),  # a ring order other than rank order
    (5, (4,)),       # a ring of one
    (8, (1, 2, 3, 4, 5, 6, 7)),
    (8, (6, 1, 4)),
]


@pytest.mark.parametrize(("world", "members"), RINGS, ids=[f"{m} of {w}" for w, m in RINGS])
async def test_every_collective_over_a_sub_ring_runs_beside_the_whole_views_and_both_are_exact(
    world: int, members: tuple[int, ...]
) -> None:
    results = await simulate_rings(world, {None: every_collective, members: every_collective},
                                   seed=case_seed("sub", world, members))
    check_every_collective(world, results[None])
    check_every_collective(len(members), results[members])


@pytest.mark.parametrize("lanes", [False, True], ids=["stream", "lanes"])
@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksums"])
async def test_overlapping_sub_rings_and_the_whole_view_run_at_once_through_the_same_links(
    lanes: bool, checksum: bool
) -> None:
    rings = {None: every_collective, (0, 2, 3): every_collective, (1, 2, 4): every_collective,
             (4, 3): every_collective}
    results = await simulate_rings(5, rings, seed=case_seed("overlap", lanes, checksum), lanes=lanes,
                                   checksum=checksum)
    for members in rings:
        check_every_collective(5 if members is None else len(members), results[members])


@pytest.mark.parametrize("seed", range(8))
async def test_many_sub_ring_allreduces_under_random_interleavings_sum_their_members_only(seed: int) -> None:
    world, members = 5, (0, 2, 3)
    xs = [np.arange(37, dtype=np.int64) * (r + 1) + seed for r in range(world)]

    def over(ranks: tuple[int, ...] | None) -> Any:
        async def call(session: Session, position: int) -> list[np.ndarray]:
            rank = position if ranks is None else ranks[position]
            return [await collectives.allreduce(session, xs[rank], op="sum", name=f"n{i % 2}", chunk_bytes=24,
                                                timeout_s=T) for i in range(4)]
        return call

    results = await simulate_rings(world, {None: over(None), members: over(members)}, seed=seed)
    for outs in results[None]:
        assert all((o == numpy_reduce(xs, "sum")).all() for o in outs)
    for outs in results[members]:
        assert all((o == numpy_reduce([xs[m] for m in members], "sum")).all() for o in outs)


# -- a wrong program, or a wrong route, fails the simulator ------------------------------------------


def reduce_scatter_from_the_wrong_segment(ring: Ring, bounds: list[tuple[int, int]], chunk_elems: int) -> Program:
    """Ring allreduce whose first step sends the segment after the right one."""
    seg = reduce_scatter_step(ring.index, ring.size, 0)[0]
    shift = bounds[(seg + 1) % ring.size][0] - bounds[seg][0]
    for step in programs.ring_reduce(ring, bounds, chunk_elems, gather=True):
        if isinstance(step, programs.Lead):
            step = programs.Lead(step.slot, step.chunk, step.a + shift, step.b + shift)
        yield step


def allgather_that_stops_forwarding_early(ring: Ring, bounds: list[tuple[int, int]], chunk_elems: int) -> Program:
    """Ring allreduce in which position 0 forwards nothing in the allgather."""
    for step in programs.ring_reduce(ring, bounds, chunk_elems, gather=True):
        if not (isinstance(step, programs.Forward) and ring.index == 0):
            yield step


def with_program(program: Any, xs: list[np.ndarray], members: tuple[int, ...] | None) -> Any:
    async def call(session: Session, position: int) -> np.ndarray:
        n = session.place.size
        rank = position if members is None else members[position]
        buf = np.empty_like(xs[rank])
        await executor.run(session, None, Descriptor("allreduce"), 1.0, program(executor.ring_of(session), segment_bounds(buf.size, n), 2),
                           Raw(xs[rank], buf, "sum", n))
        expected = numpy_reduce(xs if members is None else [xs[m] for m in members], "sum")
        np.testing.assert_array_equal(buf, expected, err_msg=f"position {position} of {members}")
        return buf
    return call


async def test_the_simulator_fails_a_wrong_program_over_a_sub_ring_while_the_whole_view_runs_beside_it() -> None:
    world, members = 5, (0, 2, 3)
    xs = [np.arange(12, dtype=np.int64) * (r + 1) for r in range(world)]
    good = lambda r, b, c: programs.ring_reduce(r, b, c, gather=True)  # noqa: E731
    results = await simulate_rings(world, {None: with_program(good, xs, None), members: with_program(good, xs, members)},
                                   seed=1)
    assert len(results[members]) == 3
    with pytest.raises(AssertionError, match=r"Arrays are not equal"):
        await simulate_rings(world, {None: with_program(good, xs, None),
                                     members: with_program(reduce_scatter_from_the_wrong_segment, xs, members)}, seed=2)
    with pytest.raises(CollectiveTimeoutError):
        await simulate_rings(world, {None: with_program(good, xs, None),
                                     members: with_program(allgather_that_stops_forwarding_early, xs, members)}, seed=3)


async def test_frames_sent_on_the_wrong_link_are_refused_not_used() -> None:
    # A session whose route disagrees with its key: its key names the ring (0, 2, 3), but it
    # sends to the next rank of (0, 3, 2). Its frames reach ranks that expect them from another
    # sender, and are refused.
    async def call(session: Session, rank: int) -> np.ndarray | None:
        if rank not in (0, 2, 3):
            return None
        sub = session.plane.session((0, 2, 3))
        if rank == 0:
            sub.ring = Ring((0, 3, 2), 0)
        return await collectives.allreduce(sub, np.ones(6), op="sum", name="misrouted", chunk_bytes=16, timeout_s=2)

    with pytest.raises(ProtocolError, match=r"came from rank 0, but rank 3 of view 1 receives that collective's "
                                            "frames from rank 2 only"):
        await simulate(5, call, seed=4)


# -- ownership of streams and keys ------------------------------------------------------------------


async def test_a_stream_that_ends_fails_only_the_collectives_that_wait_on_its_sender() -> None:
    planes = make_ring(4, random.Random(5))
    try:
        x = np.ones(8)
        # Rank 1 waits on rank 0 in the whole view, and on rank 2 in the sub-ring (2, 1).
        whole = asyncio.ensure_future(collectives.allreduce(planes[1].session(), x, op="sum", name="w",
                                                            chunk_bytes=16, timeout_s=T))
        await asyncio.sleep(0.05)
        gone = PeerUnavailableError("The stream from rank 0 of view 1 broke.")
        planes[1].starve((0,), gone)
        with pytest.raises(PeerUnavailableError, match=r"rank 0 of view 1 broke"):
            await whole
        outs = await asyncio.gather(*(collectives.allreduce(planes[r].session((2, 1)), x * r, op="sum", name="s",
                                                            chunk_bytes=16, timeout_s=T) for r in (1, 2)))
        assert [o.tolist() for o in outs] == [[3.0] * 8] * 2
        # A whole-view collective opened later still waits on rank 0: it starves at once.
        with pytest.raises(PeerUnavailableError):
            await collectives.allreduce(planes[1].session(), x, op="sum", name="w2", chunk_bytes=16, timeout_s=T)
    finally:
        await shut(planes)


async def test_a_leaver_with_its_stream_still_open_is_not_starved_until_that_stream_ends() -> None:
    # A leaver let go at a commit is dropped from the view before it drains: its last frames may
    # still be on their way, so a graceful change starves only the leavers that stream nothing.
    planes = make_ring(3, random.Random(8))
    try:
        x = np.ones(8)
        # Rank 0's link to rank 1 opens with its first send: a whole-view allreduce.
        outs = await asyncio.gather(*(collectives.allreduce(p.session(), x, op="sum", name="a", chunk_bytes=16,
                                                            timeout_s=T) for p in planes))
        assert [o.tolist() for o in outs] == [[3.0] * 8] * 3
        error = RingChangedError(1, 2)
        planes[1].let_go((0,), error)  # rank 0 left, its stream to rank 1 is still open
        late = asyncio.ensure_future(collectives.allreduce(planes[1].session(), x, op="sum", name="b",
                                                           chunk_bytes=16, timeout_s=T))
        await asyncio.sleep(0.05)
        assert not late.done(), "a leaver whose stream is open was starved at once"
        link = planes[0].link_to(1)
        assert link is not None
        link.end()
        with pytest.raises((RingChangedError, PeerUnavailableError)):
            await late
        # Rank 0 never streamed to rank 2: a leaver that streams nothing starves rank 2's waits at once.
        planes[2].let_go((0,), error)
        with pytest.raises(RingChangedError):
            await collectives.allreduce(planes[2].session((0, 2)), x, op="sum", name="c", chunk_bytes=16, timeout_s=T)
    finally:
        await shut(planes)


@pytest.mark.parametrize(("members", "says"), [
    ((), "at least one rank"),
    ((0, 0, 1), "must not repeat"),
    ((0, 5), "are not in [0, 4)"),
    ((0, 2), "Rank 1 is not a member of the ring (0, 2)"),
])
async def test_a_sub_ring_that_this_rank_cannot_run_is_refused_with_the_reason(members: tuple[int, ...], says: str) -> None:
    planes = make_ring(4, random.Random(6))
    try:
        with pytest.raises(InvalidArgumentError) as caught:
            planes[1].session(members)
        assert says in str(caught.value)
    finally:
        await shut(planes)


def test_a_key_names_its_ring_whatever_the_name_holds() -> None:
    whole = Ring.whole(2, 5)
    assert keys.make("a#b/c", 3, "") == "a#b/c#3"
    assert keys.ring_of(keys.make("a#b/c", 3, ""), whole, 1) is whole
    sub = keys.make("grad/x#1", 7, keys.spec_of((3, 0, 2)))
    assert sub == "grad/x#1#7/3.0.2" and keys.split(sub) == ("grad/x#1", "7", "3.0.2")
    assert keys.ring_of(sub, whole, 1) == Ring((3, 0, 2), 2)
    assert keys.source(Ring((3, 0, 2), 2)) == 0 and keys.source(Ring((4,), 0)) == -1
    for bad in ("x#1/0.1", "x#1/2.2", "x#1/2.9", "x#1/2.a", "x#1/."):
        with pytest.raises(ProtocolError, match=r"names a ring"):
            keys.ring_of(bad, whole, 1)


async def test_a_sub_ring_of_every_rank_is_counted_apart_from_the_whole_view() -> None:
    # The same unnamed allreduce on the whole view and on a ring of every rank, called in
    # opposite orders by the two ranks: their keys differ, so neither takes the other's frames.
    async def call(session: Session, rank: int) -> list[np.ndarray]:
        every = session.plane.session((0, 1))
        a = collectives.allreduce(session, np.full(3, 1.0), op="sum", name=None, chunk_bytes=8, timeout_s=T)
        b = collectives.allreduce(every, np.full(3, 10.0), op="sum", name=None, chunk_bytes=8, timeout_s=T)
        first, second = (a, b) if rank == 0 else (b, a)
        t1 = asyncio.ensure_future(first)
        t2 = asyncio.ensure_future(second)
        out = await asyncio.gather(t1, t2)
        return out if rank == 0 else out[::-1]

    results = await simulate(2, call, seed=7)
    for whole, every in results:
        assert whole.tolist() == [2.0] * 3 and every.tolist() == [20.0] * 3


async def test_a_retired_plane_ends_every_link_it_opened_once_idle() -> None:
    planes = make_ring(4, random.Random(8))
    outs = await asyncio.gather(*(collectives.allreduce(planes[r].session((0, 2)), np.ones(4), op="sum", name=None,
                                                        chunk_bytes=8, timeout_s=T) for r in (0, 2)))
    assert all(o.tolist() == [2.0] * 4 for o in outs)
    assert sorted(planes[0].linked_ranks) == [1, 2] and sorted(planes[2].linked_ranks) == [0, 3]
    for p in planes:
        p.retire(RingChangedError(1, 2, "test"))
    async with asyncio.timeout(5):
        for p in planes:
            await p.wait_closed()
    assert all(p.drained for p in planes)
    await shut(planes)
