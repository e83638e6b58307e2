"""The worker's view-change policy, decide(state, view) -> (state, actions): pure, no sockets."""

from __future__ import annotations

import pytest

from ringserve.errors import RingChangedError
from ringserve.worker.dataplane import policy
from ringserve.worker.dataplane.policy import (
    Close,
    CloseRetired,
    Member,
    Open,
    Place,
    Retire,
    Starve,
    State,
    View,
    decide,
)


def view(view_id: int, *ids: str, left: tuple[str, ...] = (), failed: tuple[str, ...] = ()) -> View:
    return View(view_id, tuple(Member(i, f"host-{i}:1") for i in ids), frozenset(left), frozenset(failed))


def in_view(worker_id: str, v: View) -> State:
    """The state of a worker that installed ``v``."""
    state, _ = decide(State(worker_id), v)
    return state


def kinds(actions: list[policy.Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_the_first_view_with_this_worker_opens_its_place_there() -> None:
    state, actions = decide(State("b"), view(1, "a", "b", "c"))
    # every member's host (its cross rank) travels with the place, for hierarchical allreduce
    assert actions == [Open(Place(1, 1, 3, ("host-a:1", "host-b:1", "host-c:1"), ("a", "b", "c"), hosts=(0, 0, 0)))]
    assert state.latest_view == 1 and state.current == actions[0].place


def test_a_view_without_this_worker_opens_nothing_but_is_heard_of() -> None:
    state, actions = decide(State("z"), view(3, "a", "b"))
    assert actions == [] and state.latest_view == 3 and state.current is None


@pytest.mark.parametrize("news", [1, 2], ids=["the same view", "an older view"])
def test_a_view_not_newer_than_the_latest_changes_nothing(news: int) -> None:
    state = in_view("a", view(2, "a", "b"))
    assert decide(state, view(news, "a", "b", "c")) == (state, [])


def test_a_stopped_worker_ignores_every_later_view() -> None:
    state = policy.stop(in_view("a", view(2, "a", "b")))
    assert state.current is None
    assert decide(state, view(3, "a", "b")) == (state, [])


def test_a_failure_closes_the_current_plane_and_every_retired_one_before_the_new_one_opens() -> None:
    state = in_view("a", view(2, "a", "b", "c"))
    state, actions = decide(state, view(3, "a", "c", failed=("b",)))
    assert kinds(actions) == ["Close", "CloseRetired", "Open"]
    close = actions[0]
    assert isinstance(close, Close) and close.view_id == 2
    assert isinstance(close.error, RingChangedError) and (close.error.old_view, close.error.new_view) == (2, 3)
    assert isinstance(actions[1], CloseRetired) and actions[1].error is close.error
    assert state.current is not None and state.current.view_id == 3 and state.current.size == 2


def test_a_graceful_change_retires_the_old_plane_and_starves_only_the_ranks_that_left() -> None:
    state = in_view("b", view(2, "a", "b", "c", "d"))
    state, actions = decide(state, view(3, "a", "b", "d", left=("c",)))
    assert kinds(actions) == ["Retire", "Starve", "Open"]
    starve = actions[1]
    assert isinstance(starve, Starve) and starve.view_id == 2 and starve.ranks == (2,)
    assert isinstance(actions[0], Retire) and starve.error is actions[0].error
    assert state.current is not None and state.current.rank == 1


def test_a_joiner_starves_nobody() -> None:
    state = in_view("a", view(2, "a", "b"))
    _, actions = decide(state, view(3, "a", "b", "c"))
    assert kinds(actions) == ["Retire", "Open"]


def test_a_member_missing_from_a_non_empty_view_left_even_unlisted() -> None:
    state = in_view("a", view(2, "a", "b", "c"))
    _, actions = decide(state, view(3, "a", "b"))
    assert Starve(2, (2,), actions[0].error) in actions  # type: ignore[union-attr]


def test_an_empty_view_starves_only_the_workers_it_lists_as_leaving() -> None:
    # The world fell below min_workers: the others are still draining their streams.
    state = in_view("a", view(2, "a", "b", "c"))
    state, actions = decide(state, view(3, left=("c",)))
    assert kinds(actions) == ["Retire", "Starve"]
    assert isinstance(actions[1], Starve) and actions[1].ranks == (2,)
    assert state.current is None and state.latest_view == 3


def test_this_worker_leaving_starves_no_rank_for_itself() -> None:
    state = in_view("b", view(2, "a", "b"))
    _, actions = decide(state, view(3, "a", left=("b",)))
    assert kinds(actions) == ["Retire"]


def test_a_view_that_keeps_everyone_bumps_the_plane_and_opens_the_same_place_anew() -> None:
    # The coordinator re-forms a ring cut off in part (a "bump"): same members, a new view.
    state = in_view("c", view(4, "a", "b", "c"))
    state, actions = decide(state, view(5, "a", "b", "c"))
    assert kinds(actions) == ["Retire", "Open"]
    assert state.current is not None and (state.current.view_id, state.current.rank) == (5, 2)


def test_the_place_carries_the_members_host_layout() -> None:
    members = (Member("a", "x:1", 0, 2, 0, 2), Member("b", "x:2", 1, 2, 0, 2), Member("c", "y:1", 0, 1, 1, 2))
    _, actions = decide(State("b"), View(1, members))
    place = actions[0].place  # type: ignore[union-attr]
    assert (place.local_rank, place.local_size, place.cross_rank, place.cross_size) == (1, 2, 0, 2)
