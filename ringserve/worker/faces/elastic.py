"""What elastic training (ringserve.elastic) asks of a worker, as one face: ``worker.elastic``.

The commit this worker holds and its report to the coordinator, whether it leaves at the current
commit, the wait for a newer view, the job's committed mark, the admission of waiting workers at a
commit, and a sighting of another worker. Each call is a thin step over the node's parts: the
``Lifeline`` (control/loops.py: heartbeats, which carry the commit), the coordinator's
``ControlClient`` and the planes. Calls that change loop-owned state from another thread go
through ``on_loop``.

``Worker``'s elastic methods (``worker.report_committed``, ...) are delegates to this face.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ringserve.commits import Commit, Mark, Seen
from ringserve.errors import RingserveError
from ringserve.worker.control import sighting
from ringserve.worker.control.standing import on_loop
from ringserve.worker.node import Node

log = logging.getLogger("ringserve.worker")

__all__ = ["Elastic", "no_view_within"]


def no_view_within(address: str, newer_than: int, timeout_s: float) -> str:
    """What a RendezvousTimeoutError says when no view newer than ``newer_than`` came in time."""
    return f"The worker at {address} was in no view newer than {newer_than} within {timeout_s:g} s."


class Elastic:
    """Elastic training's calls on a worker, over its node.

    Args:
        node: the worker's node, which owns the lifeline and the control client.
    """

    def __init__(self, node: Node) -> None:
        self._node = node

    # -- calls from other threads, routed to the loop --------------------------------------

    @property
    def committed(self) -> Commit | None:
        """The commit this worker's elastic state holds (None before its first sync): a read of an
        immutable value, which only report_committed (on the loop, waited for) replaces."""
        lifeline = self._node.lifeline
        return lifeline.held.committed if lifeline is not None else None

    def report_committed(self, commit: Commit, *, now: bool = False, view: int = 0) -> None:
        """Sets the commit this worker's elastic state holds, reported with the next heartbeat;
        ``view``: the view every member of which holds it (a commit-time allreduce in it finished).

        ``now`` sends that heartbeat at once: at a sync, and at a commit where the world changes,
        the coordinator must know who holds what before the new view's members are admitted
        with nothing (callable from any thread; it holds once this returns).
        """
        on_loop(self._node.loop, self._committed, commit, now, view, wait_s=self._node.config.rpc_timeout_s)

    def _committed(self, commit: Commit, now: bool, view: int) -> None:
        lifeline = self._node.lifeline
        if lifeline is None:
            return
        lifeline.held.hold(commit, view)
        if now and not self._node.closed:
            lifeline.heartbeat_now.set()

    @property
    def leaving(self) -> bool:
        """Whether this worker leaves at the current commit (elastic, SIGTERM): the coordinator
        drops it then, and a heartbeat answered "unknown" must not make it rejoin."""
        return self._node.lifeline is not None and self._node.lifeline.leaving

    @leaving.setter
    def leaving(self, leaving: bool) -> None:
        on_loop(self._node.loop, self._set_leaving, leaving, wait_s=self._node.config.rpc_timeout_s)

    def _set_leaving(self, leaving: bool) -> None:
        if self._node.lifeline is not None:
            self._node.lifeline.leaving = leaving

    # -- on the loop ---------------------------------------------------------------------

    async def wait_for_view(self, newer_than: int, timeout_s: float) -> int:
        """Waits until this worker is in a view numbered above ``newer_than``; returns its id.

        Raises:
            RendezvousTimeoutError: no such view within timeout_s.
            ViewInstallError: a view could not be installed, and the worker left.
        """
        def ready() -> bool:
            plane = self._node.planes.current
            return plane is not None and plane.view_id > newer_than

        await self._node.wait_for_view(ready, timeout_s, no_view_within(self._node.address, newer_than, timeout_s))
        plane = self._node.planes.current
        assert plane is not None
        return plane.view_id

    async def commit_mark(self) -> Mark:
        """The job's committed high-water mark, asked of the coordinator now.

        When the coordinator cannot answer within rpc_timeout_s (it is restarting), the mark its
        last heartbeat answer carried, without holders, and a warning: a sync must not wait on
        the coordinator, and that mark is at most a heartbeat old.
        """
        assert self._node.control is not None and self._node.lifeline is not None
        try:
            return await self._node.control.commit_mark(self._node.worker_id)
        except RingserveError as exc:
            heard = self._node.lifeline.heard_mark
            log.warning("%s: could not ask the coordinator for the job's last commit (%s); using %s from a heartbeat",
                        self._node.tag, exc, heard or "none")
            return Mark(heard)

    async def wait_reported(self, commit: Commit, timeout_s: float) -> bool:
        """Whether the coordinator has recorded ``commit``, waiting up to timeout_s (see
        worker/control/reports.py: not at all while the coordinator does not answer)."""
        assert self._node.lifeline is not None
        return await self._node.lifeline.held.wait(commit, timeout_s)

    async def ready_to_join(self) -> None:
        """Says this worker is ready to be admitted, if it prepares to join a running world
        (``admit_when_ready``), and waits until a view takes it; at once otherwise (see
        Node.ready_to_join).

        Raises:
            RendezvousTimeoutError: no view took it within rendezvous_timeout_s.
        """
        await self._node.ready_to_join()

    async def admit_waiting(self, leaving: Sequence[str] = (), view_id: int = 0) -> int:
        """Asks the coordinator to admit the workers waiting to join (call at a commit boundary),
        and to let the members named in ``leaving`` (worker ids) go in that same view. ``view_id``:
        the view of that commit (0: the current one); the coordinator ignores a request of an older one.

        Returns:
            How many the next view adds. A new view comes either way (with the same members if
            nobody is waiting any more), so every rank that waits for a newer view gets one.
        """
        assert self._node.control is not None
        return await self._node.control.admit(self._node.worker_id, view_id or self._node.standing.current().view_id, leaving)

    @property
    def heartbeat_interval_s(self) -> float:
        """The heartbeat interval the coordinator gave this worker (rpc_timeout_s before it joined)."""
        return self._node.lifeline.heartbeat_interval_s if self._node.lifeline is not None else self._node.config.rpc_timeout_s

    async def sight(self, worker_id: str, address: str) -> Seen:
        """Whether the worker ``worker_id`` still listens at ``address`` (ringserve.worker.control.sighting),
        within a heartbeat interval: a worker that cannot answer in one cannot heartbeat either."""
        timeout = min(self._node.config.rpc_timeout_s, self.heartbeat_interval_s)
        return await sighting.sight(worker_id, address, self._node.make_channel, timeout)
