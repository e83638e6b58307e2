"""The status page's pure parts: the board's history (fed by the membership state machine with an
injected clock) and statusview's rates and snapshot (from Status answers built by hand)."""

from __future__ import annotations

import pytest

from ringserve import commits
from ringserve._proto import coordinator_pb2 as pb
from ringserve.coordinator import statusview
from ringserve.coordinator.board import Board
from ringserve.coordinator.membership import (
    Event,
    Heartbeat,
    Join,
    Leave,
    Linked,
    MemberInfo,
    ProbeResult,
    Rules,
    State,
    Suspect,
    Tick,
    ViewInfo,
    step,
)
from ringserve.coordinator.stalls import StallInspector

TIMEOUT = 2.0


class Fed:
    """A membership state machine whose every step is shown to a Board, as the service does."""

    def __init__(self, n: int = 4, min_workers: int = 2) -> None:
        self.state = State(rules=Rules(min_workers, 16, 1.0, heartbeat_timeout_s=TIMEOUT))
        self.board = Board(started=0.0)
        self.now = 0.0
        self.at(0.0, *(Join(f"w{i}", f"addr-{i}", "host", i) for i in range(n)))
        self.at(1.0)

    def at(self, now: float, *events: Event, beat: tuple[str, ...] | None = None) -> None:
        """Applies ``events`` at ``now``; the workers in ``beat`` (all by default) heartbeat every 0.5 s."""
        while self.now < now:
            self.now = min(self.now + 0.5, now)
            for w in list(self.state.workers) if beat is None else beat:
                self.apply(Heartbeat(w), self.now)
        for event in events or (Tick(),):
            self.apply(event, now)

    def apply(self, event: Event, now: float) -> None:
        before = self.state
        self.state, actions = step(before, event, now)
        self.board.applied(before, event, self.state, actions, now)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.board.history]


def test_the_first_view_is_recorded_with_everyone_who_joined_it() -> None:
    fed = Fed(3)
    assert fed.kinds() == ["view", "joined"]
    view, joined = fed.board.history
    assert view.text == "view 1 formed with 3 workers" and view.view_id == 1 and view.at_s == 1.0
    assert joined.text == "joined in view 1: w0 (addr-0), w1 (addr-1), w2 (addr-2)"


def test_a_leave_and_a_silent_worker_are_recorded_with_their_reasons_and_the_views_they_made() -> None:
    fed = Fed(4)
    fed.at(2.0, Leave("w3"))
    fed.at(10.0, beat=("w0", "w1"))  # w2 falls silent after 1.0 s
    events = list(fed.board.history)[2:]
    assert [e.kind for e in events] == ["left", "view", "failed", "view"]
    assert events[0].text == "worker w3 (addr-3) left"
    assert events[1].text == "view 2 formed with 3 workers, 1 left"
    assert events[2].text == f"worker w2 (addr-2) failed: silent for more than {TIMEOUT:g} s"
    assert events[3].text == "view 3 formed with 2 workers, 1 failed"


def test_a_partition_and_its_healing_are_recorded() -> None:
    fed = Fed(4)
    fed.at(10.0, Suspect("w2"), ProbeResult("w2", alive=True))
    assert fed.kinds()[2:] == ["partition", "view"]
    assert "reported worker w2 (addr-2), which answers the coordinator" in fed.board.history[2].text
    view = fed.state.view.view_id
    fed.at(10.5, *(Linked(f"w{i}", view) for i in range(4)))
    assert fed.kinds()[-1] == "healed" and fed.board.history[-1].text == f"every link of view {view} is up: the partition healed"


def test_a_worker_that_stays_cut_off_is_recorded_as_cut_not_failed() -> None:
    fed = Fed(4)
    fed.at(10.0, Suspect("w2"), ProbeResult("w2", alive=True))
    view = fed.state.view.view_id
    fed.at(10.5, Linked("w0", view), Linked("w1", view))
    fed.at(10.0 + TIMEOUT)
    cut = [e for e in fed.board.history if e.kind == "cut"]
    assert len(cut) == 1 and cut[0].text.startswith("worker w2 (addr-2) was dropped: cut off from its ring neighbours")
    assert "failed" not in fed.kinds()


def _beat(step_: int, lineage: int = 0) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(worker_id="w0", view_id=3, committed_step=step_, committed_lineage=lineage)


