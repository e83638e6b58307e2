"""The planes a worker holds, and the one place where they are made, looked up and dropped.

There is the current view's plane, and the retired ones: planes of older views whose collectives
may still finish and whose links are still flushing their last frames. ``Planes.install`` asks the
view policy (policy.py) what a new view means and carries out its actions, in order; everything
else here is the bookkeeping around them: the links planes open (a gRPC stream on a leased
channel, with a shared-memory lane where the host allows and a TCP payload lane, see lanes/tcp/outbound.py),
forgetting retired planes once drained, and the event that wakes whoever waits for the next view
(``start()``, ``wait_for_view``, a peer stream whose HELLO named a view not installed yet).

Everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from ringserve._proto import coordinator_pb2 as cpb
from ringserve.config import WorkerConfig
from ringserve.errors import InvalidArgumentError, RingChangedError
from ringserve.observe import Counters, Timeline
from ringserve.selection import LinkCosts
from ringserve.worker.dataplane import policy
from ringserve.worker.dataplane.lanes.hub import Lanes
from ringserve.worker.dataplane.links import shared
from ringserve.worker.dataplane.links.channels import ChannelCache
from ringserve.worker.dataplane.links.fdpass import RingServer
from ringserve.worker.dataplane.links.shared import OutboundRing
from ringserve.worker.dataplane.links.stream import Link, StreamLink
from ringserve.worker.dataplane.plane import OnPeerFailure, Plane
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.dataplane.pool import ResultPool

log = logging.getLogger("ringserve.worker")


def view_of(view: cpb.View) -> policy.View:
    """The policy's copy of a published view."""
    return policy.View(
        view_id=view.view_id,
        members=tuple(
            policy.Member(m.worker_id, m.address, m.local_rank, m.local_size, m.cross_rank, m.cross_size)
            for m in view.members
        ),
        left=frozenset(view.left_worker_ids),
        failed=frozenset(view.failed_worker_ids),
    )


