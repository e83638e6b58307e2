"""The membership state machine: ``step(state, event, now) -> (state, actions)``.

Pure and clock-injected: the coordinator service feeds it events and carries out the actions it
returns (publishing a view, probing a suspect). Views are numbered; a view lists its members in
rank order. Members of the current view keep their relative order (rank 0 is the longest-lived
member), and newcomers follow in join order, or in the order of their rank hints for the first view.

Rules, in order of precedence:

- **Failure**: a worker silent for ``heartbeat_timeout_s``, or a suspect whose probe failed, is
  removed, and a view without it is published; a worker is never declared dead for silence
  shorter than the full timeout. Silence is checked on ``Tick``. With a grace
  (``silence_grace_s``), a worker silent for the timeout is first probed: silence cannot tell a
  process that is gone from one that is stopped or starved of CPU (a GC pause, a noisy
  neighbour), but a probe can. A process that is gone refuses the probe at once and is removed
  then; one that heartbeats again within the grace stays; one that does not is removed when the
  grace is up. Only a heartbeat keeps a worker: one that answers the probe but cannot reach the
  coordinator (its route cut) is still removed, so that its peers go on without it. So a stall
  of up to about ``heartbeat_timeout_s + silence_grace_s`` less an interval is never taken for
  a death. Workers that died together (a host, a rack) sent their last heartbeats over an
  interval, and would expire over as many ticks, each a view that every rank must install. So
  when some have expired while others are nearly silent (for more than ``heartbeat_timeout_s -
  failure_window_s``), the probe (or, without a grace, the view) waits, at most
  ``failure_window_s``, until each of those has either spoken again or expired too. And deaths
  found apart (a peer's report, a refused probe, a grace run out) are gathered by a **sweep**
  (``sweep_s``, see _settle_deaths): the first death found probes every worker silent for more
  than an interval at once, and every death found within ``sweep_s`` leaves in the same view. A death is
  published within ``heartbeat_timeout_s`` (a process gone; sooner if a peer reports it) or
  ``heartbeat_timeout_s + silence_grace_s`` (a host gone, a wedged worker) of its last
  heartbeat, plus ``sweep_s`` and a tick.
- **Rendezvous**: the first view forms once ``min_workers`` have joined and membership has been
  stable for ``settle_s``.
- **Admission**: once a world runs, newcomers wait until a member asks for them to be admitted (an
  elastic job does so at a commit, after all ranks agreed to), so that nobody's training step is
  cut in half by a joiner. That request always yields a new view at once, with the waiting workers
  or, if they are gone by then, with the same members: every rank already waits for a newer view.
  The request also names the members that leave at that commit; they go in that same view, as
  graceful leaves (one view for the commit's whole change). An empty world admits at once.
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

from dataclasses import dataclass, field, replace
from functools import cached_property

from ringserve.coordinator import pacing
from ringserve.coordinator import ringcheck as links
from ringserve.coordinator.ringcheck import RingCheck

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

    # Derived tables are computed once per view, on first use (cached_property writes the
    # instance dict directly, which a frozen dataclass allows): a view of 2,000 members is asked
    # for ranks by every request that names a worker.
    @cached_property
    def ranks(self) -> dict[str, int]:
        """Each member's rank, by worker id."""
        return {m.worker_id: rank for rank, m in enumerate(self.members)}

    @cached_property
    def placements(self) -> tuple[tuple[int, int, int, int], ...]:
        """``local(rank)`` of every member, computed in one pass over the members."""
        hosts: dict[str, int] = {}
        per_host: dict[str, int] = {}
        local_ranks = []
        for m in self.members:
            hosts.setdefault(m.hostname, len(hosts))
            local_ranks.append(per_host.get(m.hostname, 0))
            per_host[m.hostname] = local_ranks[-1] + 1
        return tuple(
            (local_rank, per_host[m.hostname], hosts[m.hostname], len(hosts))
            for local_rank, m in zip(local_ranks, self.members, strict=True)
        )

    def rank_of(self, worker_id: str) -> int | None:
        return self.ranks.get(worker_id)

    def local(self, rank: int) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size) of the member at ``rank``: its index
        among the members on its host, their number, its host's index among the hosts in order of
        first appearance, and the number of hosts."""
        return self.placements[rank]


@dataclass(frozen=True)
class Rules:
    min_workers: int
    max_workers: int
    settle_s: float
    heartbeat_timeout_s: float
    # How long the view without expired workers may wait for those nearly expired (silent for
    # more than heartbeat_timeout_s - failure_window_s) to speak or expire too (0: never waits).
    failure_window_s: float = 0.0
    # The interval workers are told to heartbeat at, stretched as the world grows so that they
    # send at most max_heartbeats_per_s in all (0: never stretched; see ringserve.coordinator.pacing).
    heartbeat_interval_s: float = 1.0
    max_heartbeats_per_s: float = 0.0
    # Ticks further apart than this mean the coordinator itself did not run (stopped, starved, or
    # the process that holds it paused): the silence of that gap is not the workers', and is not
    # counted against them (INF: never; the service sets it from its tick).
    stall_s: float = INF
    # How long a worker silent for the timeout has to answer a probe or heartbeat again before it
    # is removed (0: removed at once, unprobed). See the module docstring.
    silence_grace_s: float = 0.0
    # Once a death is found, how long the view without it waits for the sweep's probes of the
    # workers that may have died with it (0: no sweep, the death is published at once; see
    # _settle_deaths).
    sweep_s: float = 0.0


@dataclass(frozen=True)
class Claim:
    """What a rejoining worker says it runs in: a view, its rank there, and that view's size."""

    view_id: int
    rank: int
    size: int


