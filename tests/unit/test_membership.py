"""The membership state machine, driven with an injected clock: no coordinator, no loop."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

import pytest

from ringserve.coordinator.membership import (
    Admit,
    Claim,
    Heartbeat,
    Join,
    Leave,
    MemberInfo,
    Probe,
    ProbeResult,
    PublishView,
    Ready,
    Removed,
    Rules,
    State,
    Suspect,
    Tick,
    ViewInfo,
    admissible,
    is_known,
    provisional,
    step,
)


class Machine:
    """A State and the actions it produced, advanced by events at explicit times."""

    def __init__(self, min_workers: int = 1, max_workers: int = 16, settle_s: float = 1.0, heartbeat_timeout_s: float = 1000.0) -> None:
        self.state = State(rules=Rules(min_workers, max_workers, settle_s, heartbeat_timeout_s))
        self.views: list[ViewInfo] = []
        self.removed: list[Removed] = []

    def at(self, now: float, *events: object) -> list[object]:
        actions: list[object] = []
        for event in events or (Tick(),):
            self.state, new = step(self.state, event, now)  # type: ignore[arg-type]
            actions += new
        for action in actions:
            if isinstance(action, PublishView):
                self.views.append(action.view)
            elif isinstance(action, Removed):
                self.removed.append(action)
        return actions

    def join(self, now: float, *ids: str, hints: Iterable[int] | None = None) -> None:
        hints = list(hints) if hints is not None else [-1] * len(ids)
        self.at(now, *(Join(i, f"addr-{i}", "host", h) for i, h in zip(ids, hints, strict=True)))

    def admit(self, now: float, by: str) -> None:
        """A member of the running view asks for the waiting workers to be let in."""
        self.at(now, Admit(by))

    @property
    def view(self) -> ViewInfo:
        return self.state.view

    def ids(self) -> list[str]:
        return [m.worker_id for m in self.view.members]


def test_no_view_forms_before_min_workers_have_joined() -> None:
    m = Machine(min_workers=3, settle_s=0.0)
    m.join(0.0, "a", "b")
    m.at(100.0)
    assert m.views == [] and m.view.view_id == 0 and m.view.members == ()


def test_the_first_view_forms_only_after_membership_is_stable_for_the_settle_window() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.join(0.0, "a")
    m.join(0.5, "b")
    m.at(1.49)
    assert m.views == []
    m.at(1.5)
    assert [v.view_id for v in m.views] == [1]
    assert m.ids() == ["a", "b"]


def test_a_full_world_forms_its_view_at_once_without_settling() -> None:
    # max_workers have joined: nobody else can come in, so there is nothing to settle for.
    m = Machine(min_workers=2, max_workers=3, settle_s=5.0)
    m.join(0.0, "a", "b")
    m.at(1.0)
    assert m.views == []  # 2 of 3: still settling
    m.join(1.5, "c")
    assert [v.view_id for v in m.views] == [1] and m.ids() == ["a", "b", "c"]


def test_admitting_into_a_full_world_does_not_settle_either() -> None:
    m = Machine(min_workers=2, max_workers=3, settle_s=5.0)
    m.join(0.0, "a", "b", "c")
    m.at(0.0, Leave("b"))
    assert m.ids() == ["a", "c"]
    m.join(1.0, "d")
    m.admit(1.0, by="a")
    assert m.ids() == ["a", "c", "d"] and m.view.view_id == 3


def test_workers_joining_within_the_settle_window_of_each_other_land_in_one_view() -> None:
    m = Machine(min_workers=1, settle_s=1.0)
    for t, wid in [(0.0, "a"), (0.7, "b"), (1.4, "c"), (2.1, "d")]:
        m.at(t - 0.01)
        m.join(t, wid)
    for t in (2.5, 3.0, 3.2, 4.0):
        m.at(t)
    assert len(m.views) == 1
    assert m.ids() == ["a", "b", "c", "d"]


def test_at_most_max_workers_are_in_a_view_and_the_rest_wait_in_join_order() -> None:
    m = Machine(min_workers=2, max_workers=3, settle_s=0.5)
    m.join(0.0, "a", "b", "c", "d", "e")
    m.at(1.0)
    assert m.ids() == ["a", "b", "c"]
    m.at(1.1, Leave("b"))
    # A lost member is dropped at once (no settle wait): the ring must not wait on a dead rank.
    assert m.ids() == ["a", "c"] and m.view.view_id == 2
    m.admit(1.2, by="c")
    m.at(1.7)
    assert m.ids() == ["a", "c", "d"] and m.view.view_id == 3


def test_rank_hints_order_the_first_view() -> None:
    m = Machine(min_workers=3, settle_s=0.0)
    m.join(0.0, "x", "y", "z", hints=[2, 0, 1])
    assert m.ids() == ["y", "z", "x"]


def test_workers_without_a_hint_follow_the_hinted_ones_in_join_order() -> None:
    m = Machine(min_workers=4, settle_s=0.0)
    m.join(0.0, "p", "q", "r", "s", hints=[-1, 1, -1, 0])
    assert m.ids() == ["s", "q", "p", "r"]


def test_rank_hints_are_ignored_once_a_view_exists() -> None:
    m = Machine(min_workers=2, settle_s=0.0)
    m.join(0.0, "a", "b", hints=[1, 0])
    assert m.ids() == ["b", "a"]
    m.join(1.0, "c", hints=[0])
    m.admit(1.0, by="a")
    assert m.ids() == ["b", "a", "c"]


def test_views_are_numbered_one_by_one_including_empty_ones() -> None:
    m = Machine(min_workers=2, settle_s=0.0)
    m.join(0.0, "a", "b")
    m.join(1.0, "c")
    m.admit(1.0, by="a")
    m.at(2.0, Leave("c"))
    m.at(3.0, Leave("b"))
    m.join(4.0, "d")  # an empty world admits at once
    assert [v.view_id for v in m.views] == [1, 2, 3, 4, 5]
    assert [len(v.members) for v in m.views] == [2, 3, 2, 0, 2]


def test_a_joiner_waits_outside_a_running_world_until_a_member_asks_to_admit_it() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.join(0.0, "a", "b")
    m.at(1.0)
    m.join(5.0, "c")
    m.at(100.0)
    assert m.ids() == ["a", "b"] and m.view.view_id == 1
    m.admit(100.0, by="b")
    m.at(100.5)
    assert m.ids() == ["a", "b", "c"] and m.view.view_id == 2


def test_an_admit_request_publishes_a_view_at_once_with_the_joiner_at_the_end_of_the_ring() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.join(0.0, "a", "b")
    m.at(1.0)
    m.join(5.0, "c")
    m.admit(5.1, by="a")
    assert m.ids() == ["a", "b", "c"] and m.view.view_id == 2


def test_a_joiner_that_prepares_is_neither_counted_nor_admitted_until_it_is_ready() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.join(0.0, "a", "b")
    m.at(1.0)
    m.at(5.0, Join("c", "addr-c", "host", prepare=True), Join("d", "addr-d", "other"))
    assert admissible(m.state) == 1  # d only
    assert provisional(m.state, "c") == (2, 4, 2, 3)  # after a and b, before d; a, b and c share "host"
    m.admit(5.1, by="a")
    assert m.ids() == ["a", "b", "d"]  # c prepares still: the commit's admission does not wait for it
    m.at(6.0, Ready("c"))
    assert admissible(m.state) == 1 and m.ids() == ["a", "b", "d"]  # counted now, admitted at the next commit
    m.admit(6.1, by="b")
    assert m.ids() == ["a", "b", "d", "c"] and admissible(m.state) == 0


def test_a_world_that_forms_takes_a_worker_that_prepares_at_once() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.at(0.0, *(Join(w, f"addr-{w}", "host", prepare=True) for w in "abx"))
    m.at(1.0)
    assert m.ids() == ["a", "b", "x"]  # no world ran when they joined: nothing to prepare for
    m.at(2.0, Join("c", "addr-c", "host", prepare=True), Leave("a"))
    m.at(3.0)
    assert m.ids() == ["b", "x"]  # c prepares for the running world of b and x
    m.at(4.0, Leave("b"))
    assert m.ids() == []  # below min_workers: that world ended
    m.at(6.0)
    assert m.ids() == ["x", "c"]  # the next one forms with c, ready or not


def test_an_admit_request_with_nobody_waiting_still_publishes_a_new_view_of_the_same_members() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.join(0.0, "a", "b")
    m.at(1.0)
    m.admit(2.0, by="b")
    assert m.ids() == ["a", "b"] and m.view.view_id == 2
    m.at(10.0)
    assert m.view.view_id == 2


def test_an_admit_request_from_a_worker_outside_the_view_is_ignored() -> None:
    m = Machine(min_workers=2, settle_s=0.0)
    m.join(0.0, "a", "b")
    m.join(1.0, "c")
    m.admit(2.0, by="c")  # waiting, not a member
    m.admit(3.0, by="zz")  # unknown
    m.at(10.0)
    assert m.ids() == ["a", "b"] and m.view.view_id == 1
    m.admit(11.0, by="a")
    assert m.ids() == ["a", "b", "c"]


def test_an_admit_request_lets_in_only_those_waiting_and_not_a_later_joiner() -> None:
    # Admission happens at a commit, so that no training step is cut in half: a request that
    # found nobody waiting must not let in a worker that joins later, mid-step, unasked.
    m = Machine(min_workers=1, settle_s=0.5)
    m.join(0.0, "a")
    m.at(0.5)
    m.admit(1.0, by="a")
    assert m.ids() == ["a"] and m.view.view_id == 2
    m.join(2.0, "b")
    m.at(10.0)
    assert m.ids() == ["a"] and m.view.view_id == 2


def test_leavers_named_in_an_admit_request_go_in_the_same_view_that_admits_the_joiners() -> None:
    # Left to their own Leave calls (each after its drain) two leavers make two views, and the
    # survivors sync in the first, which still holds the second leaver: one view for the commit.
    m = Machine(min_workers=1, settle_s=1.0)
    m.join(0.0, "a", "b", "c", "d")
    m.at(1.0)
    m.join(5.0, "e")
    m.at(5.1, Admit("a", 1, leaving=("a", "c")))
    assert m.ids() == ["b", "d", "e"] and m.view.view_id == 2
    assert m.view.left == ("a", "c") and m.view.failed == ()
    assert {(r.worker_id, r.reason) for r in m.removed} == {("a", "left"), ("c", "left")}
    # Their own Leave calls, when they come, change nothing.
    m.at(5.2, Leave("a"), Leave("c"))
    m.at(10.0)
    assert m.view.view_id == 2


def test_leavers_named_in_an_admit_request_of_an_older_view_or_outside_the_view_are_ignored() -> None:
    m = Machine(min_workers=1, settle_s=1.0)
    m.join(0.0, "a", "b", "c")
    m.at(1.0)
    m.join(1.0, "w")
    m.at(2.0, Admit("a", 7, leaving=("b",)))  # a view that is not the current one
    m.at(2.1, Admit("w", 1, leaving=("b",)))  # the requester is not a member
    assert m.ids() == ["a", "b", "c"] and m.view.view_id == 1
    m.at(3.0, Admit("a", 1, leaving=("w", "zz", "b", "b")))  # a waiting worker and a stranger are no members
    assert m.ids() == ["a", "c", "w"] and m.view.left == ("b",)


def test_the_longest_lived_member_keeps_rank_0() -> None:
    m = Machine(min_workers=1, settle_s=0.0)
    m.join(0.0, "a")
    m.join(1.0, "b")
    m.admit(1.0, by="a")
    m.join(2.0, "c")
    m.admit(2.0, by="b")
    assert m.ids() == ["a", "b", "c"]
    m.at(3.0, Leave("a"))
    assert m.ids() == ["b", "c"]
    m.join(4.0, "a")  # a comes back with the same id: it is a newcomer now
    m.admit(4.0, by="c")
    assert m.ids() == ["b", "c", "a"]
    m.at(5.0, Leave("c"))
    assert m.ids() == ["b", "a"]


def test_members_keep_their_relative_order_even_with_hints_of_newcomers() -> None:
    m = Machine(min_workers=2, settle_s=0.0)
    m.join(0.0, "a", "b")
    m.join(1.0, "c", "d", hints=[1, 0])
    m.admit(1.0, by="b")
    assert m.ids()[:2] == ["a", "b"]
    assert set(m.ids()[2:]) == {"c", "d"}


def test_a_leave_removes_the_worker_at_once_and_publishes_a_view_without_it() -> None:
    m = Machine(min_workers=1, settle_s=10.0)
    m.join(0.0, "a", "b", "c")
    m.at(10.0)
    actions = m.at(10.5, Leave("b"))
    assert Removed("b", "left") in actions
    assert m.ids() == ["a", "c"] and m.view.view_id == 2
    assert not is_known(m.state, "b")


def test_a_leave_of_an_unknown_worker_changes_nothing() -> None:
    m = Machine(min_workers=1, settle_s=0.0)
    m.join(0.0, "a")
    before = m.state
    assert m.at(1.0, Leave("ghost")) == []
    assert m.state.view == before.view and m.state.workers == before.workers


def test_a_silent_worker_is_removed_after_the_heartbeat_timeout_and_not_before() -> None:
    m = Machine(min_workers=1, settle_s=0.5, heartbeat_timeout_s=5.0)
    m.join(0.0, "a", "b")
    m.at(0.5)
    assert m.ids() == ["a", "b"] and m.view.view_id == 1
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        m.at(t, Heartbeat("a"))
    m.at(5.0)
    assert m.ids() == ["a", "b"]  # exactly at the timeout: still alive
    actions = m.at(5.01)
    assert Removed("b", "silent for more than 5 s") in actions
    assert m.ids() == ["a"] and m.view.view_id == 2
    m.at(9.9, Heartbeat("a"))
    m.at(10.5)
    assert m.ids() == ["a"]


def test_heartbeats_keep_a_worker_alive_indefinitely() -> None:
    m = Machine(min_workers=1, settle_s=0.0, heartbeat_timeout_s=2.0)
    m.join(0.0, "a")
    for i in range(1, 100):
        m.at(float(i), Heartbeat("a"))
    assert m.removed == [] and m.ids() == ["a"] and len(m.views) == 1


def test_a_heartbeat_from_an_unknown_worker_does_not_admit_it() -> None:
    m = Machine(min_workers=1, settle_s=0.0)
    m.at(0.0, Heartbeat("ghost"))
    assert not is_known(m.state, "ghost") and m.views == []


def test_falling_below_min_workers_publishes_an_empty_view_at_once() -> None:
    m = Machine(min_workers=3, settle_s=1.0)
    m.join(0.0, "a", "b", "c")
    m.at(1.0)
    assert len(m.view.members) == 3
    actions = m.at(1.2, Leave("b"))
    published = [a.view for a in actions if isinstance(a, PublishView)]
    assert [(v.view_id, v.members) for v in published] == [(2, ())]
    # Without the missing worker nothing more forms; with it, a new view forms after the settle.
    m.at(50.0)
    assert m.view.view_id == 2
    m.join(51.0, "d")
    m.at(51.5)
    assert m.view.view_id == 2
    m.at(52.0)
    assert m.view.view_id == 3 and m.ids() == ["a", "c", "d"]


def test_the_world_ending_twice_publishes_one_empty_view() -> None:
    m = Machine(min_workers=2, settle_s=0.0)
    m.join(0.0, "a", "b")
    m.at(1.0, Leave("a"))
    m.at(2.0, Leave("b"))
    assert [len(v.members) for v in m.views] == [2, 0]


def test_rejoining_with_the_same_details_does_not_restart_the_settle_window() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.join(0.0, "a", "b")
    m.join(0.9, "a")
    m.at(1.0)
    assert m.ids() == ["a", "b"]


def test_a_member_that_rejoins_with_a_new_address_gets_a_view_with_that_address() -> None:
    m = Machine(min_workers=1, settle_s=0.5)
    m.join(0.0, "a", "b")
    m.at(1.0)
    m.at(2.0, Join("b", "new-address", "host", -1))
    m.at(2.4)
    assert m.view.view_id == 1
    m.at(2.5)
    assert m.view.view_id == 2
    assert m.ids() == ["a", "b"]
    assert m.view.members[1].address == "new-address"


def test_step_never_mutates_the_state_it_was_given() -> None:
    m = Machine(min_workers=1, settle_s=0.0)
    m.join(0.0, "a")
    before = m.state
    workers, seen = dict(before.workers), dict(before.last_seen)
    step(before, Join("b", "addr-b", "host"), 1.0)
    step(before, Leave("a"), 1.0)
    step(before, Tick(), 100.0)
    assert before.workers == workers and before.last_seen == seen


def test_local_ranks_group_members_by_hostname() -> None:
    m = Machine(min_workers=4, settle_s=0.0)
    m.at(0.0, Join("a", "1", "h1"), Join("b", "2", "h2"), Join("c", "3", "h1"), Join("d", "4", "h2"))
    view = m.view
    assert [view.local(r) for r in range(4)] == [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]
    assert view.rank_of("c") == 2 and view.rank_of("zz") is None


def test_a_view_names_the_members_that_left_and_those_that_went_silent_since_the_last_view() -> None:
    m = Machine(min_workers=1, settle_s=0.5, heartbeat_timeout_s=5.0)
    m.join(0.0, "a", "b", "c")
    m.at(0.5)
    assert (m.view.left, m.view.failed) == ((), ())
    m.at(4.0, Heartbeat("a"), Heartbeat("b"), Leave("c"))
    assert (m.view.view_id, m.view.left, m.view.failed) == (2, ("c",), ())
    m.at(8.0, Heartbeat("a"))
    m.at(9.01)
    assert (m.view.view_id, m.ids(), m.view.left, m.view.failed) == (3, ["a"], (), ("b",))


def test_a_suspect_reported_by_a_peer_is_probed_once_and_removed_at_once_if_it_does_not_answer() -> None:
    m = Machine(min_workers=1, settle_s=0.5)
    m.join(0.0, "a", "b", "c")
    m.at(0.5)
    first = m.at(1.0, Suspect("b"))
    again = m.at(1.1, Suspect("b"))
    assert first == [Probe("b", "addr-b")] and again == []
    actions = m.at(1.2, ProbeResult("b", alive=False))
    assert Removed("b", "reported by a peer and did not answer a probe") in actions
    assert (m.view.view_id, m.ids(), m.view.failed) == (2, ["a", "c"], ("b",))


def test_a_suspect_that_answers_its_probe_stays_gets_a_new_ring_and_can_be_probed_again_later() -> None:
    m = Machine(min_workers=1, settle_s=0.5)
    m.join(0.0, "a", "b")
    m.at(0.5)
    m.at(1.0, Suspect("b"))
    # A link is down, not the worker: the same members in a new view dial each other again
    # (tests/unit/test_links.py follows the ring check that this starts).
    assert [type(a) for a in m.at(1.1, ProbeResult("b", alive=True))] == [PublishView]
    assert m.ids() == ["a", "b"] and m.view.view_id == 2
    assert m.at(2.0, Suspect("b")) == [Probe("b", "addr-b")]
    assert m.at(2.0, Suspect("ghost")) == []


def rejoin(m: Machine, now: float, wid: str, rank: int, view_id: int = 7, size: int = 3) -> None:
    m.at(now, Join(wid, f"addr-{wid}", "host", -1, Claim(view_id, rank, size)))


def test_a_restarted_coordinator_adopts_the_running_view_when_all_its_members_rejoin() -> None:
    m = Machine(min_workers=1, settle_s=0.5, heartbeat_timeout_s=5.0)
    rejoin(m, 0.0, "z", rank=2)
    rejoin(m, 0.1, "x", rank=0)
    m.at(1.0)  # past the settle window: still no fresh view 1 beside the running view 7
    assert m.views == []
    rejoin(m, 1.5, "y", rank=1)
    assert [(v.view_id, [mm.worker_id for mm in v.members]) for v in m.views] == [(7, ["x", "y", "z"])]
    m.join(2.0, "new")
    m.admit(2.0, by="x")
    m.at(2.5, Heartbeat("x"), Heartbeat("y"), Heartbeat("z"))
    assert m.ids() == ["x", "y", "z", "new"] and m.view.view_id == 8


def test_a_restarted_coordinator_forms_the_next_view_from_the_members_that_came_back_in_time() -> None:
    m = Machine(min_workers=1, settle_s=0.5, heartbeat_timeout_s=5.0)
    rejoin(m, 0.0, "z", rank=2)
    rejoin(m, 1.0, "x", rank=0)
    m.at(4.9, Heartbeat("z"), Heartbeat("x"))
    assert m.views == []
    m.at(5.0)
    assert (m.view.view_id, m.ids(), m.view.failed) == (8, ["x", "z"], ("rank 1 of view 7",))


def test_a_restarted_coordinator_ends_the_world_if_too_few_members_came_back() -> None:
    m = Machine(min_workers=2, settle_s=0.5, heartbeat_timeout_s=5.0)
    rejoin(m, 0.0, "x", rank=0)
    m.at(5.0)
    assert (m.view.view_id, m.view.members) == (8, ())


def test_workers_that_died_together_leave_in_one_view_even_with_their_heartbeats_spread_apart() -> None:
    m = Machine()
    m.state = State(rules=Rules(1, 16, 0.5, 5.0, failure_window_s=1.0))
    m.join(0.0, "a", "b", "c", "d")
    m.at(0.5)
    # b, c and d die at about t=10, their last heartbeats spread over the 1 s interval before.
    for t, ids in [(9.0, "abcd"), (9.3, "abd"), (9.6, "ad"), (10.0, "a")]:
        m.at(t, *(Heartbeat(i) for i in ids))
        m.at(t)
    m.at(14.0, Heartbeat("a"))
    published_at = None
    for tick in range(1, 21):
        m.at(14.0 + tick * 0.1)
        if published_at is None and len(m.views) == 2:
            published_at = 14.0 + tick * 0.1
    # b expired at 14.0; the view waited for c and d, nearly silent then, to expire too (14.6).
    assert published_at is not None and 14.6 < published_at < 14.75
    assert [v.view_id for v in m.views] == [1, 2]
    assert m.ids() == ["a"] and m.view.failed == ("b", "c", "d")
    assert [r.worker_id for r in m.removed] == ["b", "c", "d"]


def test_a_nearly_silent_worker_that_speaks_again_holds_the_failure_view_back_but_stays_in_it() -> None:
    m = Machine()
    m.state = State(rules=Rules(1, 16, 0.5, 5.0, failure_window_s=2.0))
    m.join(0.0, "a", "b", "c")
    m.at(0.5)
    m.at(9.0, Heartbeat("a"), Heartbeat("b"), Heartbeat("c"))
    m.at(9.6, Heartbeat("a"), Heartbeat("c"))  # b is dead; c is slow from here on
    m.at(12.0, Heartbeat("a"))
    m.at(14.1)
    assert m.views[-1].view_id == 1  # b has expired, but c (silent 4.5 s) might be dying too
    m.at(14.3, Heartbeat("c"))
    m.at(14.3)
    assert m.view.view_id == 2 and m.ids() == ["a", "c"] and m.view.failed == ("b",)


def test_a_slow_worker_that_expired_and_spoke_again_does_not_cut_short_a_later_failure_windows_wait() -> None:
    m = Machine()
    m.state = State(rules=Rules(1, 16, 0.5, 5.0, failure_window_s=2.0))
    m.join(0.0, "a", "b", "c", "z")
    m.at(0.5)
    # At 5.1 a (a loaded, slow worker) has been silent past the timeout while b is nearly so: the
    # view waits for b. Then both speak again: nobody is expired, and the episode is over.
    m.at(1.5, Heartbeat("b"))
    m.at(4.0, Heartbeat("c"), Heartbeat("z"))
    m.at(5.1)
    m.at(5.2, Heartbeat("a"), Heartbeat("b"))
    m.at(5.2)
    assert [v.view_id for v in m.views] == [1]
    # Much later c and b die together, their last beats 0.6 s apart: the view waits for b to
    # expire too (a failure window of its own, not one left over from 5.1), then drops both.
    for t in range(6, 20):
        m.at(float(t), Heartbeat("a"), Heartbeat("z"), *([Heartbeat("c")] if t < 19 else []), Heartbeat("b"))
    m.at(19.6, Heartbeat("b"), Heartbeat("a"), Heartbeat("z"))
    for tick in range(1, 31):
        now = 23.9 + tick * 0.1
        m.at(now, Heartbeat("a"), Heartbeat("z"))
        m.at(now)
    assert [v.view_id for v in m.views] == [1, 2]
    assert m.views[1].failed == ("b", "c") and m.ids() == ["a", "z"]


def test_the_failure_view_waits_no_longer_than_the_failure_window() -> None:
    m = Machine()
    m.state = State(rules=Rules(1, 16, 0.5, 5.0, failure_window_s=1.0))
    m.join(0.0, "a", "b", "c", "d", "e", "z")
    m.at(0.5)
    # Workers dying one after the other, each nearly silent before the previous one expires.
    last = {"b": 9.0, "c": 9.0, "a": 9.5, "d": 9.95, "e": 10.4}
    for t in sorted(set(last.values())):
        m.at(t, *(Heartbeat(w) for w, at in last.items() if at >= t), Heartbeat("z"))
    published = {}
    for tick in range(1, 21):
        now = 14.0 + tick * 0.1
        m.at(now, Heartbeat("z"))
        m.at(now)
        published.setdefault(len(m.views), now)
    # b and c expired at 14.1; the view waited 1 s for a and d, and no longer for e.
    assert 15.05 < published[2] < 15.15 and m.views[1].failed == ("a", "b", "c", "d")
    assert 15.35 < published[3] < 15.55 and m.views[2].failed == ("e",)
    assert m.ids() == ["z"]


def test_without_a_failure_window_only_workers_past_the_full_timeout_are_removed() -> None:
    m = Machine(min_workers=1, settle_s=0.1, heartbeat_timeout_s=5.0)
    m.join(0.0, "a", "b")
    m.at(0.1)
    m.at(0.5, Heartbeat("a"))
    m.at(5.2)
    assert m.ids() == ["a"]  # b (silent 5.2 s) is gone; a (silent 4.7 s) stays
    m.at(5.6)
    assert m.ids() == [] and [len(v.members) for v in m.views] == [2, 1, 0]


def test_a_heartbeat_copies_no_table_whatever_the_number_of_workers() -> None:
    m = Machine(min_workers=1, max_workers=500, settle_s=0.1, heartbeat_timeout_s=5.0)
    m.join(0.0, *(f"w{i}" for i in range(500)))
    m.at(0.1)
    assert len(m.ids()) == 500
    before = m.state
    after, actions = step(before, Heartbeat("w7"), 1.0)
    assert actions == []
    assert after.workers is before.workers and after.last_seen is before.last_seen
    assert after.view is before.view
    # The beat counts all the same: it is folded in on the next tick.
    m.state = after
    m.at(5.5)
    assert m.ids() == ["w7"]


def test_silence_is_judged_on_ticks_so_a_heartbeat_never_removes_anyone() -> None:
    m = Machine(min_workers=1, settle_s=0.5, heartbeat_timeout_s=1.0)
    m.join(0.0, "a", "b")
    m.at(0.5)
    assert m.at(10.0, Heartbeat("a")) == []
    assert m.ids() == ["a", "b"]
    actions = m.at(10.0)
    assert actions == [Removed("b", "silent for more than 1 s"), PublishView(m.view)]
    assert m.ids() == ["a"]


def _local_by_definition(view: ViewInfo, rank: int) -> tuple[int, int, int, int]:
    """local() as it was first written, quadratic: the reference the one-pass table must match."""
    host = view.members[rank].hostname
    same = [i for i, m in enumerate(view.members) if m.hostname == host]
    hosts = list(dict.fromkeys(m.hostname for m in view.members))
    return same.index(rank), len(same), hosts.index(host), len(hosts)


def test_local_ranks_computed_in_one_pass_match_their_definition_on_random_views() -> None:
    rng = random.Random(11)
    for _ in range(200):
        size = rng.randint(0, 60)
        hosts = [f"h{i}" for i in range(rng.randint(1, 8))]
        members = tuple(MemberInfo(f"w{i}", f"a{i}", rng.choice(hosts), -1, i) for i in range(size))
        view = ViewInfo(1, members)
        assert list(view.placements) == [_local_by_definition(view, r) for r in range(size)]
        assert all(view.rank_of(m.worker_id) == r for r, m in enumerate(members))


def test_silence_while_the_coordinator_itself_was_stalled_is_not_counted_against_the_workers() -> None:
    # The coordinator ticks every 0.1 s; then nothing runs for 9 s (its process stopped, or
    # starved), past the heartbeat timeout. It used to declare every worker dead as it ran again.
    m = Machine(min_workers=2, settle_s=0.0, heartbeat_timeout_s=5.0)
    m.state = replace(m.state, rules=replace(m.state.rules, stall_s=1.0))
    m.join(0.0, "a", "b")
    for i in range(0, 11):
        m.at(i / 10, Heartbeat("a"), Heartbeat("b"))
        m.at(i / 10)
    assert m.ids() == ["a", "b"]
    m.at(10.0)  # the first tick after the stall: 9 s since the last one
    assert m.removed == [] and m.ids() == ["a", "b"]
    for i in range(1, 53):  # a's beats come in again; b's never do
        m.at(10 + i / 10, Heartbeat("a"))
        m.at(10 + i / 10)
        if 10 + i / 10 < 14.95:
            assert m.removed == [], 10 + i / 10
    # b: silent for 5 s of the coordinator's running time (from 1.0 s to the stall, then from 10.0 s).
    assert [r.worker_id for r in m.removed] == ["b"]


def test_with_regular_ticks_a_silent_worker_is_removed_at_the_timeout_as_before() -> None:
    m = Machine(min_workers=2, settle_s=0.0, heartbeat_timeout_s=2.0)
    m.state = replace(m.state, rules=replace(m.state.rules, stall_s=1.0))
    m.join(0.0, "a", "b")
    m.at(0.0)
    for i in range(1, 41):
        m.at(i / 10, Heartbeat("a"))
        m.at(i / 10)
        if i / 10 <= 2.0:
            assert m.removed == []
    assert [r.worker_id for r in m.removed] == ["b"]


def graced(timeout_s: float = 5.0, grace_s: float = 2.0, *ids: str, sweep_s: float = 0.5) -> Machine:
    """A running world of ``ids`` whose silent workers are probed, with a grace, before removal,
    and whose deaths open a sweep of ``sweep_s``."""
    m = Machine(min_workers=len(ids), settle_s=0.0, heartbeat_timeout_s=timeout_s)
    m.state = replace(m.state, rules=replace(m.state.rules, silence_grace_s=grace_s, stall_s=1.0, sweep_s=sweep_s))
    m.join(0.0, *ids)
    m.at(0.0)
    assert m.ids() == list(ids)
    m.state = replace(m.state, rules=replace(m.state.rules, min_workers=1))  # the world outlives its failures
    return m


def beat_until(m: Machine, start: float, end: float, *ids: str) -> list[object]:
    """Ticks every 0.1 s from ``start`` to ``end``, with a heartbeat of each of ``ids`` every second."""
    actions: list[object] = []
    for i in range(round(start * 10), round(end * 10) + 1):
        now = i / 10
        if i % 10 == 0:
            actions += m.at(now, *(Heartbeat(w) for w in ids))
        actions += m.at(now)
    return actions


def swept(actions: list[object]) -> dict[str, Probe]:
    """The sweep's probes among ``actions``, by worker."""
    return {a.worker_id: a for a in actions if isinstance(a, Probe) and a.sweep}


