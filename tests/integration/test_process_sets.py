"""Process sets between real workers over real sockets: registration on every rank, every kind of
collective over concurrent sets beside the whole view's, and bad input refused at once on every
rank, in worlds of 2 to 5 (one worker of each has shared memory off, so payloads cross both paths).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from ringserve import InvalidArgumentError, ProcessSet, Worker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(90)]


def x_of(rank: int, n: int = 301) -> np.ndarray:
    return (np.arange(n) % 23 + 5 * rank).astype(np.float64)


def wanted(n: int) -> list[list[int]]:
    """Even ranks, odd ranks, and (from 3 ranks) a set overlapping both, given unsorted."""
    sets = [list(range(0, n, 2)), list(range(1, n, 2))]
    if n >= 3:
        sets.append([n - 1, 0] if n > 3 else [1, 0])
    return sets


async def over_set(w: Worker, ps: ProcessSet, tag: str) -> dict[str, Any]:
    members, me = ps.ranks, w.rank
    pos = ps.rank()
    assert pos is not None
    n = len(members)
    splits = [(pos + d) % 2 + 1 for d in range(n)]
    rows = np.full((sum(splits), 3), me, dtype=np.int32)
    calls = {
        "sum": w.allreduce(x_of(me), op="sum", name=f"{tag}.sum", process_set=ps),
        "avg": w.allreduce(x_of(me), op="average", name=f"{tag}.avg", process_set=ps),
        "bcast": w.broadcast(x_of(me), root=members[-1], name=f"{tag}.bcast", process_set=ps),
        "gather": w.allgather(np.full(pos + 1, me), name=f"{tag}.gather", process_set=ps),
        "scatter": w.reduce_scatter(x_of(me)[:7], op="sum", name=f"{tag}.scatter", process_set=ps),
        "a2a": w.alltoall(rows, splits=splits, name=f"{tag}.a2a", process_set=ps),
        "ggather": w.grouped_allgather([np.full(2, me), np.full((1, 2), float(me))], name=f"{tag}.gg",
                                       process_set=ps),
        "gscatter": w.grouped_reduce_scatter([x_of(me)[:5], np.ones(n, dtype=np.int64)], op="sum",
                                             name=f"{tag}.gs", process_set=ps),
        "objs": w.allgather_object(f"r{me}", name=f"{tag}.objs", process_set=ps),
        "obj": w.broadcast_object(me, root=members[0], name=f"{tag}.obj", process_set=ps),
        "barrier": w.barrier(process_set=ps),
    }
    outs = await asyncio.gather(*calls.values())
    return dict(zip(calls, outs, strict=True))


def check(members: list[int], got: dict[str, Any], me: int) -> None:
    n, pos = len(members), members.index(me)
    xs = [x_of(m) for m in members]
    assert got["sum"].tobytes() == sum(xs).tobytes()
    np.testing.assert_allclose(got["avg"], sum(xs) / n)
    np.testing.assert_array_equal(got["bcast"], x_of(members[-1]))
    assert got["gather"].tolist() == [m for k, m in enumerate(members) for _ in range(k + 1)]
    np.testing.assert_array_equal(got["scatter"], np.array_split(sum(x[:7] for x in xs), n)[pos])
    received, counts = got["a2a"]
    assert counts.tolist() == [(k + pos) % 2 + 1 for k in range(n)]
    assert received[:, 0].tolist() == [m for k, m in enumerate(members) for _ in range((k + pos) % 2 + 1)]
    g1, g2 = got["ggather"]
    assert g1.tolist() == [m for m in members for _ in range(2)] and g2[:, 0].tolist() == members
    s1, s2 = got["gscatter"]
    np.testing.assert_array_equal(s1, np.array_split(sum(x[:5] for x in xs), n)[pos])
    assert s2.tolist() == [n]
    assert got["objs"] == [f"r{m}" for m in members] and got["obj"] == members[0]
    assert got["barrier"] is None


@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_every_collective_over_concurrent_sets_beside_the_whole_views(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    sets = await world.each(lambda w: _add_all(w, wanted(n)))
    ids = [[ps.process_set_id for ps in per_rank] for per_rank in sets]
    assert ids == [list(range(1, len(wanted(n)) + 1))] * n  # the same ids on every rank

    async def part(w: Worker) -> tuple[Any, dict[int, dict[str, Any]]]:
        mine = [ps for ps in sets[w.rank] if ps.included()]
        whole = w.allreduce(x_of(w.rank), op="sum", name=f"ps-whole{n}")
        outs = await asyncio.gather(whole, *(over_set(w, ps, f"ps{n}.{ps.process_set_id}") for ps in mine))
        return outs[0], {ps.process_set_id: o for ps, o in zip(mine, outs[1:], strict=True)}  # type: ignore[misc]

    results = await world.each(part)
    for r, (whole, per_set) in enumerate(results):
        assert whole.tobytes() == sum(x_of(k) for k in range(n)).tobytes()
        for ps in sets[r]:
            if r in ps.ranks:
                check(ps.ranks, per_set[ps.process_set_id], r)
    await world.each(lambda w: _remove_all(w, sets[w.rank]))
    assert all(w.process_sets() == {0: list(range(n))} for w in world.workers)


async def _add_all(w: Worker, ranks: list[list[int]]) -> list[ProcessSet]:
    return [await w.add_process_set(r) for r in ranks]


async def _remove_all(w: Worker, sets: list[ProcessSet]) -> None:
    for ps in sets:
        await w.remove_process_set(ps)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_sets_run_at_once_a_slow_set_does_not_hold_up_another(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    sets = await world.each(lambda w: _add_all(w, [[0], list(range(1, n))]))
    hold = 1.0

    async def part(w: Worker) -> float:
        slow, rest = sets[w.rank]
        start = time.monotonic()
        if w.rank == 0:  # the set of rank 0 alone waits; the others' set runs meanwhile
            await asyncio.sleep(hold)
            await w.allreduce(np.ones(3), name="ps-slow", process_set=slow)
        else:
            out = await w.allreduce(np.ones(3), op="sum", name="ps-fast", process_set=rest)
            assert out.tolist() == [n - 1.0] * 3
        return time.monotonic() - start

    took = await world.each(part)
    assert max(took[1:]) < hold, f"the other set waited for rank 0: {took}"
    await world.each(lambda w: _remove_all(w, sets[w.rank]))


@pytest.mark.parametrize(("n", "bad", "says"), [
    (2, [0, 0], "must not repeat: [0]"),
    (3, [1, 3], "[3] of the process set [1, 3] are not ranks of the view: they must be in [0, 3)"),
    (4, [0, 1, 2, 3], "global process set (id 0)"),
    (5, [], "at least one rank"),
])
async def test_a_wrong_set_asked_by_every_rank_fails_on_every_rank_at_once(shared_worlds, n: int, bad: list[int],
                                                                         says: str) -> None:
    world = await shared_worlds(n)
    start = time.monotonic()
    outcomes = await world.each_outcome(lambda w: w.add_process_set(bad))
    assert time.monotonic() - start < 5  # at once: not after a deadline
    assert all(isinstance(o, InvalidArgumentError) and says in str(o) for o in outcomes), outcomes
    assert all(w.process_sets() == {0: list(range(n))} for w in world.workers)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_one_rank_asking_for_another_set_fails_every_rank_naming_who_asked_what(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    outcomes = await world.each_outcome(lambda w: w.add_process_set([0, n - 1] if w.rank == 0 else [0]))
    texts = {str(o) for o in outcomes}
    assert all(isinstance(o, InvalidArgumentError) for o in outcomes) and len(texts) == 1
    assert f"ranks [0] asked for ranks [0, {n - 1}]" in texts.pop()


async def test_a_collective_on_a_set_without_this_rank_or_unregistered_is_refused_at_once(shared_worlds) -> None:
    world = await shared_worlds(3)
    sets = await world.each(lambda w: w.add_process_set([1, 2]))
    zero = world.workers[0]
    for call in (lambda: zero.allreduce(np.ones(2), process_set=sets[0]),
                 lambda: zero.alltoall(np.ones(2), process_set=sets[0]),
                 lambda: zero.barrier(process_set=sets[0])):
        with pytest.raises(InvalidArgumentError, match=r"Rank 0 is not in process set 1 \(ranks \[1, 2\]\)"):
            await call()
    with pytest.raises(InvalidArgumentError, match=r"root rank \(0\) is not in process set 1"):
        await world.workers[1].broadcast(np.ones(2), root=0, process_set=sets[1])
    with pytest.raises(InvalidArgumentError, match=r"not registered"):
        await zero.allreduce(np.ones(2), process_set=ProcessSet([0, 1]))
    with pytest.raises(InvalidArgumentError, match=r"another worker"):
        await zero.allreduce(np.ones(2), process_set=sets[1])  # rank 1's object
    outcomes = await world.each_outcome(lambda w: w.remove_process_set(w.global_process_set))
    assert all(isinstance(o, InvalidArgumentError) and "global process set cannot be removed" in str(o)
               for o in outcomes)
    await world.each(lambda w: w.remove_process_set(sets[w.rank]))
    assert [ps.process_set_id for ps in sets] == [None] * 3


async def test_init_style_registration_is_all_or_none_and_idempotent(shared_worlds) -> None:
    world = await shared_worlds(4)
    outcomes = await world.each_outcome(lambda w: w.add_process_sets([ProcessSet([0]), ProcessSet([0, 1, 2, 3])]))
    assert all(isinstance(o, InvalidArgumentError) for o in outcomes)
    assert all(w.process_sets() == {0: [0, 1, 2, 3]} for w in world.workers)  # none registered
    first = await world.each(lambda w: w.add_process_sets([ProcessSet([0]), ProcessSet([3, 1])]))
    again = await world.each(lambda w: w.add_process_sets([ProcessSet([1, 3]), ProcessSet([2])]))
    assert [[p.process_set_id for p in sets] for sets in first] == [[1, 2]] * 4
    assert [[p.process_set_id for p in sets] for sets in again] == [[2, 3]] * 4
    await world.each(lambda w: _remove_all(w, [first[w.rank][0], again[w.rank][0], again[w.rank][1]]))