def test_a_resume_from_a_durable_copy_is_recorded_when_the_lineage_goes_up() -> None:
    board = Board(started=0.0)
    mark = commits.Mark(commits.Commit(0, 40))
    board.beat("w0", _beat(40), mark, 5.0)
    board.beat("w0", _beat(41), commits.Mark(commits.Commit(0, 41)), 6.0)
    assert not board.history
    board.beat("w0", _beat(30, 1), commits.Mark(commits.Commit(1, 30)), 9.0)
    (event,) = board.history
    assert event.kind == "resumed" and event.view_id == 3 and event.at_s == 9.0
    assert event.text.startswith(f"the job resumed at {commits.Commit(1, 30)} from a durable copy")


def test_the_history_keeps_the_newest_events_within_its_bound() -> None:
    fed = Fed(2)
    for i in range(300):
        fed.at(2.0 + i, Join(f"x{i}", f"a{i}", "host"), Leave(f"x{i}"))
    assert len(fed.board.history) == 200


def test_fill_adds_the_history_the_mark_the_stalls_and_each_members_commit() -> None:
    board = Board(started=0.0)
    board.beat("w0", _beat(12), commits.Mark(commits.Commit(0, 12)), 1.0)
    answer = pb.StatusResponse(members=[pb.MemberStatus(member=pb.Member(worker_id="w0")),
                                        pb.MemberStatus(member=pb.Member(worker_id="w1"))])
    board.fill(answer, commits.Mark(commits.Commit(0, 12)), ["'g#1': ranks 1 have not submitted it; ranks 0 wait"])
    assert answer.mark_step == 12 and answer.HasField("mark_step")
    assert answer.members[0].committed_step == 12 and not answer.members[1].HasField("committed_step")
    assert list(answer.stall_warnings) == ["'g#1': ranks 1 have not submitted it; ranks 0 wait"]


def test_stall_warnings_name_the_ranks_missing_from_each_collective_of_the_current_view_only() -> None:
    view = ViewInfo(5, tuple(MemberInfo(f"w{i}", f"a{i}", "h", -1, i) for i in range(4)))
    inspector = StallInspector()
    for worker, (view_id, keys) in {"w0": (5, {"g#1", "h#2"}), "w1": (5, {"g#1"}), "w3": (4, {"g#1"})}.items():
        inspector.heard(worker, view_id, frozenset(keys))
    assert inspector.current(view) == [
        "'g#1': ranks 2, 3 have not submitted it; ranks 0, 1 wait",
        "'h#2': ranks 1, 2, 3 have not submitted it; ranks 0 wait",
    ]
    assert inspector.warnings(view, 5, frozenset({"h#2"}))[0] == ["'h#2': ranks 1, 2, 3 have not submitted it; ranks 0 wait"]
    assert StallInspector().current(view) == []


def _status(t: float, *, step_: int | None = None, lineage: int = 0, sent: tuple[int, int] = (0, 0),
            done: int = 0) -> pb.StatusResponse:
    members = []
    for rank, nbytes in enumerate(sent):
        counters = pb.WorkerCounters(collectives_done=done, links=[
            pb.LinkCounters(view_id=2, peer_rank=1 - rank, lane="shared memory" if rank == 0 else "tcp lane",
                            bytes_sent=nbytes)])
        members.append(pb.MemberStatus(member=pb.Member(worker_id=f"w{rank}", rank=rank, hostname="h"),
                                       counters=counters, seconds_since_heartbeat=0.25))
    answer = pb.StatusResponse(uptime_s=t, view=pb.View(view_id=2), view_size=2, members=members,
                               heartbeat_timeout_s=5.0, heartbeat_interval_s=1.0)
    if step_ is not None:
        answer.mark_step, answer.mark_lineage = step_, lineage
    return answer


def test_edge_rates_are_bytes_over_the_window_and_unknown_for_a_link_seen_once() -> None:
    samples = [statusview.sample(_status(t, sent=(int(t * 1000), int(t * 10)))) for t in (1.0, 2.0, 3.0, 4.0)]
    rates = statusview.edge_rates(samples, window_s=2.0)
    assert rates == {("w0", 2, 1): pytest.approx(1000.0), ("w1", 2, 0): pytest.approx(10.0)}
    assert statusview.edge_rates(samples[:1]) == {("w0", 2, 1): None, ("w1", 2, 0): None}
    assert statusview.edge_rates([]) == {}


def test_the_chart_has_commit_rates_that_restart_at_a_resume_and_no_negative_collective_rates() -> None:
    samples = [statusview.sample(s) for s in (
        _status(1.0, step_=10, done=5), _status(2.0, step_=14, done=9), _status(3.0, step_=2, lineage=1, done=3),
        _status(4.0, done=4),
    )]
    assert statusview.chart(samples) == [
        {"t": 2.0, "commits_per_s": 4.0, "collectives_per_s": 8.0},
        {"t": 3.0, "commits_per_s": None, "collectives_per_s": 0.0},
        {"t": 4.0, "commits_per_s": None, "collectives_per_s": 2.0},
    ]
    assert statusview.chart(samples, span_s=1.5) == statusview.chart(samples)[-2:]