def answer(m: Machine, now: float, probes: dict[str, Probe], dead: Iterable[str] = (), *,
           timed_out: Iterable[str] = ()) -> None:
    """Answers ``probes``: refused for ``dead``, no answer in time for ``timed_out``, alive otherwise."""
    dead, late = set(dead), set(timed_out)
    m.at(now, *(p.result(w not in dead and w not in late, timed_out=w in late, refused=w in dead)
                for w, p in probes.items()))


def test_a_worker_silent_for_the_timeout_is_probed_not_removed_and_stays_if_it_heartbeats_within_the_grace() -> None:
    # A worker stopped for 6 s (a GC pause, SIGSTOP): silent past the 5 s timeout, back within
    # the 2 s grace. It is probed, its probe finds nobody answering (the process is stopped), and
    # its heartbeat, once it runs again, keeps it.
    m = graced(5.0, 2.0, "a", "b")
    actions = beat_until(m, 0.1, 5.9, "a")
    probes = [a for a in actions if isinstance(a, Probe)]
    assert [(p.worker_id, p.silent, p.timeout_s, p.began) for p in probes] == [("b", True, 2.0, 5.1)]
    assert m.removed == []
    m.at(6.5, Heartbeat("b"))
    m.at(6.9, probes[0].result(False, timed_out=True))  # its deadline passed while it was stopped
    beat_until(m, 7.0, 20.0, "a", "b")
    assert m.removed == [] and m.ids() == ["a", "b"]
    assert m.state.silent_probes == {}


