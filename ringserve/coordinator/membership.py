"""The membership state machine: ``step(state, event, now) -> (state, actions)``.

Pure and clock-injected: the coordinator service feeds it events and carries out the actions it
returns (publishing a view, probing a suspect). Views are numbered; a view lists its members in
rank order. Members of the current view keep their relative order (rank 0 is the longest-lived
member), and newcomers follow in join order, or in the order of their rank hints for the first view.

Rules, in order of precedence:

- **Failure**: a worker silent for ``heartbeat_timeout_s``, or a suspect whose probe failed, is
  removed, and a view without it is published; a worker is never declared dead for silence
  shorter than the full timeout. Silence is checked on ``Tick``. With a grace
  (``silence_grace_s``), a worker silent for the timeout is first probed, and only a heartbeat
  keeps it; workers that died together leave in one view (the failure window, and the sweep of
  ``sweep_s``). See ``ringserve.coordinator.silence``, which argues the design.
- **Rendezvous**: the first view forms once ``min_workers`` have joined and membership has been
  stable for ``settle_s``.
- **Admission**: once a world runs, newcomers wait until a member asks for them to be admitted (an
  elastic job does so at a commit, after all ranks agreed to), so that nobody's training step is
  cut in half by a joiner. That request always yields a new view at once, with the waiting workers
  or, if they are gone by then, with the same members: every rank already waits for a newer view.
  The request also names the members that leave at that commit; they go in that same view, as
  graceful leaves (one view for the commit's whole change). An empty world admits at once.
  A newcomer that prepares (``Join.prepare``: it builds its model, optimizer and data first) is
  not even waiting until it says it is ready (``Ready``), so that the members neither stop for it
  nor hear of it before; a world that forms takes it at once, ready or not.
- **Recovery**: a restarted coordinator knows nothing; workers rejoin claiming the view they run
  in. When every member of the newest claimed view is back, that same view (same id, same ranks)
  is adopted, so the world goes on undisturbed; when some do not come back within the heartbeat
  timeout, the next view is formed from those that did. A restarted coordinator never starts a
  second world numbered from 1 beside the running one.
- **Partial partitions**: a suspect that answers the probe is cut off from its peers only; a bump
  view re-forms the ring and a ring check drops one side if a link stays down (see
  ``ringserve.coordinator.ringcheck``, which argues the design).
"""

from __future__ import annotations

from dataclasses import replace

from ringserve.coordinator import ringcheck as links
from ringserve.coordinator.ringcheck import RingCheck
from ringserve.coordinator.roster import (
    INF,
    Action,
    Admit,
    Claim,
    Event,
    Heartbeat,
    Join,
    Leave,
    Linked,
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
    remove_all,
    seen,
    with_beat,
)
from ringserve.coordinator.silence import (
    PEER_DEAD,
    expire,
    forgive_stall,
    heartbeat_interval,
    settle_deaths,
    silent_answered,
    silent_past_bound,
)

# The state machine's vocabulary is defined in roster.py, and its silence rules in silence.py (so
# that the two share it without importing each other); callers name it all from here.
__all__ = [
    "Action", "Admit", "Claim", "Event", "Heartbeat", "Join", "Leave", "Linked", "MemberInfo", "Probe", "ProbeResult",
    "PublishView", "Ready", "Removed", "Rules", "State", "Suspect", "Tick", "ViewInfo", "admissible", "checking",
    "heartbeat_interval", "is_known", "seen", "step", "waiting",
]


