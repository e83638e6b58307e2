"""Horovod's stall inspector, on the coordinator: which ranks have not submitted a collective that
others have waited on for too long.

Each heartbeat names the collectives its worker has had in flight for longer than
``stall_warning_s`` (its view, and their keys). For each collective some ranks of the current view
wait on, the inspector names the ranks that have not submitted it; a worker hears the warnings
about the keys it named, and each is logged once per view. Pure bookkeeping: the servicer feeds
it and logs what it says is new.
"""

from __future__ import annotations

from ringserve.coordinator.membership import ViewInfo

__all__ = ["StallInspector"]


class StallInspector:
    """What each worker last said it waits on, and the warnings given already in this view."""

    def __init__(self) -> None:
        self._stalled: dict[str, tuple[int, frozenset[str]]] = {}
        self._warned: set[tuple[int, str]] = set()

    def heard(self, worker_id: str, view_id: int, stalled: frozenset[str]) -> None:
        """Records what ``worker_id`` waits on in view ``view_id`` (its last heartbeat's word)."""
        self._stalled[worker_id] = (view_id, stalled)

    def reported(self) -> dict[str, tuple[int, frozenset[str]]]:
        """What each worker last said it waits on: worker id -> (view, keys)."""
        return dict(self._stalled)

    def forget(self, worker_id: str) -> None:
        """Forgets a worker that left or was removed."""
        self._stalled.pop(worker_id, None)

    def warnings(self, view: ViewInfo, view_id: int, keys: frozenset[str]) -> tuple[list[str], list[str]]:
        """The warnings about ``keys`` (waited on in view ``view_id``), and those of them not
        given before in this view (to log). None unless ``view_id`` is the current view's."""
        if view_id != view.view_id or not keys:
            return [], []
        warnings, new = [], []
        for key in sorted(keys):
            waiting = sorted(
                rank for rank, m in enumerate(view.members)
                if self._stalled.get(m.worker_id, (0, frozenset()))[0] == view_id
                and key in self._stalled[m.worker_id][1]
            )
            text = _sentence(key, waiting, len(view.members))
            warnings.append(text)
            if (view_id, key) not in self._warned:
                # Only this view's warnings matter: forget older views' (the set would grow forever).
                self._warned = {w for w in self._warned if w[0] == view_id}
                self._warned.add((view_id, key))
                new.append(text)
        return warnings, new

    def current(self, view: ViewInfo) -> list[str]:
        """Every warning of ``view``: each key some of its members last said they wait on."""
        current = {w: keys for w, (v, keys) in self._stalled.items() if v == view.view_id}
        wanted = sorted(set().union(*current.values())) if current else []
        return [
            _sentence(key, [r for r, m in enumerate(view.members) if key in current.get(m.worker_id, ())], len(view.members))
            for key in wanted
        ]


def _sentence(key: str, waiting: list[int], size: int) -> str:
    """``'grad.w#3': ranks 2 have not submitted it; ranks 0, 1, 3 wait``: the stall inspector's words."""
    missing = [r for r in range(size) if r not in waiting]
    return (
        f"{key!r}: ranks {', '.join(map(str, missing)) or 'none'} have not submitted it; "
        f"ranks {', '.join(map(str, waiting))} wait"
    )
