"""The committed high-water mark and the sync decision (ringserve/commits.py): pure, no loop."""

from __future__ import annotations

import itertools

import pytest

from ringserve.commits import (
    INITIAL,
    MAX_HOLDERS,
    Await,
    Commit,
    Gone,
    Holder,
    Lost,
    Mark,
    Readmit,
    Renew,
    Resume,
    Seen,
    TakeRoot,
    after_loss,
    judge_holders,
    plan_sync,
    record,
    record_view,
)


def c(step: int, lineage: int = 0) -> Commit:
    return Commit(lineage, step)


def holder(worker: str, rank: int = 0, view: int = 1) -> Holder:
    return Holder(worker_id=worker, address=f"127.0.0.1:{1000 + rank}", view_id=view, rank=rank)


# -- the mark --------------------------------------------------------------------------------


def test_the_first_report_sets_the_mark_and_its_holder() -> None:
    mark = record(Mark(), holder("a"), c(5))
    assert mark.commit == c(5) and [h.worker_id for h in mark.holders] == ["a"]


def test_a_further_commit_replaces_the_holders_and_the_same_commit_adds_one() -> None:
    mark = record(Mark(), holder("a"), c(5))
    mark = record(mark, holder("b"), c(5))
    assert [h.worker_id for h in mark.holders] == ["a", "b"]
    mark = record(mark, holder("b", rank=1), c(6))
    assert mark.commit == c(6) and [h.worker_id for h in mark.holders] == ["b"]


def test_an_older_report_changes_nothing_and_a_holder_is_listed_once_with_its_latest_place() -> None:
    mark = record(record(Mark(), holder("a", 0, view=1), c(5)), holder("b"), c(5))
    assert record(mark, holder("c"), c(4)) == mark
    mark = record(mark, holder("a", 2, view=3), c(5))
    assert [(h.worker_id, h.view_id, h.rank) for h in mark.holders] == [("b", 1, 0), ("a", 3, 2)]


def test_a_commit_of_a_newer_lineage_outranks_any_step_of_an_older_one() -> None:
    mark = record(Mark(), holder("a"), c(110))
    mark = record(mark, holder("b"), c(108, lineage=1))
    assert mark.commit == c(108, lineage=1)
    assert record(mark, holder("late"), c(110)) == mark  # a stale report of the lost line


def test_a_holder_describes_its_rank_view_worker_and_address() -> None:
    assert holder("abcdef0123456789", rank=2, view=7).describe() == "rank 2 of view 7, worker abcdef01 at 127.0.0.1:1002"
    assert "a worker of view 7" in Holder("x", "h:1", 7, -1).describe()


# -- the sync decision -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "mark", "root"),
    [
        ([INITIAL] * 4, None, 0),  # the job's first sync: everyone fresh, rank 0's values
        ([INITIAL] * 3, c(0), 0),  # nothing committed yet: nothing to lose
        ([c(10), c(10), INITIAL], c(10), 0),  # rank 0, the longest-lived member
        ([c(10), c(11), INITIAL], c(10), 1),  # a survivor that committed once more
        ([INITIAL, c(7), c(7)], c(7), 1),  # the lowest rank among the furthest
        ([c(3)], c(2), 0),  # the mark trails the commits by a heartbeat
        ([c(5, lineage=1), c(9)], c(9), 0),  # a newer lineage wins over a higher step of an older one
        ([INITIAL, INITIAL], None, 0),  # a restarted coordinator knows no mark: members decide
    ],
)
def test_a_view_takes_the_lowest_rank_holding_the_furthest_commit_when_it_reaches_the_mark(
    held: list[Commit], mark: Commit | None, root: int
) -> None:
    assert plan_sync(held, mark) == TakeRoot(root)


@pytest.mark.parametrize(
    ("held", "mark", "best", "best_rank"),
    [
        ([INITIAL, INITIAL], c(110), INITIAL, 0),  # every holder died; only fresh processes are left
        ([INITIAL, c(64)], c(70), c(64), 1),  # a stale member holds less than the job committed
        ([c(200)], c(5, lineage=1), c(200), 0),  # the job resumed at lineage 1; 200 is of the lost line
    ],
)
def test_a_view_whose_members_all_hold_less_than_the_mark_has_lost_the_state(
    held: list[Commit], mark: Commit, best: Commit, best_rank: int
) -> None:
    assert plan_sync(held, mark) == Lost(mark=mark, best=best, best_rank=best_rank)