def test_a_silent_worker_whose_probe_times_out_is_still_given_its_whole_grace() -> None:
    # The probe's deadline runs on the prober's clock, which a stopped coordinator does not
    # stop; the grace runs on the state machine's, which forgives the coordinator's stalls.
    m = graced(5.0, 2.0, "a", "b")
    beat_until(m, 0.1, 5.1, "a")
    m.at(5.2, ProbeResult("b", alive=False, since=5.1, timed_out=True))
    beat_until(m, 5.3, 6.9, "a")
    m.at(6.95, Heartbeat("b"))
    beat_until(m, 7.0, 10.0, "a", "b")
    assert m.removed == []


def test_a_silent_worker_that_answers_its_probe_but_never_heartbeats_is_removed_when_the_grace_is_up() -> None:
    # Its route to the coordinator is cut, not its peer server: it runs, but the coordinator
    # does not hear it, and its peers must go on without it.
    m = graced(5.0, 2.0, "a", "b")
    beat_until(m, 0.1, 5.5, "a")
    m.at(5.6, ProbeResult("b", alive=True, since=5.1))
    beat_until(m, 5.7, 7.0, "a")
    assert m.removed == []
    assert swept(beat_until(m, 7.1, 7.1, "a")) == {}  # a heartbeats: nobody to sweep
    assert [r.worker_id for r in m.removed] == ["b"]
    assert "silent 7.1 s, past the timeout (5 s), then silent through its grace (2 s)" in m.removed[0].reason


