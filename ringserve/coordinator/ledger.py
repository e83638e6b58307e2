"""The job's committed high-water mark, as the coordinator learns it from heartbeats.

Each heartbeat may say which commit its worker's elastic state holds, and in which view that
commit was made (every member of that view entered the commit-time allreduce after saving, so all
of them hold it; see worker/control/reports.py). The ledger folds those reports into the mark
(``commits.record`` and ``commits.record_view``, pure) and keeps the last few views, to name a
holder's rank in the view it reported from: its report can trail the view that admits the next
members. No sockets, no loop: the servicer hands it what a heartbeat says.
"""

from __future__ import annotations

from ringserve import commits
from ringserve.coordinator.membership import ViewInfo

__all__ = ["RECENT_VIEWS", "CommitLedger"]

RECENT_VIEWS = 8  # views kept to name a holder's rank: a report trails the newest view by a few at most


class CommitLedger:
    """The mark, and the recent views its holders are named in."""

    def __init__(self) -> None:
        self.mark = commits.Mark()
        self._recent_views: dict[int, ViewInfo] = {}
        self._made: tuple[commits.Commit, int] | None = None  # the (commit, view) last named whole

    def view_published(self, view: ViewInfo) -> None:
        """Remembers a new view (the oldest beyond RECENT_VIEWS is forgotten)."""
        self._recent_views[view.view_id] = view
        for old in sorted(self._recent_views)[:-RECENT_VIEWS]:
            del self._recent_views[old]

    def record(self, *, worker_id: str, address: str, view_id: int, held: commits.Commit,
               made_in: int) -> tuple[commits.Commit | None, commits.Commit | None]:
        """Folds in that ``worker_id`` (reporting from view ``view_id``) holds ``held``, made in
        view ``made_in`` (0: not said). Returns the mark's commit before and after."""
        view = self._recent_views.get(view_id)
        rank = view.rank_of(worker_id) if view is not None else None
        holder = commits.Holder(worker_id=worker_id, address=address, view_id=view_id, rank=-1 if rank is None else rank)
        before = self.mark.commit
        made = self._recent_views.get(made_in) if made_in else None
        if made is not None and made.rank_of(worker_id) is not None and (held, made.view_id) != self._made:
            # Every member of the view the commit was made in holds it, named once per (commit,
            # view): the other members' own reports then change nothing.
            self._made = (held, made.view_id)
            members = [commits.Holder(m.worker_id, m.address, made.view_id, r)
                       for r, m in enumerate(made.members[: commits.MAX_HOLDERS])]
            self.mark = commits.record_view(self.mark, members, held)
        else:
            self.mark = commits.record(self.mark, holder, held)
        return before, self.mark.commit
