"""The pure half of a worker's exclusion: when to ask the peers, and what their answers mean."""

from __future__ import annotations

import pytest

from ringserve.worker.control.exclusion import excluded, must_ask


@pytest.mark.parametrize(("silent_s", "ask"), [(0.0, False), (1.99, False), (2.0, True), (30.0, True)])
def test_the_peers_are_asked_only_once_the_coordinator_may_have_declared_the_worker_dead(silent_s: float, ask: bool) -> None:
    assert must_ask(silent_s, heartbeat_timeout_s=2.0) is ask


@pytest.mark.parametrize(
    ("own", "peers", "newer"),
    [
        (4, [4, 4, 4], 0),  # the coordinator is gone for everyone: all wait for it together
        (4, [0, 0], 0),  # nobody answered: no proof, keep going
        (4, [4, 5, 0], 5),  # one peer went on: the world moved on without us
        (5, [4, 4], 0),  # the peers lag behind: not a proof of anything
        (4, [], 0),
    ],
)
def test_a_worker_is_excluded_only_when_a_peer_is_in_a_view_newer_than_the_last_one_it_was_in(
    own: int, peers: list[int], newer: int
) -> None:
    assert excluded(own, peers) == newer