def test_a_silent_worker_whose_process_is_gone_is_removed_as_soon_as_its_probe_is_refused() -> None:
    m = graced(5.0, 2.0, "a", "b", "c")
    beat_until(m, 0.1, 5.1, "a")  # b and c last heard at 0.0: both probed at 5.1
    assert set(m.state.silent_probes) == {"b", "c"}
    m.at(5.12, ProbeResult("b", alive=False, since=5.1, refused=True), ProbeResult("c", alive=False, since=5.1, refused=True))
    answer(m, 5.22, swept(m.at(5.2)))
    m.at(5.3)
    assert sorted(r.worker_id for r in m.removed) == ["b", "c"]
    assert "refused a probe" in m.removed[0].reason
    assert m.ids() == ["a"]
    assert len(m.views) == 2  # both in one view


def test_a_silent_worker_that_never_answers_is_removed_when_the_grace_is_up() -> None:
    # Its host is gone (no refusal ever comes) or it is wedged: its probe has not even reported.
    m = graced(5.0, 2.0, "a", "b")
    beat_until(m, 0.1, 7.0, "a")  # probed at 5.1 s
    assert m.removed == []
    beat_until(m, 7.1, 7.1, "a")
    assert [r.worker_id for r in m.removed] == ["b"]


def test_a_silent_worker_that_never_answers_waits_out_the_sweep_of_a_stopped_one() -> None:
    m = graced(5.0, 2.0, "a", "b", "c")
    beat_until(m, 0.1, 6.0, "a", "c")
    sweep = swept(beat_until(m, 6.1, 7.1, "a"))  # b found dead at 7.1; c, silent 1.1 s, swept
    assert set(sweep) == {"c"} and m.removed == []
    beat_until(m, 7.2, 7.5, "a")  # c is stopped: its probe has not answered
    assert m.removed == []
    beat_until(m, 7.6, 7.6, "a")  # the sweep's hold is up
    assert [r.worker_id for r in m.removed] == ["b"]
    answer(m, 7.62, sweep, timed_out=["c"])  # its deadline: it decides nothing, late or not
    beat_until(m, 7.7, 8.0, "a")
    assert [r.worker_id for r in m.removed] == ["b"]


