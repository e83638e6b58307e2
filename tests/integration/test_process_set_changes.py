"""Process sets when the world changes, between real workers: a set lives as long as its view.

A member that leaves fails the set's collectives in flight with a RecoverableError (its stream
ended: PeerUnavailableError, or the view changed first: RingChangedError); afterwards the
set's collectives fail with RingChangedError (recoverable: elastic training resets), and once the
elastic state is synced in the new view (pinned) with InvalidArgumentError, until the set is
registered again, which the survivors do in a reset callback (see docs/guide/process-sets.md).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ringserve import InvalidArgumentError, RecoverableError, RingChangedError, Worker

pytestmark = pytest.mark.timeout(90)


async def wait_for_new_view(workers: list[Worker], old: int) -> None:
    async with asyncio.timeout(15):
        while any(w.view_id == old for w in workers):
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("world", [{"n": 4, "coordinator": {"min_workers": 2}}], indirect=True, ids=["4 of min 2"])
async def test_a_set_whose_member_left_fails_and_works_again_once_registered_again(world) -> None:
    workers = world.workers
    leaver = workers[3]
    sets = await world.each(lambda w: asyncio.gather(w.add_process_set([0, 3]), w.add_process_set([1, 2])))
    old = workers[0].view_id
    # Rank 0 waits in a collective of the set that loses rank 3, which leaves instead of joining it.
    waiting = asyncio.create_task(workers[0].allreduce(np.ones(4), name="ps-left", process_set=sets[0][0]))
    await asyncio.sleep(0.2)
    await leaver.close()
    # Recoverable, as the whole view's collectives fail: the leaver's stream ended under it
    # (PeerUnavailableError) or the new view came first (RingChangedError).
    with pytest.raises(RecoverableError):
        await asyncio.wait_for(waiting, 15)
    stay = workers[:3]
    await wait_for_new_view(stay, old)
    assert {w.size for w in stay} == {3}
    # Every set of the old view is stale, the one whose members all stayed too (ranks are renumbered).
    for w in stay:
        for ps in sets[w.rank]:
            if ps.included():
                with pytest.raises(RingChangedError, match=r"registered in view"):
                    await w.allreduce(np.ones(2), process_set=ps)
    # After an elastic sync in the new view (the view is pinned), the stale set is a usage error.
    new = stay[0].view_id
    stay[1].pin_view(new)
    try:
        with pytest.raises(InvalidArgumentError, match=r"reset callback"):
            await stay[1].allreduce(np.ones(2), process_set=sets[1][1])
    finally:
        stay[1].pin_view(None)
    # Registered again (the same objects, as a reset callback does), on the survivors' new ranks.
    again = await asyncio.gather(*(w.add_process_set(sets[i][1]) for i, w in enumerate(stay)))
    assert [ps.process_set_id for ps in again] == [1, 1, 1] and all(a is sets[i][1] for i, a in enumerate(again))
    members = [w for w in stay if w.rank in again[0].ranks]
    outs = await asyncio.gather(*(w.allreduce(np.full(2, 1.0 + w.rank), op="sum", process_set=sets[stay.index(w)][1])
                                  for w in members))
    total = sum(1.0 + r for r in again[0].ranks)
    assert [o.tolist() for o in outs] == [[total, total]] * len(members)


@pytest.mark.parametrize("world", [{"n": 3, "coordinator": {"min_workers": 2}}], indirect=True, ids=["3 of min 2"])
async def test_a_set_rank_outside_the_smaller_world_is_refused_on_every_rank_when_registered_again(world) -> None:
    sets = await world.each(lambda w: w.add_process_set([0, 2]))
    old = world.workers[0].view_id
    await world.workers[2].close()
    stay = world.workers[:2]
    await wait_for_new_view(stay, old)
    outcomes = await asyncio.gather(*(w.add_process_set(sets[i]) for i, w in enumerate(stay)), return_exceptions=True)
    assert all(isinstance(o, InvalidArgumentError) and "must be in [0, 2)" in str(o) for o in outcomes), outcomes
