"""The heartbeat interval the coordinator hands out as the world grows, and the failure window
that follows it: pure, no loop."""

from __future__ import annotations

import pytest

from ringserve import InvalidArgumentError
from ringserve.config import CoordinatorConfig
from ringserve.coordinator.membership import Heartbeat, Join, Rules, State, Tick, heartbeat_interval, step
from ringserve.coordinator.pacing import failure_window
from ringserve.coordinator.pacing import heartbeat_interval as interval_for


@pytest.mark.parametrize(
    ("workers", "expected"),
    [(1, 1.0), (500, 1.0), (1000, 1.0), (1500, 1.5), (2000, 5 / 3), (10_000, 5 / 3)],
)
def test_the_interval_is_stretched_to_keep_the_rate_under_the_cap_but_never_past_a_third_of_the_timeout(
    workers: int, expected: float
) -> None:
    assert interval_for(1.0, 5.0, 1000.0, workers) == pytest.approx(expected)


def test_the_interval_is_never_shorter_than_configured_and_not_stretched_without_a_cap() -> None:
    assert interval_for(2.0, 5.0, 1000.0, 2000) == 2.0  # already past a third of the timeout
    assert interval_for(1.0, 5.0, 1000.0, 0) == 1.0
    assert interval_for(1.0, 5.0, 0.0, 100_000) == 1.0


@pytest.mark.parametrize(("interval", "timeout", "expected"), [(1.0, 5.0, 2.0), (5 / 3, 5.0, 5 / 3), (0.25, 2.0, 0.5), (2.0, 5.0, 1.0)])
def test_the_failure_window_covers_two_intervals_and_leaves_two_to_the_live(interval: float, timeout: float, expected: float) -> None:
    assert failure_window(interval, timeout) == pytest.approx(expected)


def _world(n: int, rate: float, *, interval: float = 0.25, timeout: float = 2.0) -> State:
    rules = Rules(1, n, 0.1, timeout, failure_window_s=failure_window(interval, timeout),
                  heartbeat_interval_s=interval, max_heartbeats_per_s=rate)
    state = State(rules=rules)
    for i in range(n):
        state, _ = step(state, Join(f"w{i}", f"h:{i}", "h", -1, None), 0.0)
    state, _ = step(state, Tick(), 0.2)
    assert len(state.view.members) == n
    return state


def test_the_membership_hands_out_the_interval_for_the_workers_it_knows() -> None:
    assert heartbeat_interval(_world(100, 0.0)) == 0.25
    assert heartbeat_interval(_world(100, 200.0)) == 0.5
    assert heartbeat_interval(_world(100, 10.0)) == pytest.approx(2.0 / 3)


def test_workers_that_died_together_at_a_stretched_interval_still_leave_in_one_view() -> None:
    """Stretched to 2/3 s (timeout 2 s), the dying workers' last beats spread over 2/3 s, more than
    the configured interval's window (0.5 s) would wait for: the window follows the interval."""
    state = _world(4, 6.0)
    stretched = heartbeat_interval(state)
    assert stretched == pytest.approx(2.0 / 3)
    # w1, w2, w3 die at about t=10, their last beats spread over the stretched interval before.
    for at, alive in [(9.3, "0123"), (9.5, "013"), (9.9, "03"), (10.0, "0")]:
        for w in alive:
            state, _ = step(state, Heartbeat(f"w{w}"), at)
        state, _ = step(state, Tick(), at)
    views = []
    now = 10.0
    while now < 13.0:
        now += 0.05
        if now - 10.0 >= stretched - 0.01:  # w0 goes on beating
            state, _ = step(state, Heartbeat("w0"), now)
        state, actions = step(state, Tick(), now)
        views += [a.view for a in actions if hasattr(a, "view")]
    assert len(views) == 1 and sorted(views[0].failed) == ["w1", "w2", "w3"]
    assert [m.worker_id for m in views[0].members] == ["w0"]


def test_a_negative_heartbeat_rate_cap_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match=r"max_heartbeats_per_s \(-1"):
        CoordinatorConfig(max_heartbeats_per_s=-1)