def test_workers_that_died_together_but_are_found_apart_leave_in_one_view() -> None:
    # b stopped heartbeating at 0.0 (its last beat), c and d at 1.0: all three were killed at
    # 1.5 s. b's silence expires first, and its refused probe opens a sweep, which finds c and d
    # (silent for more than an interval) gone too, 2 s before their own silence would.
    m = graced(5.0, 2.0, "a", "b", "c", "d", "e")
    beat_until(m, 0.1, 1.0, "a", "c", "d", "e")
    beat_until(m, 1.1, 5.1, "a", "e")
    assert set(m.state.silent_probes) == {"b"}
    m.at(5.12, ProbeResult("b", alive=False, since=5.1))
    sweep = swept(m.at(5.2))
    assert set(sweep) == {"c", "d"}  # silent for more than an interval; a and e heartbeat
    answer(m, 5.21, sweep, dead=["c", "d"])
    m.at(5.3)
    assert sorted(r.worker_id for r in m.removed) == ["b", "c", "d"]
    assert len(m.views) == 2 and m.ids() == ["a", "e"]
    assert sorted(m.views[-1].failed) == ["b", "c", "d"]


def test_the_sweep_probes_the_silent_not_those_heard_within_an_interval_even_on_the_dead_ones_host() -> None:
    m = Machine(min_workers=1, settle_s=0.0, heartbeat_timeout_s=5.0)
    m.state = replace(m.state, rules=replace(m.state.rules, silence_grace_s=2.0, stall_s=1.0, sweep_s=0.5))
    m.at(0.0, Join("b", "addr-b", "h1"), Join("b2", "addr-b2", "h1"), Join("q", "addr-q", "h2"),
         Join("x", "addr-x", "h3"))
    m.at(0.0)
    beat_until(m, 0.1, 4.5, "b2", "x")  # q last heard at 0.0: silent, not yet expired
    m.at(4.5, Suspect("b"))
    m.at(4.51, ProbeResult("b", alive=False))  # reported by a peer, refused
    assert m.removed == []  # held for the sweep
    sweep = swept(m.at(4.6))
    assert set(sweep) == {"q"}  # silent; not b2 (b's host) nor x, both heard within an interval
    answer(m, 4.7, sweep, timed_out=["q"])  # q is stopped: its probe decides nothing
    m.at(4.8)
    assert [r.worker_id for r in m.removed] == ["b"]
    assert "reported by a peer" in m.removed[0].reason