@dataclass(frozen=True, slots=True)
class _Beat:
    """A heartbeat not yet folded into ``State.last_seen``. The beats since the last tick form a
    linked list, newest first, so that recording one allocates one cell, whatever the number of
    workers; a tick folds them into a new ``last_seen`` in one pass."""

    worker_id: str
    at: float
    previous: _Beat | None


@dataclass(frozen=True)
class State:
    rules: Rules
    workers: dict[str, MemberInfo] = field(default_factory=dict)
    # When each worker was last heard from, as of the last tick; ``seen`` adds the newer beats.
    last_seen: dict[str, float] = field(default_factory=dict)
    beats: _Beat | None = None
    view: ViewInfo = ViewInfo(0, ())
    changed_at: float = -INF
    join_seq: int = 0
    # Workers removed since the last published view, by how they went.
    left: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
    # A member of the running view asked for waiting workers to be admitted, and for a new view.
    admit: bool = False
    bump: bool = False
    suspects: frozenset[str] = frozenset()
    claims: dict[str, Claim] = field(default_factory=dict)
    first_claim_at: float = INF
    # Partial partitions (ringserve.coordinator.ringcheck): the ring check under way, when each cut-off worker may
    # be admitted again, how often each was cut off, and when the recent bumps were.
    check: RingCheck | None = None
    held: dict[str, float] = field(default_factory=dict)
    cuts: dict[str, int] = field(default_factory=dict)
    bumps: tuple[float, ...] = ()
    # When workers were first found expired while others were nearly so (see _expire).
    expiring_since: float = INF
    # The last Tick's time (see _forgive_stall).
    ticked_at: float = -INF
    # Workers silent for the timeout whose probe is under way (rules.silence_grace_s), by when it
    # began; the sweep's probes under way (rules.sweep_s), by when they began; the workers found
    # dead and not yet removed, each with how; and when the first of those was found (INF: none).
    silent_probes: dict[str, float] = field(default_factory=dict)
    sweep: dict[str, float] = field(default_factory=dict)
    found_dead: dict[str, str] = field(default_factory=dict)
    dead_since: float = INF
    # Whether the next view may differ from the current one: set by every change of membership,
    # cleared once a look finds nothing to publish, now or later, so that a quiet tick does not
    # sort every worker again.
    dirty: bool = True


@dataclass(frozen=True)
class Join:
    worker_id: str
    address: str
    hostname: str
    rank_hint: int = -1
    claim: Claim | None = None


@dataclass(frozen=True)
class Leave:
    worker_id: str


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str


