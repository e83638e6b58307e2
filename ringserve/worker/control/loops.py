"""The worker's membership loops: the view watch, the heartbeats, the rejoin and the exclusion check.

Two long-lived tasks, both owned by the worker's ``TaskOwner`` (tasks.py), which reports a crash
the moment it happens. What they learn that their owner (the worker's node, node.py) must act on
they emit as events, to one handler (``on_event``):

- ``ViewHeard``: the coordinator published a view, to install. A view that cannot be installed
  makes the owner give up (ViewInstallError, it leaves) and stop the lifeline;
- ``Answered``: a heartbeat's answer, with the joiners waiting for the current view;
- ``Excluded``: the world went on without this worker (see exclusion.py).

The loops:

- **watch**: every view the coordinator publishes is heard (``ViewHeard``). A broken watch (the
  coordinator is away) is watched again, with a backoff.
- **heartbeat**: every heartbeat interval (or at once when asked, see ``heartbeat_now``) the
  worker's counters, stalled collectives, ring link and commit go to the coordinator, which
  answers with the joiners waiting, the job's commit mark and the interval to keep (it stretches
  the interval as the world grows). A worker the coordinator does not know rejoins
  under its id, claiming the view it runs in. A worker silent to the coordinator for a heartbeat
  timeout asks its peers whether they went on without it (see exclusion.py) and, if they did and
  a new connection to the coordinator does not come up either, stops with ExcludedError.

After each heartbeat and each break in the watch, retired planes that drained are forgotten and
channels nobody uses are closed.

The loops run on the worker's event loop, and so does everything they touch; what the training
thread may read of theirs it reads from the worker's published standing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ringserve._proto import coordinator_pb2 as cpb
from ringserve.commits import Commit
from ringserve.config import WorkerConfig
from ringserve.constants import OUTAGE_LOG_EVERY_S, WATCH_BACKOFF_FIRST_S, WATCH_BACKOFF_MAX_S
from ringserve.errors import ExcludedError, RingserveError
from ringserve.worker.control import exclusion
from ringserve.worker.control.client import ControlClient
from ringserve.worker.control.outage import Outage
from ringserve.worker.control.reports import CommitReports
from ringserve.worker.control.standing import tag_of
from ringserve.worker.dataplane.peers import PeerServicer
from ringserve.worker.dataplane.registry import Planes

log = logging.getLogger("ringserve.worker")


@dataclass(frozen=True)
class ViewHeard:
    """The coordinator published ``view``: the owner installs it, or gives up and stops the lifeline."""

    view: cpb.View


@dataclass(frozen=True)
class Answered:
    """A heartbeat was answered; ``pending_workers`` wait to join the current view (0: none, or
    the answer was about another view)."""

    pending_workers: int


@dataclass(frozen=True)
class Excluded:
    """The peers went on without this worker (``error`` says how): every call fails from now on."""

    error: ExcludedError


LifelineEvent = ViewHeard | Answered | Excluded
OnEvent = Callable[[LifelineEvent], Awaitable[None]]


class Lifeline:
    """The worker's loops on the control plane, and what they learn (see the module docstring)."""

    def __init__(
        self,
        *,
        config: WorkerConfig,
        control: ControlClient,
        joined: cpb.JoinResponse,
        address: str,
        planes: Planes,
        peers: PeerServicer,
        on_event: OnEvent,
    ) -> None:
        self.config = config
        self.control = control
        self.worker_id = joined.worker_id
        self.address = address
        self.planes = planes
        self.counters = planes.counters
        self.channels = planes.channels
        self.peers = peers
        self._on_event = on_event
        self.stopped = False  # set by the owner once the worker cannot go on: the loops then end
        self.heartbeat_interval_s = joined.heartbeat_interval_s
        self.heartbeat_timeout_s = joined.heartbeat_timeout_s
        self.heard_at = asyncio.get_running_loop().time()  # when the last answered heartbeat was sent
        # The commit this worker's elastic state holds once synced, reported with heartbeats (see
        # worker/control/reports.py), and the job's mark from the last heartbeat answer (a fallback when
        # the coordinator cannot be asked at a sync).
        self.held = CommitReports()
        self.heard_mark: Commit | None = None
        self.heartbeat_now = asyncio.Event()
        peers.on_linked = self.heartbeat_now.set  # the ring's link into us is up: say so now (ringcheck.py)
        # Set at the commit where this worker leaves (elastic, SIGTERM): the coordinator drops it
        # then (see Elastic.admit_waiting), and a heartbeat answered "unknown" must not make it rejoin.
        self.leaving = False
        # False while the worker prepares to join a running world (Node.ready_to_join): each
        # heartbeat says so, and a rejoin (a restarted coordinator) asks again to prepare.
        self.ready = True
        self.beats_out = Outage("heartbeat", every_s=OUTAGE_LOG_EVERY_S)
        self.watch_out = Outage("view watch", every_s=OUTAGE_LOG_EVERY_S)

    def stop(self) -> None:
        """Ends the loops: the watch at once, the heartbeats at their next round."""
        self.stopped = True

    @property
    def tag(self) -> str:
        """"rank R view V" (or "worker ADDRESS view V" outside any view), for log lines."""
        current = self.planes.current
        return tag_of(current.place if current is not None else None, self.address, self.planes.latest_view)

    async def housekeeping(self) -> None:
        """Forgets drained planes, then closes the channels no link or probe holds any more."""
        await self.planes.drain()
        await self.channels.sweep()

    async def watch(self) -> None:
        backoff = WATCH_BACKOFF_FIRST_S
        while not self.stopped:
            try:
                async for view in self.control.watch(self.worker_id):
                    self.watch_out.ended(self.tag)
                    await self._on_event(ViewHeard(view))
                    if self.stopped:
                        return
                    backoff = WATCH_BACKOFF_FIRST_S
            except RingserveError as exc:  # the coordinator is away: watch again
                self.watch_out.failed(self.tag, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)
            await self.housekeeping()

    async def heartbeat(self) -> None:
        while not self.stopped:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_interval_s):
                    await self.heartbeat_now.wait()
            self.heartbeat_now.clear()
            c = self.counters
            counters = cpb.WorkerCounters(
                collectives_done=c.collectives_done, bytes_sent=c.bytes_sent, bytes_received=c.bytes_received,
                lane_bytes_sent=c.lane_bytes_sent, lane_fallbacks=c.lane_fallbacks,
            )
            plane = self.planes.current
            view_id = plane.view_id if plane is not None else 0
            if plane is not None:
                counters.links.extend(cpb.LinkCounters(view_id=view_id, peer_rank=rank, lane=lane, bytes_sent=sent)
                                      for rank, lane, sent in plane.link_report())
            stalled = plane.stalled(self.config.stall_warning_s) if plane is not None else []
            sent_at = asyncio.get_running_loop().time()
            committed, committed_view = self.held.committed, self.held.view
            try:
                answer = await self.control.heartbeat(
                    self.worker_id, view_id, counters, stalled, self.peers.linked_view(), committed, committed_view,
                    ready=self.ready,
                )
            except RingserveError as exc:
                self.held.failed()
                self.counters.heartbeats_missed += 1
                self.beats_out.failed(self.tag, exc)
                if await self._excluded_now():
                    return
                continue
            self.heard_at = sent_at
            self.beats_out.ended(self.tag)
            # The coordinator stretches the interval as the world grows (0: an older coordinator).
            self.heartbeat_interval_s = answer.heartbeat_interval_s or self.heartbeat_interval_s
            self.held.answered(committed, answer.known)
            # Counted against the view the answer is about: stale news of joiners already admitted
            # must not make a commit wait for a view that never comes.
            current = self.planes.current.view_id if self.planes.current is not None else 0
            await self._on_event(Answered(answer.pending_workers if answer.view_id == current else 0))
            if answer.HasField("mark_step"):
                self.heard_mark = max(self.heard_mark or Commit(0, 0), Commit(answer.mark_lineage, answer.mark_step))
            for warning in answer.stall_warnings:
                self.counters.stall_warnings += 1
                log.warning("%s: stalled collective %s", self.tag, warning)
            if not answer.known and not self.stopped and not self.leaving:  # one that gave up or leaves stays out
                await self._rejoin()
            await self.housekeeping()

    async def _excluded_now(self) -> bool:
        """After a heartbeat timeout without the coordinator: whether the peers went on without us.

        If they did, every collective of this worker fails with ExcludedError from now on (see
        ringserve.worker.control.exclusion), and so does a wait for a view.
        """
        silent_s = asyncio.get_running_loop().time() - self.heard_at
        place = self.planes.last_place
        if place is None or place.size == 1 or not exclusion.must_ask(silent_s, self.heartbeat_timeout_s):
            return False
        peers = [a for r, a in enumerate(place.addresses) if r != place.rank]
        leases = [self.channels.lease(a) for a in peers]
        try:
            channels = {lease.address: lease.channel for lease in leases}
            views = await exclusion.peer_views(peers, channels.__getitem__, self.config.rpc_timeout_s)
        finally:
            for lease in leases:
                lease.release()
        # Against the last view we were in, not the newest we heard of: the view that dropped us
        # may have reached us before the coordinator's route went.
        newer = exclusion.excluded(place.view_id, views)
        if not newer:
            return False
        # The peers' newer view proves that the coordinator dropped us, not that we are out of its
        # reach still: a link that was down and is back up (the heartbeats across the outage failed,
        # then the peers answered) leaves a worker that rejoins, as a stopped one (SIGSTOP) does.
        # A new connection decides (the old one may be stuck in TCP's backoff); if it is up, the
        # next heartbeat goes at once, and the coordinator's "unknown" makes us rejoin.
        if await self.control.redial(self.heartbeat_timeout_s / 2):
            log.warning("%s: the peers went on to view %d without this worker, and the coordinator is "
                        "reachable again: rejoining", self.tag, newer)
            self.heartbeat_now.set()
            return False
        exc = ExcludedError(self.address, self.config.coordinator, silent_s, newer, place.view_id)
        log.error("%s: %s", self.tag, exc)
        await self._on_event(Excluded(exc))
        return True

    async def _rejoin(self) -> None:
        """Registers again under the same id, claiming the view we run in (after a coordinator
        restart, or after being declared dead while stopped)."""
        plane = self.planes.current
        claim = {}
        if plane is not None:
            claim = {"view_id": plane.view_id, "rank": plane.place.rank, "view_size": plane.place.size}
        log.warning("%s: the coordinator does not know this worker; rejoining with %s", self.tag, claim or "no view")
        try:
            joined = await self.control.join(
                address=self.address, hostname=self.config.hostname, rank_hint=self.config.rank_hint,
                worker_id=self.worker_id, prepare=not self.ready, **claim,
            )
            self.heartbeat_timeout_s = joined.heartbeat_timeout_s
        except RingserveError as exc:
            log.warning("%s: rejoin failed: %s", self.tag, exc)