def b_refused_and_a_c_swept() -> tuple[Machine, dict[str, Probe]]:
    """Four workers; a and c silent since 4.0, b's probe refused at 5.12: the sweep probes a and c."""
    m = graced(5.0, 2.0, "a", "b", "c", "d")
    beat_until(m, 0.1, 4.0, "a", "c", "d")
    beat_until(m, 4.1, 5.1, "d")  # a and c silent since 4.0
    m.at(5.12, ProbeResult("b", alive=False, since=5.1, refused=True))
    sweep = swept(m.at(5.2))
    assert set(sweep) == {"a", "c"}
    return m, sweep


def test_a_swept_worker_is_found_dead_only_by_a_refusal() -> None:
    # A name not resolved (a DNS blip) or a proxy's error says nothing about a worker that
    # heartbeats; the simulated workers of tests/swarm.py advertise names that never resolve.
    m, sweep = b_refused_and_a_c_swept()
    m.at(5.21, sweep["a"].result(False), sweep["c"].result(False))  # failed, not refused
    m.at(5.3)
    assert [r.worker_id for r in m.removed] == ["b"] and m.ids() == ["a", "c", "d"]


def test_a_swept_worker_that_heartbeats_before_the_view_is_published_stays_though_its_address_refused() -> None:
    m, sweep = b_refused_and_a_c_swept()
    answer(m, 5.21, sweep, dead=["a", "c"])  # both refused: c advertised wrong, say
    m.at(5.25, Heartbeat("c"))
    m.at(5.3)
    assert sorted(r.worker_id for r in m.removed) == ["a", "b"] and m.ids() == ["c", "d"]