def test_a_view_whose_members_all_made_a_new_state_starts_a_lineage_above_the_mark() -> None:
    # A second elastic.run in the same job, with a new state on every member: nothing was lost.
    assert plan_sync([INITIAL, INITIAL], c(15), [True, True]) == Renew(root=0, lineage=1)
    assert plan_sync([INITIAL, c(3, lineage=2)], c(15, lineage=2), [True, True]) == Renew(root=1, lineage=3)


def test_a_fresh_process_beside_members_that_renewed_their_state_joins_the_new_training() -> None:
    assert plan_sync([INITIAL, INITIAL], c(15), [True, None]) == Renew(root=0, lineage=1)


def test_a_view_where_a_member_that_reported_did_not_renew_or_nobody_renewed_has_lost_the_state() -> None:
    # A member holding less than the mark without having renewed: the commit's holders are gone.
    assert plan_sync([INITIAL, c(3)], c(15), [True, False]) == Lost(mark=c(15), best=c(3), best_rank=1)
    # Fresh processes only: the restarted holders' state is gone.
    assert plan_sync([INITIAL, INITIAL], c(15), [None, None]) == Lost(mark=c(15), best=INITIAL, best_rank=0)
    assert plan_sync([c(15), INITIAL], c(15), [False, True]) == TakeRoot(0)  # the mark is held: no question


def test_a_view_of_no_ranks_is_a_bug() -> None:
    with pytest.raises(ValueError):
        plan_sync([], None)


def test_after_a_loss_without_a_durable_copy_the_world_fails() -> None:
    assert after_loss(Lost(mark=c(110), best=INITIAL, best_rank=0), None) is None


@pytest.mark.parametrize(
    ("lost", "durable", "expected"),
    [
        # The newest checkpoint, as the first commit of the next lineage, from rank 0.
        (Lost(c(110), INITIAL, 0), c(108), Resume(commit=c(108), durable=True, root=0, lineage=1)),
        # A checkpoint newer than the mark (the mark trails by a heartbeat): nothing lost.
        (Lost(c(110), INITIAL, 0), c(111), Resume(commit=c(111), durable=True, root=0, lineage=1)),
        # A member holds more than the checkpoint: that member's state, not the older copy.
        (Lost(c(110), c(105), 2), c(100), Resume(commit=c(105), durable=False, root=2, lineage=1)),
        # A second loss within lineage 1 starts lineage 2.
        (Lost(c(120, lineage=1), INITIAL, 0), c(118, lineage=1), Resume(commit=c(118, lineage=1), durable=True, root=0, lineage=2)),
    ],
)
def test_after_a_loss_the_world_resumes_from_the_newest_of_the_durable_copy_and_the_members(
    lost: Lost, durable: Commit, expected: Resume
) -> None:
    assert after_loss(lost, durable) == expected


def test_a_resumed_world_is_never_again_found_lost_by_reports_of_the_line_it_replaced() -> None:
    resume = after_loss(Lost(c(110), INITIAL, 0), c(108))
    assert resume is not None
    resumed = Commit(resume.lineage, resume.commit.step)
    # Until its first heartbeat, the coordinator still says 110 of lineage 0: not a loss.
    assert plan_sync([resumed, resumed], c(110)) == TakeRoot(0)


def test_a_commit_made_in_a_view_names_its_members_once_each_in_rank_order_within_the_cap() -> None:
    members = [holder(f"m{r}", r, view=4) for r in range(3)]
    mark = record_view(record(Mark(), holder("old"), c(8)), members, c(9))
    assert mark.commit == c(9) and [h.worker_id for h in mark.holders] == ["m0", "m1", "m2"]
    again = record_view(record(mark, holder("x", 5, view=5), c(9)), members, c(9))
    assert [h.worker_id for h in again.holders] == ["m0", "m1", "m2", "x"]
    assert record_view(mark, [holder("y")], c(8)) == mark  # an older commit changes nothing
    many = [holder(f"w{r}", r) for r in range(MAX_HOLDERS + 10)]
    assert len(record_view(Mark(), many, c(1)).holders) == MAX_HOLDERS


