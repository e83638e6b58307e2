"""Allreduces over sub-rings of a view between real workers, over real sockets, at the same time as
the whole view's collectives (``worker.collectives.allreduce_among``, which process sets build on).

A sub-ring opens links to the ranks it sends to on first use, and its frames share the inbound
streams of the whole view's, routed by key: these tests check the results bit for bit, with the
global collectives and other sub-rings running at once, in worlds of 2 to 5 (one worker of each
has shared memory off, so the payloads cross both paths).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from ringserve import InvalidArgumentError

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

# Per world: sub-rings, some overlapping, some in an order other than rank order, one of one rank.
RINGS = {
    2: [(0, 1), (1, 0), (1,)],
    3: [(0, 2), (2, 1), (0, 1, 2)],
    4: [(0, 2, 3), (1, 3), (3, 2, 1, 0)],
    5: [(0, 2, 3), (1, 4), (4, 3, 1), (2,)],
}


def data(rank: int, i: int, dtype: Any = np.int64, n: int = 301) -> np.ndarray:
    return (np.arange(n) % 17 + 3 * rank + i).astype(dtype)


@pytest.mark.parametrize("n", sorted(RINGS))
async def test_sub_ring_allreduces_run_beside_global_collectives_and_sum_only_their_members(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    rings = RINGS[n]
    rounds = 3

    async def rank_part(w: Any) -> dict[Any, list[np.ndarray]]:
        r = w.rank
        calls: dict[Any, Any] = {}
        # Global ones, interleaved with the sub-rings' on every rank.
        calls["global"] = asyncio.gather(*(w.allreduce(data(r, i), op="sum", name=f"sub-g{n}-{i}")
                                           for i in range(rounds)))
        calls["gather"] = w.allgather(np.full(2, r), name=f"sub-ag{n}")
        for k, members in enumerate(rings):
            if r in members:
                calls[members] = asyncio.gather(*(
                    w.collectives.allreduce_among(members, data(r, i, np.float64 if k % 2 else np.int64), op="sum",
                                       name=f"sub-{n}-{k}-{i}")
                    for i in range(rounds)))
        keys = list(calls)
        outs = await asyncio.gather(*calls.values())
        return dict(zip(keys, outs, strict=True))

    results = await world.each(rank_part)
    for r, got in enumerate(results):
        for i in range(rounds):
            expected = sum(data(k, i) for k in range(n))
            assert got["global"][i].tobytes() == expected.tobytes(), f"rank {r} global {i}"
        assert got["gather"].tolist() == [k for k in range(n) for _ in range(2)]
        for k, members in enumerate(rings):
            if r not in members:
                assert members not in got
                continue
            dtype = np.float64 if k % 2 else np.int64
            for i in range(rounds):
                expected = np.zeros(301, dtype=dtype)
                for m in members:
                    expected = expected + data(m, i, dtype)
                np.testing.assert_array_equal(got[members][i], expected, err_msg=f"rank {r} ring {members} round {i}")
    # Every member holds the same bytes for each sub-ring.
    for members in rings:
        for i in range(rounds):
            firsts = {results[m][members][i].tobytes() for m in members}
            assert len(firsts) == 1


async def test_an_average_over_a_sub_ring_divides_by_its_members(shared_worlds) -> None:
    world = await shared_worlds(4)
    members = (3, 1)
    outs = await asyncio.gather(*(w.collectives.allreduce_among(members, np.full(5, float(w.rank)), op="average", name="sub-avg")
                                  for w in world.workers if w.rank in members))
    assert [o.tolist() for o in outs] == [[2.0] * 5] * 2


@pytest.mark.parametrize(("members", "says"), [
    ((0, 0, 1), "must not repeat"),
    ((0, 9), "are not in [0, 3)"),
    ((1, 2), "Rank 0 is not a member of the ring (1, 2)"),
])
async def test_a_sub_ring_this_rank_cannot_run_is_refused_at_once_naming_why(shared_worlds, members: Any, says: str) -> None:
    world = await shared_worlds(3)
    with pytest.raises(InvalidArgumentError) as caught:
        await world.workers[0].collectives.allreduce_among(members, np.ones(2), op="sum", name="sub-bad")
    assert says in str(caught.value)
    # Nothing was opened: the world still runs its collectives.
    outs = await world.each(lambda w: w.allreduce(np.ones(2), op="sum", name="sub-after-bad"))
    assert all(o.tolist() == [3.0, 3.0] for o in outs)


async def test_a_sub_ring_opens_a_link_to_its_next_member_only_and_only_on_first_use(shared_worlds) -> None:
    world = await shared_worlds(5)
    members = (0, 3)

    def linked() -> dict[int, set[int]]:
        return {w.rank: set(w.node.planes.current.linked_ranks) for w in world.workers}  # type: ignore[union-attr]

    before = linked()
    assert all(w.rank + 1 - 5 * (w.rank == 4) in before[w.rank] for w in world.workers)  # the view's successor
    await asyncio.gather(*(w.collectives.allreduce_among(members, np.ones(8), op="sum", name="sub-links")
                           for w in world.workers if w.rank in members))
    after = linked()
    assert after == {**before, 0: before[0] | {3}, 3: before[3] | {0}}
