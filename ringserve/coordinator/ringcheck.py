"""Ring checks: the pure decisions behind resolving a partial partition.

A worker can answer the coordinator and still be cut off from its ring neighbours (its routes to
them blackholed). Its neighbours report their streams to it broken, but the coordinator's own probe
finds it alive, so no probe can settle the question. And a broken stream is not dialled again
within a view, so the ring stays dead until a new view comes. The coordinator therefore:

1. publishes a new view with the same members (a *bump*), so every member dials its successor again
   (a transient blip heals that way), and starts a *ring check* on that view;
2. counts a link as up once its receiving end says, in a heartbeat, that its predecessor's stream
   reached it in that view (``Linked``): positive evidence, which a blackholed connect never gives,
   however long TCP takes to give up;
3. if some link is still down :func:`window` after the view was published (half the heartbeat
   timeout), drops one worker (:func:`cut_off`): the one on most of the down links (a worker cut
   off from both neighbours sits on two, each neighbour on one), so the largest connected part of
   the ring goes on. The new view is checked the same way, so each round takes one window and
   removes one worker. A receiver heartbeats as soon as its predecessor's stream of a new view
   reaches it (peers.py's ``on_linked``), so a link that is up says so within a round trip, not
   at the next heartbeat: the window need not cover a heartbeat interval;
4. holds the dropped worker out of admission for a while (:func:`hold_s`), doubling with each cut,
   so that a worker whose routes are still gone does not break the ring at every commit; and checks
   any view that takes it back, so a cut that persists is found within one timeout, not when TCP
   gives up. A check that passes forgets the worker's cuts.

Bumps are bounded (:func:`storming`): past ``MAX_BUMPS`` within ``STORM_WINDOW`` timeouts, a live
suspect is dropped at once instead of bumped again, so a flapping link cannot make a view storm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_BUMPS = 3
STORM_WINDOW = 10  # heartbeat timeouts
MAX_HOLD = 32  # heartbeat timeouts


@dataclass(frozen=True)
class RingCheck:
    """A view whose ring links must all come up by ``deadline``; ``view_id`` 0: the next view."""

    view_id: int
    deadline: float
    linked: frozenset[str] = frozenset()


def down_links(ids: Sequence[str], linked: frozenset[str]) -> list[tuple[str, str]]:
    """The links (sender, receiver) of the ring ``ids`` (rank order) whose receiver is not linked."""
    n = len(ids)
    return [(ids[(r - 1) % n], ids[r]) for r in range(n) if ids[r] not in linked]


def cut_off(ids: Sequence[str], linked: frozenset[str]) -> str:
    """The worker to drop from the ring ``ids`` (rank order), given the receivers whose link is up.

    The worker on most down links; among equals the highest rank, the latest to join, so rank 0
    (the longest-lived member, which the others sync from) stays whenever it can.

    Raises:
        ValueError: every link is up, so nobody is to be dropped.
    """
    down = down_links(ids, linked)
    if not down:
        raise ValueError("Every link of the ring is up: no worker is to be cut off.")
    count = {w: 0 for w in ids}
    for sender, receiver in down:
        count[sender] += 1
        count[receiver] += 1
    rank = {w: r for r, w in enumerate(ids)}
    return max(ids, key=lambda w: (count[w], rank[w]))


def window(heartbeat_timeout_s: float) -> float:
    """How long a checked view's links have to come up: half the heartbeat timeout. A healthy
    link is up, and said so (its receiver heartbeats at once), within a dial and a round trip; the
    other half of the timeout is the partition's own bound, kept for detecting the cut."""
    return heartbeat_timeout_s / 2


def hold_s(cuts: int, heartbeat_timeout_s: float) -> float:
    """How long a worker cut off ``cuts`` times waits before it may be admitted again."""
    return heartbeat_timeout_s * min(2.0 ** (cuts - 1), MAX_HOLD)


def storming(bumps: Sequence[float], now: float, heartbeat_timeout_s: float) -> bool:
    """Whether another bump would pass MAX_BUMPS within the storm window ending ``now``."""
    window = STORM_WINDOW * heartbeat_timeout_s
    return len([t for t in bumps if now - t < window]) >= MAX_BUMPS
