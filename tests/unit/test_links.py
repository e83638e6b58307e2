"""Partial partitions in the membership state machine: a suspect that answers the probe, ring
checks, cuts and holds. Driven with an injected clock: no coordinator, no loop."""

from __future__ import annotations

import pytest

from ringserve.coordinator import ringcheck as links
from ringserve.coordinator.membership import (
    Admit,
    Heartbeat,
    Join,
    Linked,
    ProbeResult,
    PublishView,
    Removed,
    Rules,
    State,
    Suspect,
    Tick,
    ViewInfo,
    admissible,
    checking,
    step,
)

TIMEOUT = 2.0


class Ring:
    """A running world of ``n`` workers (w0..w{n-1}, in rank order) and the actions it produced."""

    def __init__(self, n: int = 4, min_workers: int = 2) -> None:
        self.state = State(rules=Rules(min_workers, 16, 1.0, heartbeat_timeout_s=TIMEOUT))
        self.views: list[ViewInfo] = []
        self.removed: list[Removed] = []
        self.now = 0.0
        self.at(0.0, *(Join(f"w{i}", f"addr-{i}", "host", i) for i in range(n)))
        self.at(1.0)
        assert self.ids() == [f"w{i}" for i in range(n)]

    def at(self, now: float, *events: object) -> None:
        """Applies ``events`` at ``now``; every worker heartbeats every 0.5 s up to then (all live)."""
        while self.now < now:
            self.now = min(self.now + 0.5, now)
            for w in list(self.state.workers):
                self._apply(Heartbeat(w), self.now)
        for event in events or (Tick(),):
            self._apply(event, now)

    def _apply(self, event: object, now: float) -> None:
        self.state, actions = step(self.state, event, now)  # type: ignore[arg-type]
        self.views += [a.view for a in actions if isinstance(a, PublishView)]
        self.removed += [a for a in actions if isinstance(a, Removed)]

    def heartbeats(self, now: float, *ids: str) -> None:
        """Heartbeats from ``ids`` (all members by default), each saying its link is up."""
        view = self.state.view.view_id
        self.at(now, *(Linked(w, view) for w in (ids or self.ids())))

    def ids(self) -> list[str]:
        return [m.worker_id for m in self.state.view.members]

    def report(self, now: float, suspect: str, *, alive: bool = True) -> None:
        """A peer reports ``suspect``; the probe answers ``alive``."""
        self.at(now, Suspect(suspect), ProbeResult(suspect, alive))


def cut_off_w2(ring: Ring) -> None:
    """w2 is reported at 10 s; only w0 and w1 hear their predecessors; w2 is cut at 12 s."""
    ring.report(10.0, "w2")
    ring.heartbeats(10.5, "w0", "w1")
    ring.at(12.0)
    ring.heartbeats(12.1)
    assert [r.worker_id for r in ring.removed] == ["w2"] and not checking(ring.state)


def test_a_reported_worker_that_answers_the_probe_gets_a_new_view_of_the_same_members_at_once() -> None:
    ring = Ring()
    ring.report(10.0, "w2")
    assert [v.view_id for v in ring.views] == [1, 2]
    assert ring.ids() == ["w0", "w1", "w2", "w3"]
    assert ring.views[-1].failed == () and not ring.removed
    assert checking(ring.state)


def test_a_ring_whose_links_all_come_up_after_the_bump_is_left_alone() -> None:
    ring = Ring()
    ring.report(10.0, "w2")
    ring.heartbeats(10.5)
    assert not checking(ring.state)
    ring.at(100.0)
    assert len(ring.views) == 2 and not ring.removed


def test_a_worker_cut_off_from_both_neighbours_is_dropped_one_window_after_the_bump() -> None:
    ring = Ring()
    ring.report(10.0, "w2")
    # w2 hears nothing from w1, and w3 nothing from w2: their heartbeats carry no link.
    ring.heartbeats(10.5, "w0", "w1")
    assert links.window(TIMEOUT) == TIMEOUT / 2
    ring.at(10.0 + links.window(TIMEOUT) - 0.01)
    assert not ring.removed
    ring.at(10.0 + links.window(TIMEOUT))
    assert [r.worker_id for r in ring.removed] == ["w2"]
    assert "cut off from its ring neighbours: 2 of its links" in ring.removed[0].reason
    assert ring.ids() == ["w0", "w1", "w3"] and ring.views[-1].failed == ("w2",)


@pytest.mark.parametrize(
    ("linked", "dropped"),
    [
        # One link down (w1 -> w2): either end could go; the later joiner does, rank 0 never.
        ({"w0", "w1", "w3"}, "w2"),
        ({"w1", "w2", "w3"}, "w3"),  # w3 -> w0 down: w3, not rank 0
        # w0 is cut off (w3 -> w0 and w0 -> w1 down): even rank 0 goes when it is the cut-off one.
        ({"w2", "w3"}, "w0"),
        # Two halves {w0, w1} and {w2, w3}: links w1 -> w2 and w3 -> w0 are down; each end is on one.
        ({"w1", "w3"}, "w3"),
    ],
)
def test_the_worker_dropped_is_the_one_on_most_down_links_then_the_latest_to_join(
    linked: set[str], dropped: str
) -> None:
    assert links.cut_off(["w0", "w1", "w2", "w3"], frozenset(linked)) == dropped