@dataclass(frozen=True)
class Suspect:
    """A worker reported a peer as failed on the data plane."""

    worker_id: str


@dataclass(frozen=True)
class ProbeResult:
    """A probe's answer. ``since``: for the probe of a silent worker or the sweep's, when that
    probe began (``Probe.began``), so that the answer to a probe no longer waited for (the worker
    spoke again, a stall of the coordinator forgave its silence, the sweep ended) is known as
    stale and ignored, never taken for a peer's report (None: the probe of a worker a peer
    reported). ``timed_out``: no answer came within the probe's deadline, which for those two
    kinds proves nothing (a stopped process). ``refused``: nothing listens at the worker's
    address, which proves its process gone (a failed name lookup, a TLS error or a proxy's
    answer do not: a sweep's probe counts only a refusal)."""

    worker_id: str
    alive: bool
    since: float | None = None
    timed_out: bool = False
    refused: bool = False


@dataclass(frozen=True)
class Linked:
    """A member's heartbeat says its ring predecessor's stream reached it in view ``view_id``."""

    worker_id: str
    view_id: int


@dataclass(frozen=True)
class Admit:
    """A member of the running view asks for the waiting workers to be admitted, and for the
    members in ``leaving`` (they leave at this commit) to go in the same view."""

    requester_id: str
    view_id: int = 0
    leaving: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tick:
    pass


Event = Join | Leave | Heartbeat | Suspect | ProbeResult | Linked | Admit | Tick


@dataclass(frozen=True)
class PublishView:
    view: ViewInfo


@dataclass(frozen=True)
class Removed:
    worker_id: str
    reason: str


@dataclass(frozen=True)
class Probe:
    """Check at once whether a suspect still answers; report back with ``result(...)``.
    ``silent``: the worker was silent for the timeout (rather than reported by a peer); ``sweep``:
    a death was found, and this worker may have died with it. Either probe began at ``began``
    and waits at most ``timeout_s`` (the grace, the sweep's hold)."""

    worker_id: str
    address: str
    silent: bool = False
    timeout_s: float = 0.0
    began: float = 0.0
    sweep: bool = False

    def result(self, alive: bool, *, timed_out: bool = False, refused: bool = False) -> ProbeResult:
        """The event that reports this probe's answer."""
        since = self.began if self.silent or self.sweep else None
        return ProbeResult(self.worker_id, alive, since, timed_out=timed_out and not alive, refused=refused and not alive)


Action = PublishView | Removed | Probe


def _with_beat(state: State, beats: _Beat) -> State:
    """``replace(state, beats=beats)``, for the one event that comes thousands of times a second:
    ``replace`` runs ``__init__`` over every field (about 20 us a heartbeat, half the handler's
    time at 2,000 workers); a copy of the instance's dict is a fifth of that. The new state is
    changed only before anyone sees it, so it is as immutable as ``replace``'s."""
    new = object.__new__(State)
    fields = new.__dict__
    fields.update(state.__dict__)
    fields["beats"] = beats
    return new


def step(state: State, event: Event, now: float) -> tuple[State, list[Action]]:
    """Applies one event at time ``now`` and returns the new state and the actions to carry out.

    A heartbeat costs the same whatever the number of workers: it is recorded, and nothing else
    is looked at. Deadlines (silence, settling, recovery) are checked on ``Tick``.
    """
    actions: list[Action] = []
    if isinstance(event, Heartbeat):
        if event.worker_id not in state.workers:
            return state, []
        return _with_beat(state, _Beat(event.worker_id, now, state.beats)), []
    if isinstance(event, Join):
        state = _join(state, event, now)
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
        state = _silent_answered(state, event)
    elif isinstance(event, ProbeResult):
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
                state = _remove_all(state, leaving, now, failed=False)
                actions.extend(Removed(w, "left") for w in leaving)
            state = replace(state, admit=True, bump=True, dirty=True)
    elif isinstance(event, Tick):
        state = replace(_forgive_stall(state, now), ticked_at=now)
        state, removed = _expire(state, now)
        actions.extend(removed)
        if state.silent_probes or state.found_dead:
            state, settled = _settle_deaths(state, now)
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