def step(state: State, event: Event, now: float) -> tuple[State, list[Action]]:
    """Applies one event at time ``now`` and returns the new state and the actions to carry out.

    A heartbeat costs the same whatever the number of workers: it is recorded, and nothing else
    is looked at. Deadlines (silence, settling, recovery) are checked on ``Tick``.
    """
    actions: list[Action] = []
    if isinstance(event, Heartbeat):
        if event.worker_id not in state.workers:
            return state, []
        return with_beat(state, event.worker_id, now), []
    if isinstance(event, Join):
        state = _join(state, event, now)
    elif isinstance(event, Ready):
        if event.worker_id in state.preparing:
            state = replace(state, preparing=state.preparing - {event.worker_id}, dirty=True)
    elif isinstance(event, Leave):
        if event.worker_id in state.workers:
            state = _remove(state, event.worker_id, now, failed=False)
            actions.append(Removed(event.worker_id, "left"))
    elif isinstance(event, Suspect):
        member = state.workers.get(event.worker_id)
        if member is not None and event.worker_id not in state.suspects:
            state = replace(state, suspects=state.suspects | {event.worker_id})
            actions.append(Probe(event.worker_id, member.address))
    elif isinstance(event, ProbeResult) and event.since is not None:
        state = silent_answered(state, event)
    elif isinstance(event, ProbeResult):
        member = state.workers.get(event.worker_id)
        if event.timed_out and member is not None and not silent_past_bound(state, event.worker_id, now):
            # No answer in time from a worker not yet silent for as long as a death takes: a
            # process stalled (starved of CPU) while its links broke under its peers, or one
            # wedged, or cut off. It is asked again until it answers (its ring is re-formed, as
            # for a link down), refuses, or its silence passes that bound (it is removed).
            return state, [Probe(event.worker_id, member.address)]
        state = replace(state, suspects=state.suspects - {event.worker_id})
        if not event.alive and event.worker_id in state.workers and state.rules.sweep_s > 0:
            state = replace(state, found_dead={**state.found_dead, event.worker_id: PEER_DEAD})
        elif not event.alive and event.worker_id in state.workers:
            state = _remove(state, event.worker_id, now, failed=True)
            actions.append(Removed(event.worker_id, PEER_DEAD))
        elif event.alive and event.worker_id in state.workers:
            state, cut = _partitioned(state, event.worker_id, now)
            actions.extend(cut)
    elif isinstance(event, Linked):
        state = _linked(state, event)
    elif isinstance(event, Admit):
        current = event.view_id in (0, state.view.view_id)
        if current and state.view.rank_of(event.requester_id) is not None:
            # Leavers named by the requester go now, gracefully, in the one view that also admits:
            # each leaver's own Leave (after its drain) would come later, one view per leaver, and
            # the survivors would sync in a view that still holds the next one to go.
            leaving = [w for w in dict.fromkeys(event.leaving) if state.view.rank_of(w) is not None and w in state.workers]
            if leaving:
                state = remove_all(state, leaving, now, failed=False)
                actions.extend(Removed(w, "left") for w in leaving)
            state = replace(state, admit=True, bump=True, dirty=True)
    elif isinstance(event, Tick):
        state = replace(forgive_stall(state, now), ticked_at=now)
        state, removed = expire(state, now)
        actions.extend(removed)
        if state.silent_probes or state.found_dead:
            state, settled = settle_deaths(state, now)
            actions.extend(settled)
    if state.check is not None or state.held:
        state, cut = _check_ring(state, now)
        actions.extend(cut)
    state, published = _maybe_publish(state, now)
    actions.extend(published)
    if published and (state.check is not None or state.cuts):
        state = _arm_check(state, now)
    return state, actions


def checking(state: State) -> bool:
    """Whether a ring check waits for members to say their links are up (``Linked`` events)."""
    return state.check is not None


def is_known(state: State, worker_id: str) -> bool:
    return worker_id in state.workers


def waiting(state: State) -> int:
    """Workers that joined but are not in the current view."""
    in_view = state.view.ranks
    return len([w for w in state.workers if w not in in_view])


def admissible(state: State) -> int:
    """Waiting workers that the next view would take, within max_workers (none still held out,
    nor still preparing)."""
    room = state.rules.max_workers - len(state.view.members)
    count = max(0, min(waiting(state) - len(_kept_out(state)), room))
    if count and any(m.gang for m in state.workers.values()):
        # What the next view would take: max_workers may leave a gang out whole (_desired).
        count = len([m for m in _desired(state, admitting=True) if state.view.rank_of(m.worker_id) is None])
    return count