class Planes:
    """The current plane and the retired ones still draining; carries out the view policy."""

    def __init__(self, config: WorkerConfig, counters: Counters, channels: ChannelCache, *,
                 on_peer_failure: OnPeerFailure, tag: Callable[[], str]) -> None:
        if config.shared_dir and not os.path.isdir(config.shared_dir):
            raise InvalidArgumentError(
                f"The shared directory {config.shared_dir!r} (RINGSERVE_SHARED_DIR) does not exist; mount the "
                f"workers' shared volume there, or leave it empty."
            )
        self.config = config
        self.counters = counters
        self.channels = channels
        self.timeline: Timeline | None = None
        self.state = policy.State(worker_id="")
        self.current: Plane | None = None
        self.retired: list[Plane] = []
        self.last_place: Place | None = None  # the last place this worker held, kept after its view
        self._on_peer_failure = on_peer_failure
        self._tag = tag
        self._changed = asyncio.Event()
        # The new-result collectives' buffers: one pool for every plane, as results outlive views.
        self.pool = ResultPool(config.result_pool_bytes)
        self._rings_served: RingServer | None = None
        self._rings_refused = False
        self.lanes = Lanes(config, counters, tag=tag)  # the payload port and its lanes (lanes/tcp/outbound.py)

    @property
    def latest_view(self) -> int:
        """The newest view this worker has heard of (it may not be a member)."""
        return self.state.latest_view

    @property
    def all(self) -> list[Plane]:
        """Every plane held: the current one first."""
        return [p for p in (self.current, *self.retired) if p is not None]

    def plane_of(self, view_id: int) -> Plane | None:
        """The plane of ``view_id`` that frames may still reach: the current one, or a retired one
        not closed."""
        current = self.current
        if current is not None and current.view_id == view_id:
            return current
        return next((p for p in self.retired if p.view_id == view_id and p.error is None), None)

    async def changed(self) -> None:
        """Returns at the next change: a view installed, the worker failed or stopped."""
        await self._changed.wait()

    def _announce(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- carrying out the policy -----------------------------------------------------------

    def install(self, view: cpb.View) -> bool:
        """Installs a published view; returns whether it changed anything (it was news).

        Raises:
            OSError and the like: a plane could not be set up (the caller gives up, see
                Worker._fail); what was done before stays done.
        """
        state, actions = policy.decide(self.state, view_of(view))
        if state is self.state:
            return False
        self.state = state
        try:
            for action in actions:
                self._apply(action)
        finally:
            self._announce()
        return True

    def _apply(self, action: policy.Action) -> None:
        match action:
            case policy.Retire(view_id, error):
                self._end_current(view_id).retire(error)
            case policy.Close(view_id, error):
                self._end_current(view_id).close(error)
            case policy.CloseRetired(error):
                for plane in self.retired:
                    plane.close(error)
            case policy.Starve(view_id, ranks, error):
                for plane in self.all:
                    if plane.view_id == view_id:
                        plane.let_go(ranks, error)
            case policy.Open(place):
                self._open(place)

    def _end_current(self, view_id: int) -> Plane:
        plane = self.current
        assert plane is not None and plane.view_id == view_id, "the policy ends the current view only"
        self.counters.view_changes += 1
        self.current = None
        self.retired.append(plane)
        return plane

    def _open(self, place: Place) -> None:
        cfg = self.config
        if cfg.timeline and self.timeline is None:
            self.timeline = Timeline(Timeline.path_for(cfg.timeline, place.rank), place.rank)
        self.last_place = place
        self.current = Plane(
            place, self.counters, cfg.abort_grace_s, connect=lambda rank: self._connect(place, rank),
            timeline=self.timeline, on_peer_failure=self._on_peer_failure, checksum=cfg.checksum, pool=self.pool,
            hierarchical=cfg.hierarchical, algorithm=cfg.algorithm,
            links=LinkCosts.of(cfg.link_latency_s, cfg.link_mbps * 1e6 / 8) if cfg.link_mbps > 0 else None,
            measure_timeout_s=cfg.collective_timeout_s, landings=self.lanes.buffers.landings,
        )
        log.info("%s: joined as rank %d of %d", self._tag(), place.rank, place.size)

    def _connect(self, place: Place, rank: int) -> Link:
        """The stream from this worker to ``rank`` of ``place``'s view, with lanes where they may help."""
        address = place.addresses[rank]
        return StreamLink(self.channels.lease(address), self.counters, drain_timeout_s=self.config.drain_timeout_s,
                          lane=self._lane(), tcp=self.lanes.outbound())

    def _lane(self) -> OutboundRing | None:
        """A shared-memory ring to offer a peer that may be on this host."""
        cfg = self.config
        if not cfg.shared_memory or not shared.supported():
            return None
        try:
            # Room for a wide frame (selection.ring_chunk); its pages go back when idle (links/shared.py).
            ring = OutboundRing(cfg.shared_slots, cfg.frame_bytes, release_after_s=cfg.shared_release_s)
        except OSError as exc:  # no memfd (a seccomp profile), or out of fds
            log.info("%s: no shared-memory ring (%s); payloads travel over the stream", self._tag(), exc)
            return None
        server = self._ring_server()
        if server is not None:
            ring.serve(server)
        return ring

    def _ring_server(self) -> RingServer | None:
        """This worker's ring server in the shared directory (links/fdpass.py), made on first use."""
        cfg = self.config
        if self._rings_served is None and cfg.shared_dir and not self._rings_refused:
            try:
                self._rings_served = RingServer(cfg.shared_dir, timeout_s=cfg.connect_timeout_s)
            except OSError as exc:
                self._rings_refused = True
                log.warning("%s: no ring server in %s (%s); peers in other containers get payloads over the stream",
                            self._tag(), cfg.shared_dir, exc)
        return self._rings_served

    # -- the worker's end, and failures ----------------------------------------------------

    def stop(self, error: BaseException | None = None) -> None:
        """Ignores every later view. With ``error`` (the worker failed), every plane is closed with
        it; without (a shutdown), the current plane is retired, so that its collectives may drain."""
        self.state = policy.stop(self.state)
        plane, self.current = self.current, None
        if plane is not None:
            self.retired.append(plane)
            if error is None:
                plane.retire(RingChangedError(plane.view_id, plane.view_id, "the worker shut down"))
        if error is not None:
            for p in self.retired:
                p.close(error)
        self._announce()

    async def drain(self) -> None:
        """Forgets the retired planes whose links have all ended."""
        for plane in [p for p in self.retired if p.drained]:
            await plane.wait_closed()
            self.retired.remove(plane)

    async def wait_drained(self) -> None:
        """Waits until every plane's links have ended (cancel it for a deadline: the links run on)."""
        for plane in self.all:
            await plane.wait_closed()

    async def close(self, error: BaseException) -> None:
        """Closes every plane with ``error`` and waits for their links to stop."""
        planes = self.all
        self.current = None
        self.retired.clear()
        for plane in planes:
            plane.close(error)
        for plane in planes:
            await plane.wait_closed()
        if self._rings_served is not None:
            self._rings_served.close()
            self._rings_served = None
        await self.lanes.close()
