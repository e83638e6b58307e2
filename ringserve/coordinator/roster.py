"""The membership state machine's data: its rules and state, the events it takes and the actions it returns.

Pure data, with the few operations on the state's tables that both membership.py and silence.py
make: recording a heartbeat, reading when each worker was last heard from, and removing workers.
Kept apart so that silence.py (the silence-and-death rules) and membership.py (``step`` and the
other rules) share them without importing each other; membership.py re-exports every name, and
callers keep to ``membership.State``, ``membership.Probe`` and so on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from ringserve.coordinator.ringcheck import RingCheck

INF = float("inf")


@dataclass(frozen=True)
class MemberInfo:
    worker_id: str
    address: str
    hostname: str
    rank_hint: int
    join_seq: int
    gang: str = ""  # admitted only with gang_size workers of the same gang (see membership._kept_out)
    gang_size: int = 0


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
    # is removed (0: removed at once, unprobed). See ringserve.coordinator.silence.
    silence_grace_s: float = 0.0
    # Once a death is found, how long the view without it waits for the sweep's probes of the
    # workers that may have died with it (0: no sweep, the death is published at once; see
    # silence.settle_deaths).
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
    # When workers were first found expired while others were nearly so (see silence.expire).
    expiring_since: float = INF
    # The last Tick's time (see silence.forgive_stall).
    ticked_at: float = -INF
    # Workers silent for the timeout whose probe is under way (rules.silence_grace_s), by when it
    # began; the sweep's probes under way (rules.sweep_s), by when they began; the workers found
    # dead and not yet removed, each with how; and when the first of those was found (INF: none).
    silent_probes: dict[str, float] = field(default_factory=dict)
    sweep: dict[str, float] = field(default_factory=dict)
    found_dead: dict[str, str] = field(default_factory=dict)
    dead_since: float = INF
    # Joiners of a running world that prepare before they are admitted (imports, model, optimizer,
    # data): neither counted as waiting nor taken into a view until they say they are ready.
    preparing: frozenset[str] = frozenset()
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
    prepare: bool = False  # admitted to a running world only once Ready
    gang: str = ""
    gang_size: int = 0


@dataclass(frozen=True)
class Ready:
    """A joiner that prepared (``Join.prepare``) is ready to be admitted."""

    worker_id: str


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


Event = Join | Leave | Heartbeat | Ready | Suspect | ProbeResult | Linked | Admit | Tick


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


def with_beat(state: State, worker_id: str, now: float) -> State:
    """``replace(state, beats=...)`` with the heartbeat of ``worker_id`` at ``now`` added, for the
    one event that comes thousands of times a second: ``replace`` runs ``__init__`` over every
    field (about 20 us a heartbeat, half the handler's time at 2,000 workers); a copy of the
    instance's dict is a fifth of that. The new state is changed only before anyone sees it, so it
    is as immutable as ``replace``'s."""
    new = object.__new__(State)
    fields = new.__dict__
    fields.update(state.__dict__)
    fields["beats"] = _Beat(worker_id, now, state.beats)
    return new


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


def remove_all(state: State, worker_ids: list[str], now: float, *, failed: bool) -> State:
    """Removes several workers with one copy of each table, however many they are; and with each
    worker of a gang, the rest of its gang (a replica group that lost a rank cannot train: its
    other ranks, alive or not, leave the view with it, and come back only as a whole gang)."""
    gone = frozenset(worker_ids)
    gangs = {state.workers[w].gang for w in gone if w in state.workers and state.workers[w].gang}
    if gangs:
        gone |= {w for w, m in state.workers.items() if m.gang in gangs}
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
        preparing=state.preparing - gone if state.preparing else state.preparing,
        left=state.left if failed else state.left | gone,
        failed=state.failed | gone if failed else state.failed,
        dirty=True,
    )