def test_a_death_waits_at_most_the_sweep_for_probes_not_answered() -> None:
    # c's silent probe (a stopped worker) is undecided when b is found dead: b's view waits for
    # it 0.5 s, not its whole grace, and c is judged on its own later.
    m = graced(5.0, 2.0, "a", "b", "c")
    beat_until(m, 0.1, 5.1, "a")
    m.at(5.12, ProbeResult("b", alive=False, since=5.1))  # b refused; c's probe is still under way
    answer(m, 5.25, swept(m.at(5.2)))
    beat_until(m, 5.3, 5.6, "a")
    assert m.removed == []
    beat_until(m, 5.7, 5.7, "a")
    assert [r.worker_id for r in m.removed] == ["b"]
    beat_until(m, 5.8, 7.0, "a")
    answer(m, 7.12, swept(m.at(7.1)))
    m.at(7.2)
    assert [r.worker_id for r in m.removed] == ["b", "c"] and len(m.views) == 3


def test_probes_that_ended_while_the_coordinator_itself_was_stalled_are_forgotten() -> None:
    m = graced(5.0, 2.0, "a", "b")
    beat_until(m, 0.1, 5.1, "a")
    assert set(m.state.silent_probes) == {"b"}
    m.at(12.0, ProbeResult("b", alive=False, since=5.1))  # the coordinator was stopped from 5.1 to 12.0 s
    m.at(12.0, Heartbeat("a"))
    m.at(12.0)
    # The stale result removed nobody; b, silent for the timeout of the coordinator's running
    # time before the stall, is probed afresh, with a grace of its own to speak in.
    assert m.removed == [] and m.state.silent_probes == {"b": 12.0}
    beat_until(m, 13.0, 16.0, "a", "b")
    assert m.removed == [] and m.state.silent_probes == {}


@pytest.mark.parametrize("alive", [False, True])
def test_the_answer_to_a_probe_no_longer_waited_for_is_stale_and_changes_nothing(alive: bool) -> None:
    # The coordinator stopped from 5.1 to 12.0 s; its tick at 12.0 forgave the silence and
    # dropped the probe; the probe's answer comes after that tick. Taken for a peer's report, a
    # "dead" removed b, and an "alive" re-formed the ring and checked links that simulated
    # workers never report: both were false failures at 256 workers (benchmarks/starvation.py).
    m = graced(5.0, 2.0, "a", "b")
    beat_until(m, 0.1, 5.1, "a")
    m.at(12.0, Heartbeat("a"), Heartbeat("b"))
    m.at(12.0)
    assert m.state.silent_probes == {}
    views = len(m.views)
    m.at(12.05, ProbeResult("b", alive=alive, since=5.1))
    beat_until(m, 13.0, 20.0, "a", "b")
    assert m.removed == [] and len(m.views) == views and m.state.check is None


def test_the_answer_to_an_older_probe_of_a_worker_probed_again_is_stale() -> None:
    m = graced(5.0, 2.0, "a", "b")
    beat_until(m, 0.1, 5.1, "a")
    m.at(5.5, Heartbeat("b"))  # back: its probe is dropped at the next tick
    beat_until(m, 5.6, 10.6, "a")  # silent again: probed afresh at 10.6
    assert m.state.silent_probes == {"b": 10.6}
    m.at(10.62, ProbeResult("b", alive=False, since=5.1))  # the first probe's late answer
    beat_until(m, 10.7, 11.0, "a")
    assert m.removed == []


def test_without_a_grace_a_silent_worker_is_removed_at_the_timeout_unprobed() -> None:
    m = graced(5.0, 0.0, "a", "b")
    actions = beat_until(m, 0.1, 5.2, "a")
    assert not [a for a in actions if isinstance(a, Probe)]
    assert [r.worker_id for r in m.removed] == ["b"]


def test_a_reported_worker_whose_probe_times_out_before_the_bound_is_asked_again_not_removed() -> None:
    # 256 workers on 2 cores: a starved worker's links broke under its peers (keepalive), a peer
    # reported it, and its probe got no answer in time. It had been silent 3 s, less than the 7 s
    # the silence rule forgives: it is probed again, and once it answers its ring is re-formed
    # with every member (before: removed, a live worker declared dead).
    m = graced(5.0, 2.0, "a", "b", "c")
    beat_until(m, 0.1, 2.0, "a", "b", "c")
    beat_until(m, 2.1, 4.9, "a", "c")
    first = m.at(5.0, Suspect("b"))
    assert first == [Probe("b", "addr-b")]
    beat_until(m, 5.1, 5.9, "a", "c")
    again = m.at(6.0, first[0].result(False, timed_out=True))
    assert again == [Probe("b", "addr-b")] and m.removed == []
    assert m.at(6.1, Suspect("b")) == []  # still under probe: one at a time
    view = m.view.view_id
    m.at(6.5, Heartbeat("b"))
    m.at(6.6, again[0].result(True))
    beat_until(m, 7.0, 9.0, "a", "b", "c")
    assert m.removed == [] and m.ids() == ["a", "b", "c"]
    assert m.view.view_id == view + 1 and m.view.failed == ()  # a new ring, nobody dropped


