"""The membership state machine: ``step(state, event, now) -> (state, actions)``.

Pure and clock-injected: the coordinator service feeds it events and carries out the actions it
returns. Views are numbered; a view lists its members in rank order. Members of the current view
keep their relative order (rank 0 is the longest-lived member), and newcomers follow in join order,
or in the order of their rank hints for the first view.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

INF = float("inf")


@dataclass(frozen=True)
class MemberInfo:
    worker_id: str
    address: str
    hostname: str
    rank_hint: int
    join_seq: int


@dataclass(frozen=True)
class ViewInfo:
    """A numbered membership; ``members`` are in rank order. An empty view means "no world"."""

    view_id: int
    members: tuple[MemberInfo, ...]
    left: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()

    def rank_of(self, worker_id: str) -> int | None:
        for rank, m in enumerate(self.members):
            if m.worker_id == worker_id:
                return rank
        return None

    def local(self, rank: int) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size) of the member at ``rank``."""
        host = self.members[rank].hostname
        same = [i for i, m in enumerate(self.members) if m.hostname == host]
        hosts = list(dict.fromkeys(m.hostname for m in self.members))
        return same.index(rank), len(same), hosts.index(host), len(hosts)


@dataclass(frozen=True)
class Rules:
    min_workers: int
    max_workers: int
    settle_s: float
    heartbeat_timeout_s: float


@dataclass(frozen=True)
class State:
    rules: Rules
    workers: dict[str, MemberInfo] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)
    view: ViewInfo = ViewInfo(0, ())
    changed_at: float = -INF
    join_seq: int = 0
    # Workers removed since the last published view, by how they went.
    left: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Join:
    worker_id: str
    address: str
    hostname: str
    rank_hint: int = -1


@dataclass(frozen=True)
class Leave:
    worker_id: str


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str


@dataclass(frozen=True)
class Tick:
    pass


Event = Join | Leave | Heartbeat | Tick


@dataclass(frozen=True)
class PublishView:
    view: ViewInfo


@dataclass(frozen=True)
class Removed:
    worker_id: str
    reason: str


Action = PublishView | Removed


def step(state: State, event: Event, now: float) -> tuple[State, list[Action]]:
    """Applies one event at time ``now`` and returns the new state and the actions to carry out."""
    actions: list[Action] = []
    if isinstance(event, Join):
        state = _join(state, event, now)
    elif isinstance(event, Leave):
        if event.worker_id in state.workers:
            state = _remove(state, event.worker_id, now)
            state = replace(state, left=state.left | {event.worker_id})
            actions.append(Removed(event.worker_id, "left"))
    elif isinstance(event, Heartbeat):
        if event.worker_id in state.workers:
            state = replace(state, last_seen={**state.last_seen, event.worker_id: now})
    deadline = state.rules.heartbeat_timeout_s
    for wid, seen in list(state.last_seen.items()):
        if now - seen > deadline:
            state = _remove(state, wid, now)
            state = replace(state, failed=state.failed | {wid})
            actions.append(Removed(wid, f"silent for more than {deadline:g} s"))
    state, published = _maybe_publish(state, now)
    actions.extend(published)
    return state, actions


def is_known(state: State, worker_id: str) -> bool:
    return worker_id in state.workers


def _join(state: State, event: Join, now: float) -> State:
    old = state.workers.get(event.worker_id)
    info = MemberInfo(
        worker_id=event.worker_id,
        address=event.address,
        hostname=event.hostname,
        rank_hint=event.rank_hint,
        join_seq=old.join_seq if old else state.join_seq,
    )
    changed = old != info
    return replace(
        state,
        workers={**state.workers, event.worker_id: info},
        last_seen={**state.last_seen, event.worker_id: now},
        changed_at=now if changed else state.changed_at,
        join_seq=state.join_seq + (0 if old else 1),
    )


def _remove(state: State, worker_id: str, now: float) -> State:
    workers = {k: v for k, v in state.workers.items() if k != worker_id}
    seen = {k: v for k, v in state.last_seen.items() if k != worker_id}
    return replace(state, workers=workers, last_seen=seen, changed_at=now)


def _desired(state: State) -> tuple[MemberInfo, ...]:
    current = {m.worker_id: r for r, m in enumerate(state.view.members)}

    def key(m: MemberInfo) -> tuple[float, float, int]:
        if m.worker_id in current:
            return (0, current[m.worker_id], 0)
        hint = m.rank_hint if m.rank_hint >= 0 and not state.view.members else INF
        return (1, hint, m.join_seq)

    ordered = sorted(state.workers.values(), key=key)
    return tuple(ordered[: state.rules.max_workers])


def _maybe_publish(state: State, now: float) -> tuple[State, list[Action]]:
    desired = _desired(state)
    current_ids = [m.worker_id for m in state.view.members]
    desired_ids = [m.worker_id for m in desired]
    if desired_ids == current_ids and desired == state.view.members:
        return state, []
    lost = set(current_ids) - set(desired_ids)
    enough = len(desired) >= state.rules.min_workers
    if lost and not enough:
        # The world fell below its minimum: end it now, so that nobody waits on a dead ring.
        if not state.view.members:
            return state, []
        return _publish(state, ())
    if not enough:
        return state, []
    settled = now - state.changed_at >= state.rules.settle_s
    if not lost and not settled:
        return state, []
    return _publish(state, desired)


def _publish(state: State, members: tuple[MemberInfo, ...]) -> tuple[State, list[Action]]:
    previous = {m.worker_id for m in state.view.members}
    view = ViewInfo(
        state.view.view_id + 1,
        members,
        left=tuple(sorted(state.left & previous)),
        failed=tuple(sorted(state.failed & previous)),
    )
    return replace(state, view=view, left=frozenset(), failed=frozenset()), [PublishView(view)]