def seen(state: State) -> dict[str, float]:
    """When each worker was last heard from, heartbeats since the last tick included."""
    if state.beats is None:
        return state.last_seen
    last_seen = dict(state.last_seen)
    beat: _Beat | None = state.beats
    while beat is not None:
        # Newest first: a worker's first beat in the list is its latest; a beat of a worker
        # removed since does not bring it back.
        if beat.at > last_seen.get(beat.worker_id, INF):
            last_seen[beat.worker_id] = beat.at
        beat = beat.previous
    return last_seen


def heartbeat_interval(state: State) -> float:
    """The interval the workers are told to heartbeat at now (see ringserve.coordinator.pacing)."""
    rules = state.rules
    return pacing.heartbeat_interval(
        rules.heartbeat_interval_s, rules.heartbeat_timeout_s, rules.max_heartbeats_per_s, len(state.workers)
    )


def _failure_window(state: State) -> float:
    """failure_window_s, or longer when the interval is stretched: a stretched interval spreads
    the last heartbeats of workers that died together over more time."""
    rules = state.rules
    if rules.max_heartbeats_per_s <= 0:
        return rules.failure_window_s
    return max(rules.failure_window_s, pacing.failure_window(heartbeat_interval(state), rules.heartbeat_timeout_s))


def _forgive_stall(state: State, now: float) -> State:
    """After a gap between ticks longer than ``stall_s``, the coordinator did not run, and heard
    nothing, through no worker's fault: every worker's silence is moved on by the gap, so that
    only silence while the coordinator listened counts. Without it, a coordinator stalled past the
    heartbeat timeout (its process stopped, or starved on a loaded machine) declared every worker
    dead the moment it ran again, and formed a view of none (issue 40)."""
    gap = now - state.ticked_at
    if state.ticked_at == -INF or gap <= state.rules.stall_s:
        return state
    last_seen = {wid: min(now, at + gap) for wid, at in seen(state).items()}
    # Probes that ended while the coordinator did not run (their deadlines passed in its stall)
    # say nothing either: the silence they were about is forgiven, and judged again from here.
    return replace(state, last_seen=last_seen, beats=None, silent_probes={}, sweep={}, found_dead={}, dead_since=INF)


def _expire(state: State, now: float) -> tuple[State, list[Action]]:
    """Folds the heartbeats in, and removes the workers silent past the timeout, all in one view,
    once none is left nearly silent (or failure_window_s has passed since some expired)."""
    last_seen = seen(state)
    if state.beats is not None:
        state = replace(state, last_seen=last_seen, beats=None)
    deadline = state.rules.heartbeat_timeout_s
    probing = state.silent_probes
    if not any(now - at > deadline and wid not in probing for wid, at in last_seen.items()):
        if state.expiring_since != INF:
            # The expired spoke again (a slow worker, not a dead one): the wait is over, and a
            # later failure gets a window of its own.
            state = replace(state, expiring_since=INF)
        return state, []
    expiring_since = min(state.expiring_since, now)
    window = _failure_window(state)
    if now - expiring_since < window:
        nearly = deadline - window
        if any(nearly < now - at <= deadline for at in last_seen.values()):
            return replace(state, expiring_since=expiring_since), []
    silent = [wid for wid, at in last_seen.items() if now - at > deadline and wid not in probing]
    grace = state.rules.silence_grace_s
    if grace > 0:
        # Probed first (see the module docstring); _settle_probes removes those found gone.
        probes = {**probing, **dict.fromkeys(silent, now)}
        state = replace(state, silent_probes=probes, expiring_since=INF)
        return state, [Probe(wid, state.workers[wid].address, silent=True, timeout_s=grace, began=now)
                       for wid in silent]
    state = replace(_remove_all(state, silent, now, failed=True), expiring_since=INF)
    return state, [Removed(wid, f"silent for more than {deadline:g} s") for wid in silent]