# -- a holder out of the view is not yet a holder gone ---------------------------------------------
# Found under a load average of 60: live holders missed their heartbeats, were dropped, and the
# view without them raised StateLostError although they were alive and came back a moment later.

BOUND = 30.0


def test_a_holder_declared_dead_while_alive_and_back_with_the_coordinator_is_readmitted_not_declared_lost() -> None:
    a, b = holder("a", 0), holder("b", 1)
    assert plan_sync([INITIAL], c(55)) == Lost(mark=c(55), best=INITIAL, best_rank=0)
    assert judge_holders([(a, Seen.BACK), (b, Seen.GONE)], waited_s=0.0, bound_s=BOUND) == Readmit((a,))


def test_holders_that_answer_or_stay_silent_are_waited_for_within_the_bound_and_then_declared_lost() -> None:
    a, b = holder("a", 0), holder("b", 1)
    seen = [(a, Seen.SILENT), (b, Seen.ALIVE)]
    assert judge_holders(seen, waited_s=BOUND - 0.01, bound_s=BOUND) == Await((a, b))
    gone = judge_holders(seen, waited_s=BOUND, bound_s=BOUND)
    assert isinstance(gone, Gone)
    assert gone.why == ("no holder came back within 30 s (holder_wait_s): worker a at 127.0.0.1:1000 silent (no answer); "
                        "worker b at 127.0.0.1:1001 alive (its peer server answers)")


def test_holders_whose_address_refuses_connections_are_gone_at_once_without_a_wait() -> None:
    gone = judge_holders([(holder("a", 0), Seen.GONE), (holder("b", 1), Seen.GONE)], waited_s=0.0, bound_s=BOUND)
    assert isinstance(gone, Gone) and gone.why.startswith("every holder is gone: worker a at 127.0.0.1:1000 gone")


def test_one_holder_gone_and_one_silent_is_waited_for() -> None:
    a, b = holder("a", 0), holder("b", 1)
    assert judge_holders([(a, Seen.GONE), (b, Seen.SILENT)], waited_s=1.0, bound_s=BOUND) == Await((b,))


def test_a_holder_back_but_never_admitted_is_readmitted_only_within_the_bound() -> None:
    # (Say the view is at max_workers.) Each readmission yields a new view; the bound ends them.
    gone = judge_holders([(holder("a"), Seen.BACK)], waited_s=BOUND, bound_s=BOUND)
    assert isinstance(gone, Gone) and "back with the coordinator" in gone.why


def test_no_holder_named_is_a_loss_at_once_and_a_zero_bound_never_waits() -> None:
    assert isinstance(judge_holders([], waited_s=0.0, bound_s=BOUND), Gone)
    assert isinstance(judge_holders([(holder("a"), Seen.SILENT)], waited_s=0.0, bound_s=0.0), Gone)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_state_is_declared_lost_only_when_every_holder_is_gone_or_the_bound_has_passed(count: int) -> None:
    holders = [holder(f"h{i}", i) for i in range(count)]
    for sights in itertools.product(list(Seen), repeat=count):
        for waited in (0.0, BOUND / 2, BOUND, 2 * BOUND):
            verdict = judge_holders(list(zip(holders, sights, strict=True)), waited_s=waited, bound_s=BOUND)
            all_gone = all(s is Seen.GONE for s in sights)
            assert isinstance(verdict, Gone) == (all_gone or waited >= BOUND), (sights, waited, verdict)
            if isinstance(verdict, Readmit):
                assert Seen.BACK in sights and {h.worker_id for h in verdict.holders} == {
                    h.worker_id for h, s in zip(holders, sights, strict=True) if s is Seen.BACK}
            if isinstance(verdict, Await):
                assert Seen.BACK not in sights
