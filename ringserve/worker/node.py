"""The worker's node: its lifecycle, and the parts it owns.

- the peer server and its ``PeerServicer`` (the peers' streams into the planes);
- the ``ControlClient`` to the coordinator;
- ``Planes``: the data planes of the views this worker is in (made and ended as the view policy
  decides, see registry.py), over the ``ChannelCache`` of channels to the peers;
- the ``Lifeline``: the view watch and the heartbeats (control/loops.py), whose events come to one
  handler here (``_on_event``);
- the ``TaskOwner`` of every background task, which surfaces a crash at once.

The node decides how the worker stands (the current plane, the pin, the failure that ends it)
and publishes it as a ``Standing`` for other threads (control/standing.py). The public faces
(faces/collectives.py, faces/elastic.py) take their plane from ``plane()`` and their parts from
the node; none of them holds state of the node's.

Everything here lives on the event loop that started the node and is touched only there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ringserve import _malloc
from ringserve._proto import coordinator_pb2 as cpb
from ringserve.config import WorkerConfig
from ringserve.constants import SERVER_STOP_GRACE_S
from ringserve.errors import (
    NotInitializedError,
    RendezvousTimeoutError,
    RingChangedError,
    RingserveError,
    ViewInstallError,
    WorkerFailedError,
)
from ringserve.observe import Counters, Timeline
from ringserve.security import Security
from ringserve.transport import channel_options, keepalive_for, server_options
from ringserve.worker.control.client import ControlClient
from ringserve.worker.control.loops import Answered, Excluded, Lifeline, LifelineEvent, ViewHeard
from ringserve.worker.control.standing import Standing, raise_failure
from ringserve.worker.control.tasks import TaskOwner
from ringserve.worker.dataplane.links.channels import ChannelCache
from ringserve.worker.dataplane.peers import PeerServicer
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.dataplane.registry import Planes

log = logging.getLogger("ringserve.worker")


class Node:
    """A worker's lifecycle and the parts it owns (see the module docstring).

    Args:
        config: the worker's settings.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.worker_id = ""
        self.address = ""
        self.security = Security()
        self.control: ControlClient | None = None
        self.channels = ChannelCache(self.make_channel, self.call_metadata)
        self.planes = Planes(config, self.counters, self.channels, on_peer_failure=self.report, tag=lambda: self.tag)
        self.peers = PeerServicer(config, self.counters, self.planes, report=self.report, tag=lambda: self.tag)
        self.tasks = TaskOwner(on_crash=self._crashed)
        self.lifeline: Lifeline | None = None
        self.standing = Standing()
        self.pinned: int | None = None
        self.pending_workers = 0  # joiners waiting for the current view, as the last heartbeat said
        # Came to a running world with admit_when_ready: in no view until it says it is ready
        # (ready_to_join); meanwhile rank and size answer where it would stand (provisional).
        self.preparing = False
        self.provisional: Place | None = None
        # Why every call fails from now on: excluded, a view that could not be installed, a crash.
        self.failure: RingserveError | None = None
        self.left = False  # left the world already (or cannot: excluded)
        self.started = False
        self.closed = False
        self.metrics: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def tag(self) -> str:
        """"rank R view V" (or "worker ADDRESS view V" outside any view), for log lines."""
        return self.standing.tag(self.address)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the peer server, joins the coordinator and waits for a view that includes us.

        Raises:
            CoordinatorUnreachableError: the coordinator did not answer within connect_timeout_s.
            RendezvousTimeoutError: no view formed within rendezvous_timeout_s.
            ViewInstallError: the first view could not be installed (the cause is chained).
        """
        cfg = self.config
        if cfg.tune_malloc:
            _malloc.tune()
        self.loop = asyncio.get_running_loop()
        self.security = Security.load(cfg)
        server = grpc.aio.server(
            options=server_options(cfg.max_message_bytes, idle_timeout_s=cfg.peer_idle_timeout_s,
                                   handshake_timeout_s=cfg.peer_hello_timeout_s, lookahead_bytes=cfg.stream_window_bytes),
            interceptors=self.security.server_interceptors(),
            maximum_concurrent_rpcs=cfg.server_rpc_cap,
        )
        server.add_generic_rpc_handlers([self.peers.handler()])
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = self.security.add_port(server, f"{cfg.bind_host}:{cfg.bind_port}")
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.address = f"{cfg.advertised_host()}:{cfg.advertise_port or port}"
        self.control = ControlClient(cfg, self.security)
        try:
            joined = await self.control.join(address=self.address, hostname=cfg.hostname, rank_hint=cfg.rank_hint,
                                             prepare=cfg.admit_when_ready)
            self.worker_id = joined.worker_id
            if joined.preparing:
                self.preparing = True
                self.provisional = Place(0, joined.provisional_rank, joined.provisional_size, (),
                                         local_rank=joined.provisional_local_rank, local_size=joined.provisional_local_size)
            self.planes.state = replace(self.planes.state, worker_id=joined.worker_id)
            if cfg.metrics_port >= 0:
                from ringserve.metrics import MetricsServer, WorkerCollector

                self.metrics = MetricsServer(WorkerCollector(self.counters, self.labels), cfg.bind_host, cfg.metrics_port)
            self.lifeline = lifeline = Lifeline(
                config=cfg, control=self.control, joined=joined, address=self.address, planes=self.planes,
                peers=self.peers, on_event=self._on_event,
            )
            lifeline.ready = not self.preparing
            self.tasks.spawn(lifeline.watch(), "view watch")
            self.tasks.spawn(lifeline.heartbeat(), "heartbeat")
            self.started = True
            self.publish()
            if self.preparing:
                log.info("worker %s: a world is running; preparing to join it as rank %d of %d (provisional)",
                         self.address, joined.provisional_rank, joined.provisional_size)
                return
            await self._wait_for_place()
        except BaseException:
            await self.close()
            raise

    async def _wait_for_place(self) -> None:
        cfg = self.config
        await self.wait_for_view(lambda: self.planes.current is not None, cfg.rendezvous_timeout_s, (
            f"No view that includes the worker at {self.address} formed within {cfg.rendezvous_timeout_s:g} s "
            f"(coordinator {cfg.coordinator})."
        ))

    async def ready_to_join(self) -> None:
        """A worker preparing to join a running world (``admit_when_ready``) says it is ready now,
        and waits until a view takes it (within rendezvous_timeout_s): the members admit it at
        their next commit. At once for any other worker.

        Raises:
            RendezvousTimeoutError: no view took it within rendezvous_timeout_s.
        """
        if not self.preparing:
            return
        self.preparing = False
        if self.lifeline is not None:
            self.lifeline.ready = True
            self.lifeline.heartbeat_now.set()
        log.info("%s: ready to join; waiting to be admitted", self.tag)
        await self._wait_for_place()

    async def close(self) -> None:
        """Leaves the world and releases every task, stream, channel, shared ring and the server.

        Collectives in flight may finish, and streams flush their last frames, for up to
        drain_timeout_s, one deadline over every plane held; then the worker leaves (one
        rpc_timeout_s) and everything is cut off.
        """
        if self.closed:
            return
        self.closed = True
        cfg = self.config
        self.planes.stop()
        self.publish()
        # Let collectives in flight finish and tell the peers we are done, then leave: the others
        # then see a graceful leave and their last collectives are not cut off. That holds for a
        # plane retired by a view change just before, too: its streams may still be flushing the
        # last frames their peers need.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(cfg.drain_timeout_s):
                await self.planes.wait_drained()
        if not self.left:
            await self.leave()
        await self.tasks.close(cfg.rpc_timeout_s)
        await self.planes.close(RingChangedError(self.planes.latest_view, self.planes.latest_view,
                                                 "the worker shut down"))
        await self.channels.close()
        if self.control is not None:
            await self.control.close()
        if self._server is not None:
            await self._server.stop(SERVER_STOP_GRACE_S)
            await self.peers.wait_handlers(cfg.rpc_timeout_s)
        self.peers.close()
        # The server holds our stream handler, and so us: drop both, so that gRPC's poller thread
        # can go as soon as the last channel and server are gone, without waiting for the GC.
        self._server = None
        self.control = None
        self.lifeline = None
        if self.metrics is not None:
            self.metrics.close()
        if self.planes.timeline is not None:
            self.planes.timeline.close()

    def set_timeline(self, timeline: Timeline | None) -> Timeline | None:
        """Makes the collectives started from now on write to ``timeline``; returns the one replaced."""
        previous, self.planes.timeline = self.planes.timeline, timeline
        if self.planes.current is not None:
            self.planes.current.timeline = timeline
        return previous

    # -- the lifeline's events --------------------------------------------------------------

    async def _on_event(self, event: LifelineEvent) -> None:
        match event:
            case ViewHeard(view):
                try:
                    self._install(view)
                except Exception as exc:  # whatever it is, the worker cannot go on
                    await self._give_up(view.view_id, exc)
            case Answered(pending):
                self.pending_workers = pending
                self.publish()
            case Excluded(error):
                self.left = True  # the coordinator cannot be reached, and dropped this worker already
                self.fail(error)

    def _install(self, view: cpb.View) -> None:
        if self.planes.install(view):
            self.pending_workers = 0
            self.publish()

    async def _give_up(self, view_id: int, exc: Exception) -> None:
        """A view could not be installed: fails whoever waits (start(), a collective) at once with
        the cause chained, and leaves, so that the others get a view without this worker instead
        of waiting for it until their deadlines."""
        failure = ViewInstallError(f"The worker at {self.address} could not install view {view_id}: {type(exc).__name__}: {exc}")
        failure.__cause__ = exc
        self.fail(failure)
        await self.leave()

    # -- failures --------------------------------------------------------------------------

    def fail(self, failure: RingserveError) -> None:
        """Makes every call, wait and collective fail with ``failure`` from now on."""
        if self.failure is not None:
            return
        self.failure = failure
        log.error("%s: %s", self.tag, failure)
        if self.lifeline is not None:
            self.lifeline.stop()
        self.planes.stop(failure)
        self.publish()

    def _crashed(self, name: str, exc: BaseException) -> None:
        """A background task crashed (see tasks.py): the worker cannot go on, and leaves."""
        failure = WorkerFailedError(
            f"The {name} task of the worker at {self.address} crashed ({type(exc).__name__}: {exc}); "
            f"the worker left the world."
        )
        failure.__cause__ = exc
        self.fail(failure)
        if not self.closed:
            self.tasks.spawn(self.leave(), "leave")

    async def leave(self) -> None:
        """Tells the coordinator this worker leaves (within rpc_timeout_s; an error is ignored)."""
        if self.control is not None and self.worker_id:
            with contextlib.suppress(RingserveError):
                await self.control.leave(self.worker_id)
                self.left = True

    def report(self, view_id: int, suspect_rank: int, reason: str) -> None:
        """Tells the coordinator a peer looks dead, so it can confirm that fast (a probe)."""
        control = self.control
        if control is None or self.closed:
            return

        async def report() -> None:
            with contextlib.suppress(RingserveError):
                await control.report_failure(self.worker_id, view_id, suspect_rank, reason)

        self.tasks.spawn(report(), "failure report")

    # -- where the worker stands -----------------------------------------------------------

    def publish(self) -> None:
        """Publishes where the worker stands now, for other threads (see standing.py)."""
        current = self.planes.current
        self.standing = Standing(
            running=self.started and not self.closed,
            place=current.place if current is not None else None,
            last=self.planes.last_place or self.provisional,
            latest_view=self.planes.latest_view,
            pending_workers=self.pending_workers if self.lifeline is not None and current is not None else 0,
            pinned=self.pinned,
            failure=self.failure,
        )

    def labels(self) -> tuple[int, int]:
        """(rank, view) for the metrics; (-1, the latest view) outside any view."""
        standing = self.standing
        return (standing.place.rank, standing.place.view_id) if standing.place is not None else (-1, standing.latest_view)

    def pin(self, view_id: int | None) -> None:
        """Pins collectives to ``view_id`` (None: unpins); on the loop (see Worker.pin_view)."""
        self.pinned = view_id
        self.publish()

    async def wait_for_view(self, ready: Callable[[], bool], timeout_s: float, message: str) -> None:
        """Waits until ``ready()``, failing with RendezvousTimeoutError(``message``) after timeout_s.

        Raises:
            RendezvousTimeoutError: not ready within timeout_s.
            ExcludedError, ViewInstallError, WorkerFailedError: the worker failed meanwhile.
        """
        try:
            async with asyncio.timeout(timeout_s):
                while not ready():
                    raise_failure(self.failure)
                    await self.planes.changed()
        except TimeoutError:
            raise RendezvousTimeoutError(message) from None
        raise_failure(self.failure)

    def plane(self) -> Plane:
        """The plane collectives run on now: the current view's, checked against the pin.

        Raises:
            NotInitializedError: the worker is not running.
            ExcludedError, ViewInstallError, WorkerFailedError: the worker stopped for good.
            RingChangedError: the worker is in no view, or the view moved on from the pinned one.
        """
        if not self.started or self.closed:
            raise NotInitializedError("The worker is not running: call start() (or ringserve.init()) first.")
        raise_failure(self.failure)
        plane = self.planes.current
        if plane is None:
            latest = self.planes.latest_view
            raise RingChangedError(latest, latest, "this worker is not in the current view")
        if self.pinned is not None and plane.view_id != self.pinned:
            raise RingChangedError(self.pinned, plane.view_id, "the view moved on since the elastic state was synced")
        return plane

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a client stream to a peer sends itself: the token, on a plaintext channel (the
        security is loaded at start, after the channel cache is made)."""
        return self.security.call_metadata()

    def make_channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a peer, with the job's TLS and token, whose keepalive notices a silent peer
        within the heartbeat timeout the coordinator handed out (transport.keepalive_for)."""
        lifeline = self.lifeline
        options = {} if lifeline is None else {"keepalive": keepalive_for(lifeline.heartbeat_timeout_s)}
        return self.security.channel(address, channel_options(self.config.max_message_bytes,
                                                              lookahead_bytes=self.config.stream_window_bytes, **options))