def _silent_answered(state: State, event: ProbeResult) -> State:
    """The probe of a silent worker, or the sweep's, ended. A refusal finds the worker dead (it
    waits in ``found_dead`` for _settle_deaths, which removes the dead together). An answer, or
    none within the deadline, decides nothing: only a heartbeat keeps a silent worker (an answer
    proves the process runs, not that the coordinator hears it), and the grace, counted on the
    coordinator's own clock, ends it. The answer to a probe no longer waited for is stale, and
    says nothing: at 256 workers on 2 loaded cores, such answers (a deadline that passed while
    the coordinator was stopped, after its stall had forgiven the silence) fell through to the
    peer-report path and removed live workers, or re-formed the ring for nothing."""
    w, since = event.worker_id, event.since
    if state.silent_probes.get(w) == since:
        if event.alive or event.timed_out:
            return state
        return replace(state, found_dead={**state.found_dead, w: SILENT_REFUSED if event.refused else SILENT_FAILED})
    if state.sweep.get(w) == since:
        # The swept worker may well heartbeat: only a refusal outweighs that.
        sweep = {k: v for k, v in state.sweep.items() if k != w}
        if not event.refused or w not in state.workers:
            return replace(state, sweep=sweep)
        return replace(state, sweep=sweep, found_dead={**state.found_dead, w: SWEPT})
    return state


# How each death was found, as the Removed reason says it.
PEER_DEAD = "reported by a peer and did not answer a probe"
SILENT_REFUSED = "refused a probe (its process is gone)"
SILENT_FAILED = "failed a probe at once (its address did not resolve, or did not speak gRPC health)"
SWEPT = "refused the probe of the sweep that follows a death (its process is gone)"


def _settle_deaths(state: State, now: float) -> tuple[State, list[Action]]:
    """Ends the probes of silent workers that spoke again since theirs began, and removes the
    dead, all in one view. Called on Tick, with the heartbeats folded into last_seen.

    Dead: refused a probe (as silent, in a sweep, or reported by a peer), or silent through the
    grace. Deaths come together (a host, a rack, a job's kill) but are found apart: a peer
    reports one at once, another's silence expires seconds later, one at a time, and each
    removal would be a view that every rank must install. So the first death found opens a
    **sweep**: every worker silent for more than an interval is probed at once (a process that is gone refuses in milliseconds), and the view
    waits, at most ``sweep_s``, for those probes and the silent workers' still under way. All
    found dead by then leave together. Only a refusal finds a swept worker dead: an answer, none
    in time (a stopped worker, judged by its own silence later) or another failure (a name not
    resolved, which says nothing about a worker that heartbeats) decide nothing, and a swept
    worker that heartbeats before the view is published stays. So a death
    costs at most ``sweep_s`` more than its finding: within ``heartbeat_timeout_s +
    silence_grace_s + sweep_s`` and a tick of the last heartbeat (plus up to the failure window
    while others are nearly silent, see _expire), or a probe's deadline plus ``sweep_s`` of a
    peer's report."""
    rules = state.rules
    pending = {w: began for w, began in state.silent_probes.items()
               if w in state.workers and state.last_seen.get(w, -INF) <= began}
    grace = rules.silence_grace_s
    dead = {w: why for w, why in state.found_dead.items() if w in state.workers}
    for w, began in pending.items():
        if w not in dead and now - began >= grace:
            dead[w] = f"silent through its grace ({grace:g} s)"
    if len(pending) != len(state.silent_probes) or len(dead) != len(state.found_dead):
        state = replace(state, silent_probes=pending, found_dead=dead)
    if not dead:
        return replace(state, sweep={}, dead_since=INF) if state.dead_since != INF else state, []
    actions: list[Action] = []
    if state.dead_since == INF:
        state = replace(state, dead_since=now)
        if rules.sweep_s > 0:
            state, actions = _open_sweep(state, dead, now)
    undecided = (state.sweep.keys() | pending.keys()) - dead.keys()
    if undecided and now - state.dead_since < rules.sweep_s:
        return state, actions
    # A swept worker heard from since the sweep began lives, whatever its address said (one
    # advertised wrong, a stand-in's in a test): a heartbeat outweighs a refusal.
    dead = {w: why for w, why in dead.items() if why != SWEPT or state.last_seen.get(w, -INF) < state.dead_since}
    deadline = rules.heartbeat_timeout_s
    removed = [Removed(w, f"silent {now - state.last_seen[w]:.1f} s, past the timeout ({deadline:g} s), then {why}"
                       if w in pending else why) for w, why in dead.items()]
    state = _remove_all(state, list(dead), now, failed=True)
    return replace(state, sweep={}, found_dead={}, dead_since=INF), actions + removed


