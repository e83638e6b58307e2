"""The worker's view-change policy: ``decide(state, view) -> (state, actions)``, pure.

The coordinator publishes views; each worker decides what a new one means for the data planes it
holds (one per view, see plane.py), and ``registry.Planes`` carries the decision out. Like
``ringserve.coordinator.membership.step``, the decision is a pure function of frozen data: no sockets, no
loop, no clock, so every rule below is tested in microseconds (tests/unit/test_policy.py).

Rules, in order:

- **Stale news changes nothing.** A view not newer than the newest one heard of, or one that
  reaches a worker that has stopped (closed, excluded, failed), is ignored.
- **A failure ends the old view hard.** When the new view names failed workers, the current plane
  is closed (every collective on it fails at once with RingChangedError), and so is every older
  plane still draining: their collectives may wait on the failed worker too.
- **A graceful change ends it softly.** When members only joined or left, the old ring is intact:
  the current plane is retired (new collectives fail, those in flight may finish, a leaver drains
  its part before it leaves). A rank that left sent all it ever will (it drains, then leaves), or
  never opened its stream in that view at all, so collectives that wait for frames from it starve
  at once instead of at their deadlines. Leavers are those the view lists as leaving, and, when the
  view has members, those absent from it; an empty view (the world fell below min_workers) names
  no one else, since the others are still draining their streams.
- **A member takes its place.** If this worker is in the new view, a plane opens for its place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ringserve.errors import RingChangedError


@dataclass(frozen=True)
class Place:
    """Where this worker sits in a view: its rank, and every rank's address and worker id."""

    view_id: int
    rank: int
    size: int
    addresses: tuple[str, ...]
    worker_ids: tuple[str, ...] = ()
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hosts: tuple[int, ...] = ()  # every rank's host (its cross_rank), in rank order


@dataclass(frozen=True)
class Member:
    """One member of a published view, in rank order."""

    worker_id: str
    address: str
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1


@dataclass(frozen=True)
class View:
    """A view as the coordinator published it (the worker's copy of ``coordinator_pb2.View``)."""

    view_id: int
    members: tuple[Member, ...]
    left: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class State:
    """What the policy knows: who this worker is, the newest view it heard of, its current place."""

    worker_id: str
    latest_view: int = 0
    current: Place | None = None
    stopped: bool = False


# -- actions -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retire:
    """End the plane of ``view_id`` softly: collectives in flight may finish, new ones fail."""

    view_id: int
    error: RingChangedError


@dataclass(frozen=True)
class Close:
    """End the plane of ``view_id`` now: every collective on it fails with ``error``."""

    view_id: int
    error: RingChangedError


@dataclass(frozen=True)
class CloseRetired:
    """End every older plane still draining, as Close does."""

    error: RingChangedError


@dataclass(frozen=True)
class Starve:
    """Streams from ``ranks`` of view ``view_id`` bring nothing more: collectives waiting for
    their frames fail with ``error``."""

    view_id: int
    ranks: tuple[int, ...]
    error: RingChangedError


@dataclass(frozen=True)
class Open:
    """Open a plane for this worker's place in a new view."""

    place: Place


Action = Retire | Close | CloseRetired | Starve | Open


def decide(state: State, view: View) -> tuple[State, list[Action]]:
    """What the new ``view`` means for this worker's planes (see the module's rules).

    Returns the new state and the actions, in the order they must be carried out: the old plane
    ends before the new one opens, so that frames of the old view never reach the new plane.
    """
    if view.view_id <= state.latest_view or state.stopped:
        return state, []
    actions: list[Action] = []
    old = state.current
    if old is not None:
        error = RingChangedError(old.view_id, view.view_id)
        if view.failed:
            actions += [Close(old.view_id, error), CloseRetired(error)]
        else:
            actions.append(Retire(old.view_id, error))
            gone = leavers(old, view)
            if gone:
                actions.append(Starve(old.view_id, gone, error))
    place = place_in(view, state.worker_id)
    if place is not None:
        actions.append(Open(place))
    return replace(state, latest_view=view.view_id, current=place), actions


def leavers(old: Place, view: View) -> tuple[int, ...]:
    """The ranks of ``old`` (other than this worker's) whose workers left in ``view``."""
    remaining = {m.worker_id for m in view.members}
    return tuple(
        rank for rank, worker_id in enumerate(old.worker_ids)
        if rank != old.rank and (worker_id in view.left or (remaining and worker_id not in remaining))
    )


def place_in(view: View, worker_id: str) -> Place | None:
    """This worker's place in ``view``, or None if it is not a member."""
    ranks = [r for r, m in enumerate(view.members) if m.worker_id == worker_id]
    if not ranks:
        return None
    rank = ranks[0]
    me = view.members[rank]
    return Place(
        view_id=view.view_id, rank=rank, size=len(view.members),
        addresses=tuple(m.address for m in view.members),
        worker_ids=tuple(m.worker_id for m in view.members),
        local_rank=me.local_rank, local_size=me.local_size,
        cross_rank=me.cross_rank, cross_size=me.cross_size,
        hosts=tuple(m.cross_rank for m in view.members),
    )


def stop(state: State) -> State:
    """The worker stopped (closed, excluded or failed): it ignores every later view."""
    return replace(state, stopped=True, current=None)
