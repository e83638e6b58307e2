"""join() with Horovod's semantics for uneven data, run by the ring simulator (tests/ringsim.py): ranks
that have joined stand in for the others' collectives (zeros for allreduce, refusal for the rest)
until every rank has joined, and every rank returns the same last rank to join."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from ringsim import simulate

from ringserve.errors import MismatchError, ProtocolError, UsageError
from ringserve.observe import Counters
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.keys import MAX_SKIPPED
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.session import Place, Session
from ringserve.worker.ops import collectives, grouped, join

T = 10.0
CHUNK = 16


def x_of(rank: int, n: int, dtype: Any = np.float64) -> np.ndarray:
    return (np.arange(n) % 7 + rank + 1).astype(dtype)


async def join_now(session: Session) -> int:
    return await join.join(session, chunk_bytes=CHUNK, timeout_s=T, join_timeout_s=T)


async def train(session: Session, rank: int, steps: int) -> list[np.ndarray]:
    """``steps`` rounds of what a training loop issues: named allreduces two at a time, an unnamed
    and a compressed one, and a barrier."""
    out = []
    for _ in range(steps):
        a, b = await asyncio.gather(
            collectives.allreduce(session, x_of(rank, 11), op="average", name="grad.a", chunk_bytes=CHUNK, timeout_s=T),
            collectives.allreduce(session, x_of(rank, 5, np.int32), op="sum", name="grad.b", chunk_bytes=CHUNK,
                                  timeout_s=T))
        c = await collectives.allreduce(session, x_of(rank, 3, np.float32), op="max", name=None, chunk_bytes=CHUNK,
                                        timeout_s=T)
        d = await collectives.allreduce(session, x_of(rank, 300, np.float32), op="sum", name="coded",
                                        chunk_bytes=CHUNK, timeout_s=T, compression="fp16")
        await collectives.barrier(session, timeout_s=T)
        out += [a, b, c, d]
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 7])
async def test_ranks_that_joined_add_zeros_to_the_allreduces_of_the_others_and_all_return_the_last_to_join(world: int) -> None:
    # Rank r has r + 1 steps of data: rank 0 joins first, the last rank last.
    async def call(session: Session, rank: int) -> tuple[list[np.ndarray], int]:
        results = await train(session, rank, rank + 1)
        return results, await join_now(session)

    outcomes = await simulate(world, call, seed=world)
    for r, (results, last) in enumerate(outcomes):
        assert last == world - 1, f"rank {r} says rank {last} joined last"
        for step in range(r + 1):
            live = range(step, world)  # ranks with data at this step; the others added zeros
            a, b, c, d = results[4 * step: 4 * step + 4]
            np.testing.assert_allclose(a, sum(x_of(k, 11) for k in live) / world)  # Average divides by the world
            np.testing.assert_array_equal(b, sum(x_of(k, 5, np.int32) for k in live))
            np.testing.assert_array_equal(c, np.maximum(np.max([x_of(k, 3, np.float32) for k in live], axis=0), 0))
            np.testing.assert_allclose(d, sum(x_of(k, 300, np.float32) for k in live), rtol=2e-3)


@pytest.mark.parametrize("world", [2, 3, 5])
async def test_a_rank_that_joins_while_its_own_collective_is_in_flight_still_serves_it(world: int) -> None:
    # The last rank starts an allreduce and joins before it ends; the others join at once. Their
    # joins may end before that allreduce's frames reached them, so they must stay joined until
    # they took part in it.
    async def call(session: Session, rank: int) -> tuple[Any, int]:
        pending = None
        if rank == world - 1:
            x = x_of(rank, 1000, np.float32)
            pending = asyncio.ensure_future(
                collectives.allreduce(session, x, op="sum", name="late", chunk_bytes=CHUNK, timeout_s=T))
            await asyncio.sleep(0)
        last = await join_now(session)
        return (await pending if pending is not None else None), last

    outcomes = await simulate(world, call, seed=world)
    np.testing.assert_array_equal(outcomes[-1][0], x_of(world - 1, 1000, np.float32))
    assert {last for _, last in outcomes} == {world - 1}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["allgather", "broadcast", "alltoall", "reduce_scatter", "grouped_allgather",
                                  "broadcast_object"])
async def test_collectives_other_than_allreduce_fail_at_once_on_every_rank_while_one_has_joined(world: int, kind: str) -> None:
    grace = 0.5

    async def other(session: Session, rank: int) -> Any:
        x = x_of(rank, 2 * world, np.float32)
        opts: dict[str, Any] = {"name": "x", "chunk_bytes": CHUNK, "timeout_s": T}
        if kind == "allgather":
            return await collectives.allgather(session, x, **opts)
        if kind == "broadcast":
            return await collectives.broadcast(session, x, root=world - 1, **opts)
        if kind == "alltoall":
            return await collectives.alltoall(session, x, **opts)
        if kind == "reduce_scatter":
            return await collectives.reduce_scatter(session, x, op="sum", **opts)
        if kind == "grouped_allgather":
            return await grouped.grouped_allgather(session, [x, x[:1]], **opts)
        return await collectives.broadcast_object(session, {"r": rank}, root=world - 1, **opts)

    async def call(session: Session, rank: int) -> tuple[str, float, int]:
        outcome = "joined first"
        started = time.monotonic()
        if rank != 0:
            try:
                await other(session, rank)
                outcome = "no error"
            except MismatchError as exc:
                outcome = "refused" if "while a rank has joined" in str(exc) else f"other: {exc}"
        took = time.monotonic() - started
        return outcome, took, await join_now(session)

    outcomes = await simulate(world, call, seed=world, abort_grace_s=grace, aborts=True)
    assert outcomes[0][0] == "joined first"
    for r, (outcome, took, last) in enumerate(outcomes):
        if r:
            assert outcome == "refused" and took < grace + 1.0, (r, outcome, took)
        assert last != 0 and last == outcomes[0][2]


async def test_joins_one_after_the_other_and_collectives_after_them_work_as_before() -> None:
    world = 3

    async def call(session: Session, rank: int) -> list[Any]:
        got: list[Any] = []
        for round_ in range(3):
            if rank == round_:  # rank k sits out round k
                got.append(await join_now(session))
            else:
                s = await collectives.allreduce(session, x_of(rank, 4), op="sum", name="w", chunk_bytes=CHUNK,
                                                timeout_s=T)
                got.append((s, await join_now(session)))
        got.append(await collectives.allgather(session, x_of(rank, 2), name=None, chunk_bytes=CHUNK, timeout_s=T))
        return got

    outcomes = await simulate(world, call, seed=3)
    for r, got in enumerate(outcomes):
        for round_ in range(3):
            if r == round_:
                assert got[round_] != round_
            else:
                total, last = got[round_]
                np.testing.assert_array_equal(total, sum(x_of(k, 4) for k in range(world) if k != round_))
                assert last != round_
        np.testing.assert_array_equal(got[3], np.concatenate([x_of(k, 2) for k in range(world)]))
    assert len({tuple(g[i] if isinstance(g[i], int) else g[i][1] for i in range(3)) for g in outcomes}) == 1


def stand_in(text: str) -> join.Stand | None:
    return join.stand_in(Descriptor.parse(text))


def test_stand_in_adds_zeros_to_allreduces_takes_part_in_barriers_and_refuses_the_rest() -> None:
    assert stand_in("allreduce float32 (5, 5) op=average") == join.Zeros(np.dtype(np.float32), (5, 5), "average", None)
    assert stand_in("allreduce int64 () op=sum") == join.Zeros(np.dtype(np.int64), (), "sum", None)
    assert stand_in("allreduce float64 (7,) op=sum codec=int8") == join.Zeros(np.dtype(np.float64), (7,), "sum", "int8")
    assert stand_in("allreduce float32 (8,) op=adasum parts=(5, 3)") == join.Zeros(np.dtype(np.float32), (8,), "adasum",
                                                                                   None)
    assert stand_in("barrier") == join.Along()
    assert stand_in("join") is None
    for descriptor in ("allgather float32 (*, 17, 17)", "broadcast float32 (3,) root=1", "alltoall int32 (*, )",
                       "reduce_scatter float32 (4,) op=sum", "broadcast_object root=0",
                       "allreduce float32 (4,) op=sum stage=cross", "allreduce float32 (4,) op=sum invalid: no"):
        plan = stand_in(descriptor)
        assert isinstance(plan, join.Refuse) and "while a rank has joined" in plan.reason, descriptor
    # A text that is no descriptor (a broken peer) is refused as any collective.
    plan = join.stand_in(Descriptor(""))
    assert isinstance(plan, join.Refuse) and plan.reason.startswith("a collective is not supported"), plan


def test_the_last_to_join_opened_the_most_collectives_then_joined_latest_then_has_the_highest_rank() -> None:
    assert join.last_to_join([(4, 10.0), (9, 1.0), (7, 99.0)]) == 1
    assert join.last_to_join([(4, 10.0), (4, 12.0), (3, 99.0)]) == 1
    assert join.last_to_join([(4, 5.0), (4, 5.0)]) == 1


async def test_the_last_to_join_counts_only_what_each_rank_did_since_the_last_join() -> None:
    # Round 0: rank 1 trains three steps after rank 0 joined; round 1: rank 0 trains one step after
    # rank 1 joined. Counted over both rounds, rank 1 did more; rank 0 joined last in round 1.
    async def call(session: Session, rank: int) -> list[int]:
        lasts = []
        for round_, (idle, steps) in enumerate(((0, 3), (1, 1))):
            if rank != idle:
                for _ in range(steps):
                    await collectives.allreduce(session, x_of(rank, 3), op="sum", name=f"r{round_}", chunk_bytes=CHUNK,
                                                timeout_s=T)
            lasts.append(await join_now(session))
        return lasts

    assert await simulate(2, call, seed=2) == [[1, 0], [1, 0]]


async def test_opening_a_key_out_of_order_keeps_the_keys_it_passed_over_open_and_refuses_a_far_one() -> None:
    plane = Plane(Place(view_id=1, rank=0, size=1, addresses=("a",)), Counters(), 1.0)
    session, numbering = plane.session(), plane.numbering
    key, _ = session.open(None, "barrier", key="#3")
    session.release(key)
    assert numbering.behind({"": 3})  # #1 and #2 were passed over: not yet opened
    assert not plane._finished("#2") and plane._finished("#3")
    for k in ("#1", "#2"):
        session.release(session.open(None, "barrier", key=k)[0])
    assert not numbering.behind({"": 3}) and numbering.behind({"": 4, "other": 1})
    assert session.open(None, "barrier")[0] == "#4"  # a real open goes on after the stand-ins
    assert numbering.opened == 1 and numbering.counts() == {"": 4}
    with pytest.raises(ProtocolError, match=r"past the last of its name"):
        session.open(None, "barrier", key=f"#{5 + MAX_SKIPPED}")


async def test_a_joined_rank_stands_in_for_the_whole_views_collectives_only_and_counts_only_those() -> None:
    plane = Plane(Place(view_id=1, rank=0, size=1, addresses=("a",)), Counters(), 1.0)
    whole, sub = plane.session(), plane.session((0,))
    assert sub.open("g", "barrier")[0] == "g#1/0"
    assert whole.open("g", "barrier")[0] == "g#1"
    assert plane.numbering.opened == 1 and plane.numbering.counts() == {"g": 1}
    assert not plane.numbering.behind({"g": 1})
    with pytest.raises(UsageError, match=r"whole view's collectives only"):
        sub.open("g", "barrier", key="g#2")
    with pytest.raises(ProtocolError, match=r"not one of the whole view's"):
        whole.open("g", "barrier", key="g#2/0")
    assert plane.numbering.counts() == {"g": 1}


async def test_a_sub_ring_of_ranks_still_working_runs_apart_from_a_rank_that_has_joined() -> None:
    # Rank 0 joins at once; ranks 1 and 2 run allreduces over their own sub-ring and over the whole
    # view. Rank 0 adds zeros to the whole view's and never sees (nor stands in for) the sub-ring's.
    world = 3

    async def call(session: Session, rank: int) -> tuple[Any, ...]:
        if rank == 0:
            return (await join_now(session),)
        pair = session.plane.session((2, 1))
        s, w = await asyncio.gather(
            collectives.allreduce(pair, x_of(rank, 9), op="average", name="g", chunk_bytes=CHUNK, timeout_s=T),
            collectives.allreduce(session, x_of(rank, 9), op="average", name="g", chunk_bytes=CHUNK, timeout_s=T))
        return s, w, await join_now(session)

    outcomes = await simulate(world, call, seed=5)
    for r in (1, 2):
        s, w, _ = outcomes[r]
        np.testing.assert_allclose(s, (x_of(1, 9) + x_of(2, 9)) / 2)  # the pair's own average
        np.testing.assert_allclose(w, (x_of(1, 9) + x_of(2, 9)) / world)  # the view's, with rank 0's zeros
    assert {o[-1] for o in outcomes} == {outcomes[1][-1]} and outcomes[1][-1] != 0


async def test_a_sub_ring_collective_that_reaches_a_joined_rank_waits_for_it_to_open_it_after_the_join() -> None:
    # Rank 1 starts an allreduce over the ring (1, 0) and joins; rank 0 has joined already. Rank 0
    # must not stand in for it with zeros (join is over the whole view): it runs it after the join.
    world = 3

    async def call(session: Session, rank: int) -> tuple[Any, int]:
        pair = session.plane.session((1, 0)) if rank < 2 else None
        if rank == 1:
            assert pair is not None
            pending = asyncio.ensure_future(
                collectives.allreduce(pair, x_of(rank, 40), op="sum", name="p", chunk_bytes=CHUNK, timeout_s=T))
            await asyncio.sleep(0)
            last = await join_now(session)
            return await pending, last
        last = await join_now(session)
        if pair is None:
            return None, last
        return await collectives.allreduce(pair, x_of(rank, 40), op="sum", name="p", chunk_bytes=CHUNK,
                                           timeout_s=T), last

    outcomes = await simulate(world, call, seed=7)
    for r in (0, 1):
        np.testing.assert_array_equal(outcomes[r][0], x_of(0, 40) + x_of(1, 40))
    assert len({last for _, last in outcomes}) == 1