def _kept_out(state: State) -> set[str]:
    """Workers that joined but may not be admitted yet: held out after a cut (ringcheck), or
    preparing to join a running world (a world that forms, with no view running, takes those
    preparing too), and the waiting workers of a gang that the view would not then hold whole."""
    out = state.held.keys() & state.workers.keys()
    if state.view.members and state.preparing:
        out |= {w for w in state.preparing if w in state.workers and state.view.rank_of(w) is None}
    return out | _short_gangs(state, out)


def _short_gangs(state: State, out: set[str]) -> set[str]:
    """The waiting workers of every gang (MemberInfo.gang) that has fewer than its gang_size
    workers in the view or admissible (not in ``out``): a replica group of fault-tolerant HSDP
    shares its model's shards, and a part of it could train nothing, so it comes in whole."""
    waiting_gangs = {m.gang for m in state.workers.values() if m.gang and state.view.rank_of(m.worker_id) is None}
    if not waiting_gangs:
        return set()
    counts: dict[str, int] = {}
    for m in state.workers.values():
        if m.gang in waiting_gangs and (m.worker_id not in out or state.view.rank_of(m.worker_id) is not None):
            counts[m.gang] = counts.get(m.gang, 0) + 1
    return {m.worker_id for m in state.workers.values()
            if m.gang in waiting_gangs and state.view.rank_of(m.worker_id) is None
            and counts.get(m.gang, 0) < m.gang_size}


def provisional(state: State, worker_id: str) -> tuple[int, int, int, int]:
    """Where a joiner would stand if every worker waiting now were admitted (joiners come after
    the members, in the order they joined): its rank, the size of that view, its local rank and
    the number of that view's workers on its host."""
    joiners = sorted((w for w in state.workers if state.view.rank_of(w) is None), key=lambda w: state.workers[w].join_seq)
    order = [*(m.worker_id for m in state.view.members), *joiners][: state.rules.max_workers]
    rank = order.index(worker_id) if worker_id in order else len(order) - 1
    hosts = {m.worker_id: m.hostname for m in (*state.view.members, *state.workers.values())}
    local = [w for w in order if hosts[w] == hosts[worker_id]] if worker_id in order else [worker_id]
    return rank, len(order), local.index(worker_id), len(local)


def _partitioned(state: State, suspect: str, now: float) -> tuple[State, list[Action]]:
    """A peer reported ``suspect`` and it answered the probe: a link is down, not a worker."""
    view = state.view
    if view.rank_of(suspect) is None or len(view.members) < 2 or state.check is not None:
        # A check under way (or the bump it waits for) settles this report too.
        return state, []
    timeout = state.rules.heartbeat_timeout_s
    if links.storming(state.bumps, now, timeout):
        return _cut(state, suspect, now, f"reported by its peers again after {links.MAX_BUMPS} new rings")
    bumps = (*tuple(t for t in state.bumps if now - t < links.STORM_WINDOW * timeout), now)
    return replace(state, bump=True, dirty=True, bumps=bumps, check=RingCheck(0, INF)), []


def _linked(state: State, event: Linked) -> State:
    check = state.check
    if check is None or event.view_id != check.view_id or event.view_id != state.view.view_id:
        return state
    if state.view.rank_of(event.worker_id) is None:
        return state
    linked = check.linked | {event.worker_id}
    if len(linked) < len(state.view.members):
        return replace(state, check=replace(check, linked=linked))
    # Every link is up: the partition (if any) healed, and nobody here owes a cut any more.
    members = {m.worker_id for m in state.view.members}
    return replace(state, check=None, cuts={w: c for w, c in state.cuts.items() if w not in members})


def _check_ring(state: State, now: float) -> tuple[State, list[Action]]:
    """Lets held workers in again once their time is up, and drops a worker if a link stayed down."""
    if state.held:
        held = {w: t for w, t in state.held.items() if t > now}
        if len(held) != len(state.held):
            # A worker held out may be admitted again: the next view may differ.
            state = replace(state, held=held, dirty=True)
    check = state.check
    if check is None or check.view_id != state.view.view_id or now < check.deadline:
        return state, []
    ids = [m.worker_id for m in state.view.members]
    victim = links.cut_off(ids, check.linked)
    down = len([link for link in links.down_links(ids, check.linked) if victim in link])
    reason = (f"cut off from its ring neighbours: {down} of its links did not come up within "
              f"{links.window(state.rules.heartbeat_timeout_s):g} s, though it answers the coordinator")
    return _cut(state, victim, now, reason)


