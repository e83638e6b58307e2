"""A shard's bookkeeping of versions, rounds and clocks, and the decisions it makes from them.

Pure: the shard's servicer asks the ``Ledger`` what to do with a push or whether a pull may be
answered, carries the decision out on its values (shard/store.py), and then records it. Modes:

- **sync**: rounds. Round ``t`` collects one push of step ``t`` from every member of the newest
  view the shard knows; when every member has pushed (or a new view drops those that have not),
  the shard applies the mean (or the sum) of the round's pushes, and its version becomes
  ``t + 1``. A worker computes step ``t`` on version ``t`` and pulls with ``min_version t + 1``.
  A push for a round that ended without it is STALE: its worker was dropped (declared dead) or
  joined after the round began; it pulls the newest values and pushes the next round.
- **average**: the same rounds, of deltas (local values minus the values pulled) pushed every
  few local steps: federated averaging.
- **async**: every push is applied as it arrives, and the version goes up by one. A push whose
  gradient was computed on values more than ``max_lag`` versions old is STALE (no bound when 0).
- **ssp** (stale synchronous parallel): applied as in async, but a worker's pull for its step
  ``c`` waits until every member has pushed at least ``c - staleness`` steps, so no worker runs
  more than ``staleness`` steps ahead of the slowest member. A push of a step more than
  ``staleness`` behind the fastest member's newest is STALE (it cannot come from a worker the
  gate held, only from one that was out of the view), as is one more than ``max_lag`` versions
  old (by default ``2 (staleness + 1) N`` for N members, which a gated worker never reaches).

Members are the workers of the coordinator's newest view, as the shard hears of it: a dead worker
stops counting at the next view. A member new to a view starts counting (ssp) at the slowest
continuing member's clock, so a joiner does not stop everyone until it catches up.

Pushes are idempotent per (worker, step): a step at or below the worker's last counted step is
a DUPLICATE, changes nothing and is acknowledged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.errors import InvalidArgumentError

MODES = ("sync", "async", "ssp", "average")
ROUND_MODES = ("sync", "average")
MEMBER_MODES = ("sync", "ssp", "average")

APPLY = "apply"          # apply the push now (async, ssp)
ACCEPT = "accept"        # count it in the round (sync, average)
DUPLICATE = "duplicate"  # counted before: acknowledge, change nothing
STALE = "stale"          # refuse: staler than the bound, or its round is over
WAIT = "wait"            # the worker is in a view the shard has not heard of yet: wait for it


@dataclass(frozen=True)
class Decision:
    """What to do with a push; ``skip_to`` (rounds) moves the round ahead to the push's step
    first: the shard restored an older version than the workers hold."""

    outcome: str
    detail: str = ""
    skip_to: int = -1


def check_mode(mode: str, staleness: int) -> None:
    if mode not in MODES:
        raise InvalidArgumentError(f"The parameter-server mode {mode!r} is not one of {', '.join(MODES)}.")
    if staleness < 0:
        raise InvalidArgumentError(f"The staleness bound ({staleness}) must be at least 0.")


@dataclass
class Ledger:
    """Versions, the round in progress, and each worker's last step, on one shard.

    Example:
        ```python
        ledger = Ledger("sync")
        ledger.install_view(1, frozenset({"a", "b"}))
        d = ledger.decide_push("a", step=0, base_version=0, view_id=1)   # ACCEPT
        ledger.record(d, "a", 0)
        ledger.round_complete()                                           # False: b has not pushed
        ```
    """

    mode: str
    staleness: int = 0
    max_lag: int = 0
    version: int = 0
    view_id: int = 0
    members: frozenset[str] = frozenset()
    last_step: dict[str, int] = field(default_factory=dict)
    entry: dict[str, int] = field(default_factory=dict)
    contributors: set[str] = field(default_factory=set)
    restored_version: int = 0  # the version this incarnation started from (a checkpoint, a re-seed)
    lost_skipped: int = 0
    max_seen: int = 0  # the newest version workers saw of an earlier incarnation

    def __post_init__(self) -> None:
        check_mode(self.mode, self.staleness)

    # -- ssp clocks ------------------------------------------------------------------------

    def clock(self, worker: str) -> int:
        """The next step the shard expects from ``worker`` (ssp); the steps it has pushed."""
        return max(self.last_step.get(worker, -1) + 1, self.entry.get(worker, 0))

    def note_clock(self, worker: str, next_step: int) -> bool:
        """A worker's own clock, as it tells it (ssp): the step it pushes next. A shard that came
        back from a checkpoint (or was seeded again) holds older clocks than its workers; each
        worker's pull raises its own, so that the members' pulls do not wait for the pushes the
        restart lost. Only ever raises a clock; True if it did."""
        if self.mode != "ssp" or next_step <= self.clock(worker):
            return False
        self.entry[worker] = next_step
        return True

    def min_clock(self) -> int | None:
        """The slowest member's clock; None without members."""
        return min((self.clock(w) for w in self.members), default=None)

    def top_step(self) -> int:
        """The newest step any member pushed (-1: none)."""
        return max((self.last_step.get(w, -1) for w in self.members), default=-1)

    def lag_bound(self) -> int:
        if self.max_lag or self.mode != "ssp":
            return self.max_lag
        return 2 * (self.staleness + 1) * max(1, len(self.members))

    # -- lost updates ----------------------------------------------------------------------

    @property
    def lost_updates(self) -> int:
        """Updates lost to a restart: beyond the version the shard came back with, what workers
        had seen of its earlier incarnation, or the rounds they were ahead (sync, average)."""
        return max(self.lost_skipped, self.max_seen - self.restored_version if self.max_seen else 0, 0)

    def note_seen(self, seen_version: int) -> bool:
        """Records the newest version a worker saw of this shard's earlier incarnation; True when
        it shows more updates lost than known so far."""
        before = self.lost_updates
        self.max_seen = max(self.max_seen, seen_version)
        return self.lost_updates > before

    # -- views -----------------------------------------------------------------------------

    def install_view(self, view_id: int, members: frozenset[str]) -> bool:
        """Takes a newer view's members; False for a view no newer than the one held."""
        if view_id <= self.view_id:
            return False
        continuing = members & self.members
        base = min((self.clock(w) for w in continuing), default=0)
        for worker in members - self.members:
            self.entry[worker] = max(self.entry.get(worker, 0), base)
        self.view_id, self.members = view_id, members
        return True

    # -- pushes ----------------------------------------------------------------------------

    def decide_push(self, worker: str, *, step: int, base_version: int, view_id: int) -> Decision:
        """What to do with a push of ``step`` from ``worker``, computed on ``base_version``."""
        if self.mode in MEMBER_MODES:
            if view_id == 0:
                return Decision(STALE, f"{self.mode} mode counts the members of a view, and worker {worker!r} is in none")
            if view_id > self.view_id:
                return Decision(WAIT)
            if worker not in self.members:
                return Decision(STALE, f"worker {worker!r} is not a member of view {self.view_id}, the shard's newest")
        if step <= self.last_step.get(worker, -1):
            return Decision(DUPLICATE)
        if self.mode in ROUND_MODES:
            return self._decide_round(worker, step)
        lag = self.version - base_version if base_version <= self.version else 0
        bound = self.lag_bound()
        if bound and lag > bound:
            return Decision(STALE, f"computed on version {base_version}, {lag} versions behind {self.version}, "
                                   f"past the bound of {bound}")
        if self.mode == "ssp":
            top = self.top_step()
            if step < top - self.staleness:
                return Decision(STALE, f"step {step} is more than {self.staleness} steps behind the fastest "
                                       f"member's step {top}")
        return Decision(APPLY)

    def _decide_round(self, worker: str, step: int) -> Decision:
        if step < self.version:
            return Decision(STALE, f"round {step} ended without this push; the shard is at round {self.version}")
        if step > self.version:
            if self.contributors:
                return Decision(STALE, f"round {step} is ahead of round {self.version}, which is in progress")
            return Decision(ACCEPT, skip_to=step)
        return Decision(ACCEPT)

    def record(self, decision: Decision, worker: str, step: int) -> None:
        """Records a push the shard carried out (APPLY: applied; ACCEPT: added to the round)."""
        if decision.outcome == APPLY:
            self.version += 1
        elif decision.outcome == ACCEPT:
            if decision.skip_to >= 0:
                self.lost_skipped += decision.skip_to - self.version
                self.version = decision.skip_to
            self.contributors.add(worker)
        else:
            return
        self.last_step[worker] = step

    def round_complete(self) -> bool:
        """Whether the round in progress has every member's push (some push, and no member missing)."""
        return self.mode in ROUND_MODES and bool(self.contributors) and self.members <= self.contributors

    def finish_round(self) -> None:
        self.version += 1
        self.contributors = set()

    def missing(self) -> list[str]:
        """Members that have not pushed to the round in progress (sync, average)."""
        return sorted(self.members - self.contributors)

    # -- pulls -----------------------------------------------------------------------------

    def pull_ready(self, *, min_version: int, clock: int) -> bool:
        """Whether a pull may be answered now: the version reached min_version, and (ssp) every
        member's clock is within the staleness bound of ``clock``."""
        if self.version < min_version:
            return False
        if self.mode == "ssp" and clock:
            slowest = self.min_clock()
            return slowest is None or slowest >= clock - self.staleness
        return True

    def start_clock(self, worker: str) -> int:
        """The step a worker should push next here (ssp): its clock, raised to the slowest
        member's clock so that a worker back from outside the view is not stale."""
        slowest = self.min_clock()
        return max(self.clock(worker), slowest if slowest is not None else 0)
