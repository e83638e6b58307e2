"""What the coordinator's Status says beyond the view: the world's history, each member's commit,
and the stall inspector's current warnings (the status page reads them, see http.py).

The service feeds the board what it already handles: every step of the membership state machine
(the state before and after, and the actions), every heartbeat, and the job's commit mark. The
board only records; it decides nothing and does no I/O, so a coordinator without a status page pays
a few attribute reads per event. History is bounded (``HISTORY`` events, the newest kept), and a
member's record goes with the member.

What each kind of event means:

- ``view``: a view formed (its size, and who joined, left or failed since the last one);
- ``joined``, ``left``, ``failed``: a worker entered a view, left gracefully, or was removed as dead
  (silent past the heartbeat timeout, or reported by a peer and silent to the probe);
- ``partition``: a peer reported a member that still answers the coordinator, so a link is down,
  not a worker: the ring is re-formed and checked (see ringcheck.py);
- ``healed``: every link of the checked view came up;
- ``cut``: a member stayed cut off from its ring and was dropped;
- ``resumed``: the job's commit lineage went up: the world lost every holder of its newest commit
  and resumed from a durable copy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ringserve import commits
from ringserve._proto import coordinator_pb2 as pb
from ringserve.coordinator import membership

HISTORY = 200
# A removal's reason starts with this when the ring check dropped the worker (membership._check_ring).
CUT_REASON = "cut off"


@dataclass(frozen=True)
class Event:
    at_s: float
    kind: str
    view_id: int
    text: str


def _short(worker_id: str) -> str:
    """A worker id as the page shows it: its first characters (ids are random hex; addresses follow)."""
    return worker_id[:8]


def _names(workers: Iterable[membership.MemberInfo]) -> str:
    return ", ".join(f"{_short(m.worker_id)} ({m.address})" for m in workers)


class Board:
    """The status page's record of the world; see the module docstring.

    Example:
        ```python
        board = Board(started=clock())
        state, actions = membership.step(before, event, now)
        board.applied(before, event, state, actions, now)
        ```
    """

    def __init__(self, started: float) -> None:
        self._started = started
        self.history: deque[Event] = deque(maxlen=HISTORY)
        self._commits: dict[str, commits.Commit] = {}
        self._lineage: int | None = None

    def _add(self, now: float, kind: str, view_id: int, text: str) -> None:
        self.history.append(Event(max(0.0, now - self._started), kind, view_id, text))

    def applied(self, before: membership.State, event: membership.Event, after: membership.State,
                actions: Sequence[membership.Action], now: float) -> None:
        """Records what one step of the state machine (``event`` took ``before`` to ``after``) did."""
        if not actions and isinstance(event, membership.Heartbeat):
            return  # the one event that comes thousands of times a second, and changes nothing here
        view_id = after.view.view_id
        removed = [a for a in actions if isinstance(a, membership.Removed)]
        for gone in removed:
            member = before.workers.get(gone.worker_id)
            who = f"{_short(gone.worker_id)} ({member.address})" if member is not None else _short(gone.worker_id)
            self._commits.pop(gone.worker_id, None)
            if gone.reason == "left":
                self._add(now, "left", view_id, f"worker {who} left")
            elif gone.reason.startswith(CUT_REASON):
                self._add(now, "cut", view_id, f"worker {who} was dropped: {gone.reason}")
            else:
                self._add(now, "failed", view_id, f"worker {who} failed: {gone.reason}")
        if isinstance(event, membership.ProbeResult) and event.alive and before.check is None \
                and after.check is not None and not removed:
            member = after.workers.get(event.worker_id)
            where = f" ({member.address})" if member is not None else ""
            self._add(now, "partition", view_id,
                      f"a peer reported worker {_short(event.worker_id)}{where}, which answers the coordinator: a link "
                      f"is down; the ring is re-formed and checked")
        if isinstance(event, membership.Linked) and before.check is not None and after.check is None:
            self._add(now, "healed", view_id, f"every link of view {view_id} is up: the partition healed")
        for action in actions:
            if isinstance(action, membership.PublishView):
                self._view(before.view, action.view, now)

    def _view(self, old: membership.ViewInfo, new: membership.ViewInfo, now: float) -> None:
        joined = [m for m in new.members if old.rank_of(m.worker_id) is None]
        parts = [f"view {new.view_id} formed with {len(new.members)} workers"]
        if joined and old.members:
            parts.append(f"{len(joined)} joined")
        if new.left:
            parts.append(f"{len(new.left)} left")
        if new.failed:
            parts.append(f"{len(new.failed)} failed")
        self._add(now, "view", new.view_id, ", ".join(parts))
        if joined:
            self._add(now, "joined", new.view_id, f"joined in view {new.view_id}: {_names(joined)}")

    def beat(self, worker_id: str, request: pb.HeartbeatRequest, mark: commits.Mark, now: float) -> None:
        """Records a heartbeat's commit, and a resume when the job's lineage went up."""
        if request.HasField("committed_step"):
            self._commits[worker_id] = commits.Commit(request.committed_lineage, request.committed_step)
        if mark.commit is None:
            return
        lineage = mark.commit.lineage
        if self._lineage is not None and lineage > self._lineage:
            self._add(now, "resumed", request.view_id,
                      f"the job resumed at {mark.commit} from a durable copy, after losing its newest commit")
        self._lineage = lineage

    def fill(self, answer: pb.StatusResponse, mark: commits.Mark, stall_warnings: list[str]) -> None:
        """Adds the board's fields to a Status answer whose members are already listed."""
        answer.history.extend(
            pb.HistoryEvent(at_s=e.at_s, kind=e.kind, view_id=e.view_id, text=e.text) for e in self.history
        )
        if mark.commit is not None:
            answer.mark_step, answer.mark_lineage = mark.commit.step, mark.commit.lineage
        answer.stall_warnings.extend(stall_warnings)
        for member in answer.members:
            held = self._commits.get(member.member.worker_id)
            if held is not None:
                member.committed_step, member.committed_lineage = held.step, held.lineage