def test_cut_off_refuses_a_ring_whose_links_are_all_up() -> None:
    with pytest.raises(ValueError, match=r"Every link of the ring is up"):
        links.cut_off(["a", "b"], frozenset({"a", "b"}))


def test_a_split_ring_is_cut_down_one_worker_per_timeout_until_its_links_come_up() -> None:
    ring = Ring()
    ring.report(10.0, "w2")
    ring.heartbeats(10.5, "w1", "w3")  # w2 (from w1) and w0 (from w3) hear nothing
    ring.at(12.0)
    assert ring.ids() == ["w0", "w1", "w2"]
    ring.heartbeats(12.5, "w1")  # w2 still hears nothing from w1, nor w0 from w2
    ring.at(14.0)
    assert ring.ids() == ["w0", "w1"]
    ring.heartbeats(14.5)
    assert not checking(ring.state)
    assert [r.worker_id for r in ring.removed] == ["w3", "w2"]


def test_a_link_reported_from_a_stale_view_or_by_a_stranger_does_not_count() -> None:
    ring = Ring()
    ring.report(10.0, "w2")
    ring.at(10.5, Linked("w2", 1), Linked("stranger", 2), *(Linked(w, 2) for w in ("w0", "w1", "w3")))
    ring.at(12.0)
    assert [r.worker_id for r in ring.removed] == ["w2"]


def test_more_reports_while_a_check_is_under_way_make_no_more_views() -> None:
    ring = Ring()
    ring.report(10.0, "w2")
    ring.report(10.1, "w1")
    ring.report(10.2, "w3")
    assert len(ring.views) == 2


def test_a_suspect_that_keeps_being_reported_is_dropped_instead_of_bumped_again() -> None:
    ring = Ring()
    for i in range(links.MAX_BUMPS):
        ring.report(10.0 + i, "w2")
        ring.heartbeats(10.5 + i)
    assert len(ring.views) == 1 + links.MAX_BUMPS and not ring.removed
    ring.report(14.0, "w2")
    assert [r.worker_id for r in ring.removed] == ["w2"]
    assert ring.ids() == ["w0", "w1", "w3"]


def test_a_dropped_worker_is_held_out_of_admission_then_let_in_at_the_next_admit() -> None:
    ring = Ring()
    cut_off_w2(ring)
    ring.at(12.2, Join("w2", "addr-2", "host"))  # it rejoins at once (its heartbeat said unknown)
    assert admissible(ring.state) == 0
    ring.at(12.3, Admit("w0"))
    assert "w2" not in ring.ids()
    ring.at(12.0 + links.hold_s(1, TIMEOUT))
    assert admissible(ring.state) == 1
    ring.at(14.5, Admit("w0"))
    assert ring.ids() == ["w0", "w1", "w3", "w2"]


def test_a_view_that_takes_back_a_cut_off_worker_is_checked_and_a_cut_that_persists_doubles_the_hold() -> None:
    ring = Ring()
    cut_off_w2(ring)
    ring.at(12.2, Join("w2", "addr-2", "host"))
    ring.at(14.0, Admit("w0"))
    assert "w2" in ring.ids() and checking(ring.state)
    # The ring is w0 w1 w3 w2, and w2's routes are still gone: only w1 and w3 hear their predecessors.
    ring.heartbeats(14.5, "w1", "w3")
    ring.at(16.0)
    assert [r.worker_id for r in ring.removed] == ["w2", "w2"]
    assert links.hold_s(2, TIMEOUT) == 2 * links.hold_s(1, TIMEOUT)
    ring.heartbeats(16.1)
    ring.at(16.2, Join("w2", "addr-2", "host"))
    ring.at(16.0 + links.hold_s(2, TIMEOUT) - 0.1)
    assert admissible(ring.state) == 0
    ring.at(16.0 + links.hold_s(2, TIMEOUT))
    assert admissible(ring.state) == 1


def test_a_healed_worker_taken_back_passes_its_check_and_its_cuts_are_forgotten() -> None:
    ring = Ring()
    cut_off_w2(ring)
    ring.at(12.2, Join("w2", "addr-2", "host"))
    ring.at(14.0, Admit("w0"))
    ring.heartbeats(14.5)
    assert not checking(ring.state) and ring.state.cuts == {}


def test_a_cut_that_leaves_fewer_than_min_workers_ends_the_world_and_the_check() -> None:
    ring = Ring(n=2, min_workers=2)
    ring.report(10.0, "w1")
    ring.at(12.0)
    assert ring.views[-1].members == () and not checking(ring.state)


def test_a_suspect_that_does_not_answer_the_probe_is_still_removed_at_once_without_a_check() -> None:
    ring = Ring()
    ring.report(10.0, "w2", alive=False)
    assert ring.ids() == ["w0", "w1", "w3"] and not checking(ring.state)