def test_a_reported_worker_that_never_answers_is_removed_once_silent_past_the_bound() -> None:
    # A wedged worker (or one cut off): every probe times out. It goes once its silence passes the
    # timeout and the grace (7 s), whichever path finds it first, and never before.
    m = graced(5.0, 2.0, "a", "b", "c")
    beat_until(m, 0.1, 2.0, "a", "b", "c")
    beat_until(m, 2.1, 2.4, "a", "c")
    probe = m.at(2.5, Suspect("b"))[0]
    for t in (3.5, 4.5, 5.5, 6.5, 7.5, 8.5):
        beat_until(m, t - 0.9, t - 0.1, "a", "c")  # from 7 s, the silence rule's own probe is under way
        actions = [a for a in m.at(t, probe.result(False, timed_out=True)) if isinstance(a, Probe) and not a.silent]
        assert actions == [Probe("b", "addr-b")] and m.removed == [], t
        probe = actions[0]
    beat_until(m, 8.6, 8.9, "a", "c")
    assert m.removed == []  # silent 6.9 s
    beat_until(m, 9.0, 9.4, "a", "c")
    m.at(9.5, probe.result(False, timed_out=True))  # silent 7.5 s
    beat_until(m, 9.6, 10.5, "a", "c")
    assert [r.worker_id for r in m.removed] == ["b"]
    assert m.ids() == ["a", "c"]


def test_a_reported_worker_whose_probe_is_refused_is_removed_at_once_whatever_its_silence() -> None:
    m = graced(5.0, 2.0, "a", "b", "c")
    beat_until(m, 0.1, 2.4, "a", "b", "c")
    probe = m.at(2.5, Suspect("b"))[0]
    m.at(2.6, probe.result(False, refused=True))
    beat_until(m, 2.7, 3.5, "a", "c")
    assert [r.worker_id for r in m.removed] == ["b"]


def test_a_gang_is_admitted_whole_or_not_at_all() -> None:
    """A replica group of fault-tolerant HSDP (ringserve.torch.hsdp) shares its model's shards:
    its workers come into a view together, never some of them."""
    m = Machine(min_workers=2, settle_s=1.0)
    m.join(0.0, "a", "b")
    m.at(1.0)
    m.at(5.0, Join("g0", "addr-g0", "host", gang="B/1", gang_size=2), Join("d", "addr-d", "other"))
    assert admissible(m.state) == 1  # d only: half of gang B/1 is not admissible
    m.admit(5.1, by="a")
    assert m.ids() == ["a", "b", "d"]
    m.at(6.0, Join("g1", "addr-g1", "host", gang="B/1", gang_size=2, prepare=True))
    assert admissible(m.state) == 0  # both are here, but g1 prepares still: neither comes in
    m.at(7.0, Ready("g1"))
    assert admissible(m.state) == 2
    m.admit(7.1, by="b")
    assert m.ids() == ["a", "b", "d", "g0", "g1"]


def test_a_world_forms_without_a_gang_that_is_not_whole_and_takes_it_once_it_is() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.at(0.0, *(Join(w, f"addr-{w}", "host", gang="A/7", gang_size=2) for w in ("a0", "a1")),
         Join("c0", "addr-c0", "host", gang="C/3", gang_size=2))
    m.at(1.5)
    assert m.ids() == ["a0", "a1"]  # gang C/3 has one worker of two
    m.at(2.0, Join("c1", "addr-c1", "host", gang="C/3", gang_size=2))
    m.admit(2.1, by="a0")
    assert m.ids() == ["a0", "a1", "c0", "c1"]


def test_a_new_gang_does_not_complete_the_rest_of_an_old_one() -> None:
    """A group restarts under a new gang name (hsdp draws one per start), so its new workers never
    pair with the survivor of the group they replace, which is still in the view until it exits."""
    m = Machine(min_workers=2, settle_s=1.0)
    m.at(0.0, *(Join(w, f"addr-{w}", "host", gang="A/1", gang_size=2) for w in ("a0", "a1")))
    m.at(1.5)
    m.at(2.0, Leave("a1"))
    m.at(3.0, Join("n1", "addr-n1", "host", gang="A/2", gang_size=2))
    assert admissible(m.state) == 0
    m.at(3.5, Join("n0", "addr-n0", "host", gang="A/2", gang_size=2))
    assert admissible(m.state) == 2


def test_a_gang_that_max_workers_would_cut_in_two_stays_out_whole() -> None:
    m = Machine(min_workers=2, max_workers=4, settle_s=1.0)
    m.join(0.0, "a", "b")
    m.at(1.0)
    m.at(2.0, Join("c", "addr-c", "host"), *(Join(w, f"addr-{w}", "host", gang="G/1", gang_size=2) for w in ("g0", "g1")))
    assert admissible(m.state) == 1  # c: the members ask for no admission that takes nobody
    m.admit(2.1, by="a")
    assert m.ids() == ["a", "b", "c"]  # room for one more: not for half of G/1
    assert admissible(m.state) == 0


def test_gangs_that_join_interleaved_come_in_whole_as_room_allows() -> None:
    m = Machine(min_workers=4, max_workers=4, settle_s=1.0)
    m.at(0.0, *(Join(w, f"addr-{w}", "host", gang=w[0], gang_size=2) for w in ("a0", "b0", "c0", "a1", "b1", "c1")))
    m.at(1.5)
    assert m.ids() == ["a0", "b0", "a1", "b1"]  # a and b fill the room; c waits, whole


def test_a_worker_of_a_gang_that_leaves_the_view_takes_the_rest_of_its_gang_with_it() -> None:
    m = Machine(min_workers=2, settle_s=1.0)
    m.at(0.0, *(Join(w, f"addr-{w}", "host", gang=w[0], gang_size=2) for w in ("a0", "a1", "b0", "b1")))
    m.at(1.5)
    assert m.ids() == ["a0", "a1", "b0", "b1"]
    m.at(2.0, Leave("b1"))
    assert m.ids() == ["a0", "a1"]  # b0 cannot train without b1: it goes in the same view