def _cut(state: State, worker_id: str, now: float, reason: str) -> tuple[State, list[Action]]:
    """Drops a worker that answers but cannot reach its peers, and holds it out for a while."""
    cuts = state.cuts.get(worker_id, 0) + 1
    until = now + links.hold_s(cuts, state.rules.heartbeat_timeout_s)
    state = _remove(state, worker_id, now, failed=True)
    state = replace(
        state, check=RingCheck(0, INF), cuts={**state.cuts, worker_id: cuts}, held={**state.held, worker_id: until}
    )
    return state, [Removed(worker_id, reason)]


def _arm_check(state: State, now: float) -> State:
    """Checks a view just published if a check waits for it, or if it takes back a cut-off worker."""
    view = state.view
    if len(view.members) < 2:
        return replace(state, check=None)
    if state.check is None and not any(m.worker_id in state.cuts for m in view.members):
        return state
    return replace(state, check=RingCheck(view.view_id, now + links.window(state.rules.heartbeat_timeout_s)))


def _join(state: State, event: Join, now: float) -> State:
    old = state.workers.get(event.worker_id)
    info = MemberInfo(
        worker_id=event.worker_id,
        address=event.address,
        hostname=event.hostname,
        rank_hint=event.rank_hint,
        join_seq=old.join_seq if old else state.join_seq,
        gang=event.gang,
        gang_size=event.gang_size,
    )
    claims = state.claims
    first_claim_at = state.first_claim_at
    if event.claim is not None and event.claim.view_id > state.view.view_id:
        claims = {**claims, event.worker_id: event.claim}
        first_claim_at = min(first_claim_at, now)
    changed = old != info
    preparing = state.preparing
    if event.prepare and state.view.members and state.view.rank_of(event.worker_id) is None:
        preparing = preparing | {event.worker_id}
    return replace(
        state,
        preparing=preparing,
        workers={**state.workers, event.worker_id: info},
        last_seen={**state.last_seen, event.worker_id: now},
        changed_at=now if changed else state.changed_at,
        join_seq=state.join_seq + (0 if old else 1),
        claims=claims,
        first_claim_at=first_claim_at,
        dirty=True,
    )


def _remove(state: State, worker_id: str, now: float, *, failed: bool) -> State:
    return remove_all(state, [worker_id], now, failed=failed)


def _desired(state: State, *, admitting: bool = False) -> tuple[MemberInfo, ...]:
    current = {m.worker_id: r for r, m in enumerate(state.view.members)}
    admitting = admitting or state.admit or not state.view.members

    def key(m: MemberInfo) -> tuple[float, float, int]:
        if m.worker_id in current:
            return (0, current[m.worker_id], 0)
        hint = m.rank_hint if m.rank_hint >= 0 and not state.view.members else INF
        return (1, hint, m.join_seq)

    out = _kept_out(state)
    members = sorted((m for m in state.workers.values() if m.worker_id in current or (admitting and m.worker_id not in out)),
                     key=key)
    if not any(m.gang for m in members):
        return tuple(members[: state.rules.max_workers])
    # A gang comes in whole or not at all: one that max_workers would cut in two stays out, and
    # the workers after it may take the room it leaves.
    chosen: list[MemberInfo] = []
    taken: set[str] = set()
    for m in members:
        if m.worker_id in taken:
            continue
        mates = [m] if not m.gang or m.worker_id in current else \
            [x for x in members if x.gang == m.gang and x.worker_id not in current]
        if len(chosen) + len(mates) <= state.rules.max_workers:
            chosen += mates
        taken.update(x.worker_id for x in mates)
    return tuple(sorted(chosen, key=key))


