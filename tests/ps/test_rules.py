"""The ledger's decisions: rounds in sync and average, clocks in ssp, duplicates, staleness, views."""

from __future__ import annotations

import pytest

from ringserve.errors import InvalidArgumentError
from ringserve.ps.rules import ACCEPT, APPLY, DUPLICATE, STALE, WAIT, Ledger

AB = frozenset({"a", "b"})


def ledger(mode: str, members: frozenset[str] = AB, **kwargs: int) -> Ledger:
    led = Ledger(mode, **kwargs)
    led.install_view(1, members)
    return led


def push(led: Ledger, worker: str, step: int, base: int | None = None, view: int = 1) -> str:
    decision = led.decide_push(worker, step=step, base_version=step if base is None else base, view_id=view)
    led.record(decision, worker, step)
    if decision.outcome == ACCEPT and led.round_complete():
        led.finish_round()
    return decision.outcome


@pytest.mark.parametrize("mode", ["sync", "average"])
def test_a_round_ends_once_every_member_has_pushed_and_not_before(mode: str) -> None:
    led = ledger(mode)
    assert push(led, "a", 0) == ACCEPT and led.version == 0 and led.missing() == ["b"]
    assert not led.pull_ready(min_version=1, clock=0)
    assert push(led, "b", 0) == ACCEPT and led.version == 1
    assert led.pull_ready(min_version=1, clock=0)


def test_a_pushed_step_again_is_a_duplicate_during_its_round_and_after_it() -> None:
    led = ledger("sync")
    push(led, "a", 0)
    assert push(led, "a", 0) == DUPLICATE and led.contributors == {"a"}
    push(led, "b", 0)
    assert push(led, "b", 0) == DUPLICATE and led.version == 1


def test_a_new_view_without_a_member_ends_the_round_it_held_up() -> None:
    led = ledger("sync", frozenset({"a", "b", "c"}))
    push(led, "a", 0)
    push(led, "b", 0)
    assert not led.round_complete()
    led.install_view(2, AB)
    assert led.round_complete()


def test_a_push_for_a_round_that_ended_without_it_is_stale() -> None:
    led = ledger("sync", frozenset({"a", "b", "c"}))
    push(led, "a", 0)
    push(led, "b", 0)
    led.install_view(2, AB)
    led.finish_round()
    led.install_view(3, frozenset({"a", "b", "c"}))
    decision = led.decide_push("c", step=0, base_version=0, view_id=3)
    assert decision.outcome == STALE and "round 0 ended" in decision.detail


def test_a_push_from_outside_the_view_is_stale_and_one_from_a_newer_view_waits_for_it() -> None:
    led = ledger("sync")
    assert led.decide_push("z", step=0, base_version=0, view_id=1).outcome == STALE
    assert led.decide_push("a", step=0, base_version=0, view_id=2).outcome == WAIT
    assert led.decide_push("a", step=0, base_version=0, view_id=0).outcome == STALE


def test_a_restored_shard_skips_to_the_round_the_workers_push_and_counts_the_rounds_lost() -> None:
    led = Ledger("sync", version=40, restored_version=40)
    led.install_view(1, AB)
    assert push(led, "a", 47) == ACCEPT and led.version == 47 and led.lost_updates == 7
    assert push(led, "b", 47) == ACCEPT and led.version == 48


def test_workers_that_saw_more_than_a_restored_shard_holds_make_it_count_the_updates_lost() -> None:
    led = Ledger("async", version=40, restored_version=40)
    assert led.note_seen(45) and led.lost_updates == 5
    assert not led.note_seen(43) and led.lost_updates == 5


def test_async_applies_every_push_and_refuses_one_staler_than_its_bound() -> None:
    led = Ledger("async", max_lag=2)
    for step in range(4):
        assert push(led, "a", step, base=step) == APPLY
    assert led.version == 4
    assert push(led, "b", 0, base=2) == APPLY          # 2 versions old: within the bound
    decision = led.decide_push("b", step=1, base_version=1, view_id=0)
    assert decision.outcome == STALE and "4 versions behind" in decision.detail


def test_async_needs_no_view() -> None:
    assert push(Ledger("async"), "solo", 0, view=0) == APPLY


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_ssp_lets_a_worker_pull_for_a_step_at_most_staleness_ahead_of_the_slowest_member(staleness: int) -> None:
    led = ledger("ssp", staleness=staleness)
    for step in range(staleness + 1):
        assert led.pull_ready(min_version=0, clock=step + 1) == (step + 1 <= staleness)
        push(led, "a", step)
    assert not led.pull_ready(min_version=0, clock=staleness + 2)
    push(led, "b", 0)
    assert led.pull_ready(min_version=0, clock=staleness + 1)


def test_ssp_refuses_a_push_further_behind_the_fastest_member_than_the_bound() -> None:
    led = ledger("ssp", staleness=1)
    for step in range(4):
        led.record(led.decide_push("a", step=step, base_version=step, view_id=1), "a", step)
    decision = led.decide_push("b", step=0, base_version=0, view_id=1)
    assert decision.outcome == STALE and "more than 1 steps behind" in decision.detail


def test_a_member_new_to_a_view_starts_at_the_slowest_continuing_members_clock() -> None:
    led = ledger("ssp", staleness=1)
    for step in range(5):
        push(led, "a", step)
        push(led, "b", step)
    led.install_view(2, frozenset({"a", "b", "c"}))
    assert led.clock("c") == 5 and led.start_clock("c") == 5
    assert led.pull_ready(min_version=0, clock=6)


def test_a_dead_member_stops_holding_back_the_gate_at_the_next_view() -> None:
    led = ledger("ssp", staleness=0)
    push(led, "a", 0)
    assert not led.pull_ready(min_version=0, clock=1)
    led.install_view(2, frozenset({"a"}))
    assert led.pull_ready(min_version=0, clock=1)


def test_a_restored_ssp_shard_takes_each_workers_own_clock_so_the_gate_opens_again() -> None:
    # The checkpoint holds clocks 3 and 2; the workers had pushed 6 and 5 steps when the shard died,
    # and pull for steps 6 and 5: without their own clocks each waits for the other's lost pushes.
    led = ledger("ssp", staleness=1)
    for step in range(3):
        push(led, "a", step)
    for step in range(2):
        push(led, "b", step)
    assert not led.pull_ready(min_version=0, clock=6)
    assert led.note_clock("a", 6) and not led.note_clock("a", 4)  # only ever raised
    assert not led.pull_ready(min_version=0, clock=6)  # b's clock is still the checkpoint's 2
    assert led.note_clock("b", 5)
    assert (led.clock("a"), led.clock("b")) == (6, 5) and led.pull_ready(min_version=0, clock=6)
    assert push(led, "a", 6) == APPLY and push(led, "b", 5) == APPLY


def test_only_ssp_counts_clocks_told_by_workers() -> None:
    for mode in ("sync", "async", "average"):
        assert not ledger(mode).note_clock("a", 9)


def test_an_older_view_changes_nothing() -> None:
    led = ledger("sync")
    led.install_view(5, AB)
    assert not led.install_view(3, frozenset({"a"})) and led.members == AB


def test_an_unknown_mode_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match="'hogwild' is not one of sync, async, ssp, average"):
        Ledger("hogwild")