def _open_sweep(state: State, dead: dict[str, str], now: float) -> tuple[State, list[Action]]:
    """Probes, at once, the workers that may have died with ``dead``: those silent for more than
    a heartbeat interval (see _settle_deaths). Not every worker on a host of theirs: one heard
    within the interval is not suspect, and workers killed together that are not silent yet are
    reported by their peers within the sweep's hold (3 of 6 real workers: within 0.04 s)."""
    quiet = now - heartbeat_interval(state)
    targets = [m for w, m in state.workers.items()
               if w not in dead and w not in state.silent_probes and state.last_seen.get(w, now) < quiet]
    state = replace(state, sweep={m.worker_id: now for m in targets})
    return state, [Probe(m.worker_id, m.address, timeout_s=state.rules.sweep_s, began=now, sweep=True)
                   for m in targets]


def is_known(state: State, worker_id: str) -> bool:
    return worker_id in state.workers


def waiting(state: State) -> int:
    """Workers that joined but are not in the current view."""
    in_view = state.view.ranks
    return len([w for w in state.workers if w not in in_view])


def admissible(state: State) -> int:
    """Waiting workers that the next view would take, within max_workers (none still held out)."""
    room = state.rules.max_workers - len(state.view.members)
    return max(0, min(waiting(state) - len(state.held.keys() & state.workers.keys()), room))


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
    )
    claims = state.claims
    first_claim_at = state.first_claim_at
    if event.claim is not None and event.claim.view_id > state.view.view_id:
        claims = {**claims, event.worker_id: event.claim}
        first_claim_at = min(first_claim_at, now)
    changed = old != info
    return replace(
        state,
        workers={**state.workers, event.worker_id: info},
        last_seen={**state.last_seen, event.worker_id: now},
        changed_at=now if changed else state.changed_at,
        join_seq=state.join_seq + (0 if old else 1),
        claims=claims,
        first_claim_at=first_claim_at,
        dirty=True,
    )


def _remove(state: State, worker_id: str, now: float, *, failed: bool) -> State:
    return _remove_all(state, [worker_id], now, failed=failed)


def _remove_all(state: State, worker_ids: list[str], now: float, *, failed: bool) -> State:
    """Removes several workers with one copy of each table, however many they are."""
    gone = frozenset(worker_ids)
    workers = {k: v for k, v in state.workers.items() if k not in gone}
    last_seen = {k: v for k, v in state.last_seen.items() if k not in gone}
    claims = {k: v for k, v in state.claims.items() if k not in gone} if state.claims else state.claims
    probes = {k: v for k, v in state.silent_probes.items() if k not in gone} if state.silent_probes else state.silent_probes
    found = {k: v for k, v in state.found_dead.items() if k not in gone} if state.found_dead else state.found_dead
    return replace(
        state,
        workers=workers,
        last_seen=last_seen,
        claims=claims,
        silent_probes=probes,
        found_dead=found,
        changed_at=now,
        suspects=state.suspects - gone,
        left=state.left if failed else state.left | gone,
        failed=state.failed | gone if failed else state.failed,
        dirty=True,
    )


def _desired(state: State) -> tuple[MemberInfo, ...]:
    current = {m.worker_id: r for r, m in enumerate(state.view.members)}
    admitting = state.admit or not state.view.members

    def key(m: MemberInfo) -> tuple[float, float, int]:
        if m.worker_id in current:
            return (0, current[m.worker_id], 0)
        hint = m.rank_hint if m.rank_hint >= 0 and not state.view.members else INF
        return (1, hint, m.join_seq)

    members = [
        m for m in state.workers.values()
        if m.worker_id in current or (admitting and m.worker_id not in state.held)
    ]
    return tuple(sorted(members, key=key)[: state.rules.max_workers])


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
    return len(state.workers) - len(state.held.keys() & state.workers.keys()) >= state.rules.max_workers


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