def _recover(state: State, now: float) -> tuple[State, list[Action]] | None:
    """Rebuilds the running view from the claims of rejoining workers, after a restart."""
    newest = max(c.view_id for c in state.claims.values())
    # Keyed by rank, then by join order: two workers claiming one rank (a stale or a false claim)
    # must not make the sort compare members.
    claimants = sorted(
        ((c.rank, state.workers[w]) for w, c in state.claims.items() if c.view_id == newest and w in state.workers),
        key=lambda claim: (claim[0], claim[1].join_seq),
    )
    # One claimant per rank (the earliest): the rest wait like newcomers, and the view stays
    # within the claimed size, so within max_workers.
    claimants = [c for i, c in enumerate(claimants) if i == 0 or c[0] != claimants[i - 1][0]]
    size = max(c.size for c in state.claims.values() if c.view_id == newest)
    ranks = [r for r, _ in claimants]
    members = tuple(m for _, m in claimants)
    if ranks == list(range(size)):
        # Everyone is back: adopt the same view, so the workers see nothing change.
        view = ViewInfo(newest, members)
        state = replace(state, view=view, claims={}, first_claim_at=INF, changed_at=now, admit=False)
        return state, [PublishView(view)]
    if now - state.first_claim_at < state.rules.heartbeat_timeout_s:
        return state, []
    # Some never came back within a heartbeat timeout: they count as failed, and the next view is
    # formed from those that did, in their old rank order (waiting newcomers still wait).
    failed = tuple(f"rank {r} of view {newest}" for r in range(size) if r not in ranks)
    if len(members) < state.rules.min_workers:
        members = ()
    view = ViewInfo(newest + 1, members, failed=failed)
    state = replace(state, view=view, claims={}, first_claim_at=INF, changed_at=now, admit=False)
    return state, [PublishView(view)]


def _maybe_publish(state: State, now: float) -> tuple[State, list[Action]]:
    if not state.dirty:
        return state, []
    if state.claims:
        recovered = _recover(state, now)
        if recovered is not None:
            return recovered
    elif not state.bump and now - state.changed_at < state.rules.settle_s and not _lost_any(state) and not _full(state):
        # Still settling, and nobody to drop: the answer is "not yet" without sorting everyone
        # (a view of 2,000 forms after as many joins).
        return state, []
    desired = _desired(state)
    current_ids = [m.worker_id for m in state.view.members]
    desired_ids = [m.worker_id for m in desired]
    if desired_ids == current_ids and desired == state.view.members:
        if state.bump:
            return _publish(state, desired)
        # An admit request that finds nobody to let in lapses: a later joiner waits for the next.
        return replace(state, admit=False, dirty=False), []
    lost = set(current_ids) - set(desired_ids)
    enough = len(desired) >= state.rules.min_workers
    if lost and not enough:
        # The world fell below its minimum: end it now, so that nobody waits on a dead ring.
        if not state.view.members:
            return replace(state, dirty=False), []
        return _publish(state, ())
    if not enough:
        return replace(state, dirty=False), []
    settled = now - state.changed_at >= state.rules.settle_s or _full(state)
    if not lost and not settled and not state.bump:
        return state, []
    return _publish(state, desired)


def _full(state: State) -> bool:
    """Whether max_workers could be admitted now: nobody else can come in, so the settling wait
    (for more joiners to come in together) has nothing to wait for, and the view forms at once,
    as torchrun's rendezvous closes once max_nodes have joined."""
    return len(state.workers) - len(_kept_out(state)) >= state.rules.max_workers


def _lost_any(state: State) -> bool:
    """Whether a member of the current view has been removed since it was published."""
    return any(w in state.view.ranks for w in state.left | state.failed)


def _publish(state: State, members: tuple[MemberInfo, ...]) -> tuple[State, list[Action]]:
    previous = {m.worker_id for m in state.view.members}
    view = ViewInfo(
        state.view.view_id + 1,
        members,
        left=tuple(sorted(state.left & previous)),
        failed=tuple(sorted(state.failed & previous)),
    )
    state = replace(state, view=view, left=frozenset(), failed=frozenset(), admit=False, bump=False)
    return state, [PublishView(view)]