def test_the_snapshot_shows_every_member_with_its_lane_and_every_edge_even_of_a_lane_not_known_here() -> None:
    status = _status(2.0, step_=3, sent=(2000, 20))
    status.members[0].committed_step = 3
    status.history.append(pb.HistoryEvent(at_s=1.0, kind="view", view_id=2, text="view 2 formed with 2 workers"))
    snap = statusview.snapshot(status, [statusview.sample(_status(1.0, sent=(1000, 10))), statusview.sample(status)])
    assert [(m["rank"], m["lane"], m["committed_step"]) for m in snap["members"]] == [(0, "shared memory", 3), (1, "tcp lane", None)]
    assert snap["edges"] == [{"from": 0, "to": 1, "lane": "shared memory", "bytes_per_s": 1000.0},
                             {"from": 1, "to": 0, "lane": "tcp lane", "bytes_per_s": 10.0}]
    assert snap["mark"] == {"step": 3, "lineage": 0} and snap["listed"] == 2 and snap["view_size"] == 2
    assert snap["history"] == [{"at_s": 1.0, "kind": "view", "view_id": 2, "text": "view 2 formed with 2 workers"}]


def _sending(t: float, sent: dict[tuple[int, int], int]) -> pb.StatusResponse:
    """A Status of a world of 3 at ``t`` whose links ((rank, peer): bytes sent) are ``sent``."""
    members = [pb.MemberStatus(member=pb.Member(worker_id=f"w{rank}", rank=rank, hostname="h"),
                               counters=pb.WorkerCounters(links=[
                                   pb.LinkCounters(view_id=2, peer_rank=peer, lane="stream", bytes_sent=n)
                                   for (frm, peer), n in sorted(sent.items()) if frm == rank]))
               for rank in range(3)]
    return pb.StatusResponse(uptime_s=t, view=pb.View(view_id=2), view_size=3, members=members,
                             heartbeat_timeout_s=5.0, heartbeat_interval_s=0.5)


def _drawn(statuses: list[pb.StatusResponse]) -> set[tuple[int, int]]:
    samples: list[statusview.Sample] = []
    for status in statuses:
        samples.append(statusview.sample(status, samples[-1] if samples else None))
    return {(e["from"], e["to"]) for e in statusview.snapshot(statuses[-1], samples)["edges"]}


def test_the_edges_drawn_are_the_links_that_sent_lately_and_a_stall_keeps_them_at_zero() -> None:
    # 0->2 and 2->0 sent once (a measure's pings), then only the ring 0->1->2->0 sends.
    def at(t: int, ring: int, once: int = 1) -> pb.StatusResponse:
        return _sending(float(t), {(0, 1): ring, (1, 2): ring, (2, 0): ring, (0, 2): once, (2, 1): once})

    ring = {(0, 1), (1, 2), (2, 0)}
    assert _drawn([at(1, 10)]) == ring | {(0, 2), (2, 1)}  # all new: each sent in the window
    assert _drawn([at(t, 10 * t) for t in range(1, 6)]) == ring | {(0, 2), (2, 1)}  # within 5 s
    assert _drawn([at(t, 10 * t) for t in range(1, 9)]) == ring
    stalled = [at(t, 10 * min(t, 8)) for t in range(1, 40)]  # no byte moves after t = 8
    assert _drawn(stalled) == ring
    assert {e["bytes_per_s"] for e in statusview.snapshot(stalled[-1], [statusview.sample(stalled[-2]),
                                                                        statusview.sample(stalled[-1])])["edges"]} == {0.0}
    assert len(statusview.snapshot(at(9, 90), [])["edges"]) == 5  # no samples: every link of the view


def test_an_edge_stays_drawn_between_heartbeats_further_apart_than_the_rate_window() -> None:
    assert statusview.in_use_s(0.5) == statusview.EDGE_WINDOW_S and statusview.in_use_s(4.0) == 12.0
    # 1->0's worker is heard every 7 s: its bytes last moved 6 s before the newest traffic.
    slow = [_sending(float(t), {(0, 1): 10 * t, (1, 0): 10 * (t // 7 * 7)}) for t in range(1, 14)]
    for status in slow:
        status.heartbeat_interval_s = 4.0
    assert _drawn(slow) == {(0, 1), (1, 0)}
