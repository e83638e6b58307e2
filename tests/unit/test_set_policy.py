"""The pure part of process sets (worker/ops/set_policy.py) and the per-view registry, without sockets.

Every rank decides on the same gathered requests, so these functions alone say which id a set
gets and which error every rank raises.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.errors import InvalidArgumentError, RingChangedError
from ringserve.worker.ops.process_sets import ProcessSet, Registry, WholeWorld
from ringserve.worker.ops.set_policy import (
    AddRequest,
    RemoveRequest,
    decide_add,
    decide_init,
    decide_remove,
    ranks_of,
    root_position,
)


def add(ranks: tuple[int, ...], n: int) -> list[AddRequest]:
    return [AddRequest(ranks=ranks)] * n


def test_ranks_are_sorted_and_numpy_integers_count_as_integers() -> None:
    assert ranks_of([3, np.int64(0), 2]) == [0, 2, 3]
    assert ProcessSet(reversed(range(1, 4))).ranks == [1, 2, 3]


@pytest.mark.parametrize("ranks", [[0, 1.5], ["0"], [True, 1], None])
def test_ranks_that_are_not_integers_are_refused_naming_them(ranks: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"integer ranks|list of ranks"):
        ProcessSet(ranks)  # type: ignore[arg-type]


def test_ids_are_the_smallest_free_ones_and_are_reused() -> None:
    assert decide_add(add((0, 2), 4), {}, 4) == 1
    assert decide_add(add((1, 3), 4), {1: (0, 2)}, 4) == 2
    assert decide_add(add((1,), 4), {2: (1, 3)}, 4) == 1  # 1 was removed: reused
    assert decide_add(add((0,), 4), {1: (1,), 2: (1, 3)}, 4) == 3


@pytest.mark.parametrize(("ranks", "says"), [
    ((0, 0, 1), "must not repeat: [0]"),
    ((0, 5), "[5] of the process set [0, 5] are not ranks of the view: they must be in [0, 4)"),
    ((-1, 2), "[-1]"),
    ((), "at least one rank"),
    ((0, 1, 2, 3), "global process set (id 0)"),
    ((1, 3), "registered already as id 7"),
])
def test_a_wrong_set_is_refused_naming_the_value(ranks: tuple[int, ...], says: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        decide_add(add(ranks, 4), {7: (1, 3)}, 4)
    assert says in str(caught.value)


def test_ranks_that_ask_for_different_sets_all_fail_naming_who_asked_what() -> None:
    requests = [AddRequest(ranks=(0, 1)), AddRequest(ranks=(0, 1)), AddRequest(ranks=(0, 2))]
    with pytest.raises(InvalidArgumentError) as caught:
        decide_add(requests, {}, 3)
    text = str(caught.value)
    assert "ranks [0, 1] asked for ranks [0, 1]" in text and "ranks [2] asked for ranks [0, 2]" in text


def test_one_rank_with_wrong_arguments_fails_every_rank_alike() -> None:
    # Rank 1's own check failed: it still takes part, with its error, and every rank raises.
    requests = [AddRequest(ranks=(0, 1)), AddRequest(error="bad ranks")]
    with pytest.raises(InvalidArgumentError, match=r"an invalid set \(bad ranks\)"):
        decide_add(requests, {}, 2)


def test_an_object_registered_already_in_this_view_is_a_duplicate() -> None:
    with pytest.raises(InvalidArgumentError, match=r"registered already as id 2"):
        decide_add([AddRequest(ranks=(0,), registered=2)] * 2, {2: (0,)}, 2)


def test_remove_takes_the_id_every_rank_names() -> None:
    assert decide_remove([RemoveRequest(process_set_id=2, ranks=(1, 3))] * 3, {2: (1, 3)}) == 2


@pytest.mark.parametrize(("requests", "says"), [
    ([RemoveRequest(error="the global process set cannot be removed")] * 2, "global process set cannot be removed"),
    ([RemoveRequest(process_set_id=1, ranks=(0,)), RemoveRequest(process_set_id=2, ranks=(1,))], "differently"),
    ([RemoveRequest(process_set_id=3, ranks=(0,))] * 2, "Process set 3 is not registered"),
])
def test_a_wrong_removal_fails_on_every_rank(requests: list[RemoveRequest], says: str) -> None:
    with pytest.raises(InvalidArgumentError, match=says):
        decide_remove(requests, {1: (0,), 2: (1,)})


def test_init_registers_a_list_all_or_none_and_names_registered_sets_again_without_error() -> None:
    sets = [AddRequest(ranks=(0,)), AddRequest(ranks=(1, 2))]
    assert decide_init([sets] * 3, {}, 3) == [1, 2]
    assert decide_init([sets] * 3, {1: (0,), 2: (1, 2)}, 3) == [1, 2]  # a second init of the same sets
    assert decide_init([[AddRequest(ranks=(2,)), *sets]] * 3, {1: (0,)}, 3) == [2, 1, 3]


@pytest.mark.parametrize(("lists", "says"), [
    ([[AddRequest(ranks=(0,)), AddRequest(ranks=(0,))]] * 2, "names the process set of ranks [0] twice"),
    ([[AddRequest(ranks=(0,)), AddRequest(ranks=(0, 1))]] * 2, "global process set"),
    ([[AddRequest(ranks=(0,))], []], "lists of different lengths"),
    ([[AddRequest(ranks=(0,))], [AddRequest(ranks=(1,))]], "at position 0 differently"),
])
def test_init_with_a_wrong_list_fails_on_every_rank(lists: list[list[AddRequest]], says: str) -> None:
    with pytest.raises(InvalidArgumentError, match=says.replace("[", "\\[")):
        decide_init(lists, {}, 2)


def test_roots_are_global_ranks_of_members() -> None:
    assert root_position((1, 3, 4), 3, 2) == 1
    with pytest.raises(InvalidArgumentError, match=r"root rank \(2\) is not in process set 2 \(ranks \[1, 3, 4\]\)"):
        root_position((1, 3, 4), 2, 2)


def registered(registry: Registry, ranks: list[int]) -> ProcessSet:
    ps, request = registry.add_request(ranks)
    assert ps is not None
    sid = decide_add([request], registry.sets, registry.size)
    registry.sets[sid] = tuple(ps.ranks)
    ps._bind(registry, sid)
    return ps


def test_a_set_lives_as_long_as_its_view() -> None:
    registry = Registry()
    registry.enter(view=3, rank=1, size=4)
    ps = registered(registry, [1, 2])
    assert (ps.process_set_id, ps.size(), ps.rank(), ps.included()) == (1, 2, 0, True)
    assert registry.lookup(ps, synced_here=False) == (1, 2)
    registry.enter(view=4, rank=0, size=3)  # a new view: no sets, ranks renumbered
    assert registry.sets == {}
    with pytest.raises(RingChangedError) as changed:
        registry.lookup(ps, synced_here=False)
    assert "registered in view 3" in str(changed.value)
    # After an elastic reset synced in view 4, the same set is a usage error: not registered again.
    with pytest.raises(InvalidArgumentError, match=r"in a reset callback"):
        registry.lookup(ps, synced_here=True)
    again, request = registry.add_request(ps)
    assert again is ps and request.registered is None  # registering it again is a new add


def test_a_collective_on_a_set_without_this_rank_or_unregistered_is_refused() -> None:
    registry = Registry()
    registry.enter(view=1, rank=0, size=3)
    others = registered(registry, [1, 2])
    assert others.included() is False
    with pytest.raises(InvalidArgumentError, match=r"Rank 0 is not in process set 1 \(ranks \[1, 2\]\)"):
        registry.lookup(others, synced_here=False)
    with pytest.raises(InvalidArgumentError, match=r"not part of provided process set"):
        others.rank()
    with pytest.raises(InvalidArgumentError, match=r"not registered"):
        registry.lookup(ProcessSet([0, 1]), synced_here=False)
    foreign = Registry()
    foreign.enter(view=1, rank=0, size=3)
    with pytest.raises(InvalidArgumentError, match=r"another worker"):
        foreign.lookup(others, synced_here=False)


def test_the_global_set_cannot_be_added_or_removed_and_reads_its_worker() -> None:
    world = WholeWorld(lambda: (2, 5))
    assert (world.process_set_id, world.ranks, world.size(), world.rank(), world.included()) == (0, [0, 1, 2, 3, 4], 5, 2, True)
    assert str(world) == "ProcessSet(process_set_id=0, ranks=[0, 1, 2, 3, 4], mpi_comm=None)"
    registry = Registry()
    assert "registered always" in registry.add_request(world)[1].error
    assert "cannot be removed" in registry.remove_request(world).error
