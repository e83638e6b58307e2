"""The Worker: a ringserve worker's lifecycle and its public face, over the parts that do the work.

- ``registry.Planes``: the data planes of the views this worker is in (plane.py), made and ended
  as the view policy (policy.py) decides;
- ``peers.PeerServicer``: the peer server's streams into those planes;
- ``channels.ChannelCache``: the channels to the peers, each closed once nobody uses it;
- ``loops.Lifeline``: the view watch and heartbeats, the rejoin and the exclusion check;
- ``tasks.TaskOwner``: the owner of every background task, which surfaces a crash at once.

Everything above lives on the event loop that started the worker and is touched only there; other
threads read the ``Standing`` it publishes and route their writes to the loop (see standing.py).
The public face (where the worker stands, its collectives) is ``facade.Facade``, and what elastic
training asks of it (commits, leaving, admissions) is ``elastic_hooks.ElasticHooks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ringserve import _malloc
from ringserve._proto import coordinator_pb2 as cpb
from ringserve.config import WorkerConfig
from ringserve.errors import (
    ExcludedError,
    NotInitializedError,
    RendezvousTimeoutError,
    RingChangedError,
    RingserveError,
    ViewInstallError,
    WorkerFailedError,
)
from ringserve.observe import Counters, Timeline
from ringserve.security import Security
from ringserve.transport import channel_options, server_options
from ringserve.worker.control.client import ControlClient
from ringserve.worker.control.loops import Lifeline
from ringserve.worker.control.standing import Standing, on_loop, raise_failure
from ringserve.worker.control.tasks import TaskOwner
from ringserve.worker.dataplane.channels import ChannelCache
from ringserve.worker.dataplane.peers import PEER_SERVICE, PeerServicer
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.registry import Planes
from ringserve.worker.elastic_hooks import ElasticHooks
from ringserve.worker.ops.process_sets import Registry, WholeWorld

log = logging.getLogger("ringserve.worker")

__all__ = ["PEER_SERVICE", "Standing", "Worker"]


class Worker(ElasticHooks):
    """A ringserve worker in the running event loop.

    Example::

        async with Worker(coordinator="127.0.0.1:50051") as w:
            total = await w.allreduce(np.ones(4), op="sum")
    """

    def __init__(self, coordinator: str | None = None, *, config: WorkerConfig | None = None) -> None:
        config = config or WorkerConfig()
        if coordinator and config.coordinator != coordinator:
            config = replace(config, coordinator=coordinator)
        self.config = config
        self.counters = Counters()
        self.worker_id = ""
        self.address = ""
        self._security = Security()
        self._server: grpc.aio.Server | None = None
        self._control: ControlClient | None = None
        self._channels = ChannelCache(self._make_channel)
        self._planes = Planes(config, self.counters, self._channels, on_peer_failure=self._report,
                              tag=lambda: self.tag)
        self._peers = PeerServicer(config, self.counters, self._planes, report=self._report, tag=lambda: self.tag)
        self._tasks = TaskOwner(on_crash=self._crashed)
        self._lifeline: Lifeline | None = None
        self._standing = Standing()
        self._pinned: int | None = None
        self._process_sets = Registry()  # this view's process sets (process_sets.py)
        self._registering = asyncio.Lock()  # one registration at a time, in call order
        self.global_process_set = WholeWorld(lambda: (self.rank, self.size))
        # Why every call fails from now on: excluded, a view that could not be installed, a crash.
        self._failure: RingserveError | None = None
        self._left = False  # left the world already (or cannot: excluded)
        self._started = False
        self._closed = False
        self._metrics: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Worker:
        """Starts the peer server, joins the coordinator and waits for a view that includes us.

        Raises:
            CoordinatorUnreachableError: the coordinator did not answer within connect_timeout_s.
            RendezvousTimeoutError: no view formed within rendezvous_timeout_s.
            ViewInstallError: the first view could not be installed (the cause is chained).
        """
        cfg = self.config
        if cfg.tune_malloc:
            _malloc.tune()
        self._loop = asyncio.get_running_loop()
        self._security = Security.load(cfg)
        server = grpc.aio.server(
            options=server_options(cfg.max_message_bytes, idle_timeout_s=cfg.peer_idle_timeout_s,
                                   handshake_timeout_s=cfg.peer_hello_timeout_s),
            interceptors=self._security.server_interceptors(),
            maximum_concurrent_rpcs=cfg.server_rpc_cap,
        )
        server.add_generic_rpc_handlers([self._peers.handler()])
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = self._security.add_port(server, f"{cfg.bind_host}:{cfg.bind_port}")
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.address = f"{cfg.advertised_host()}:{cfg.advertise_port or port}"
        self._control = ControlClient(cfg, self._security)
        try:
            joined = await self._control.join(address=self.address, hostname=cfg.hostname, rank_hint=cfg.rank_hint)
            self.worker_id = joined.worker_id
            self._planes.state = replace(self._planes.state, worker_id=joined.worker_id)
            if cfg.metrics_port >= 0:
                from ringserve.metrics import MetricsServer, WorkerCollector

                self._metrics = MetricsServer(WorkerCollector(self.counters, self._labels), cfg.bind_host, cfg.metrics_port)
            self._lifeline = lifeline = Lifeline(
                config=cfg, control=self._control, joined=joined, address=self.address, counters=self.counters,
                planes=self._planes, channels=self._channels, linked_view=self._peers.linked_view,
                install=self._install, give_up=self._give_up, exclude=self._exclude,
                failed=lambda: self._failure is not None, publish=self._publish, tag=lambda: self.tag,
            )
            self._tasks.spawn(lifeline.watch(), "view watch")
            self._tasks.spawn(lifeline.heartbeat(), "heartbeat")
            self._started = True
            self._publish()
            await self._wait_for_view(lambda: self._planes.current is not None, cfg.rendezvous_timeout_s, (
                f"No view that includes the worker at {self.address} formed within {cfg.rendezvous_timeout_s:g} s "
                f"(coordinator {cfg.coordinator})."
            ))
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        """Leaves the world and releases every task, stream, channel, shared ring and the server.

        Collectives in flight may finish, and streams flush their last frames, for up to
        drain_timeout_s, one deadline over every plane held; then the worker leaves (one
        rpc_timeout_s) and everything is cut off.
        """
        if self._closed:
            return
        self._closed = True
        cfg = self.config
        self._planes.stop()
        self._publish()
        # Let collectives in flight finish and tell the peers we are done, then leave: the others
        # then see a graceful leave and their last collectives are not cut off. That holds for a
        # plane retired by a view change just before, too: its streams may still be flushing the
        # last frames their peers need.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(cfg.drain_timeout_s):
                await self._planes.wait_drained()
        lifeline = self._lifeline
        if not self._left:
            await self._leave()
        await self._tasks.close(cfg.rpc_timeout_s)
        await self._planes.close(RingChangedError(self._planes.latest_view, self._planes.latest_view,
                                                  "the worker shut down"))
        await self._channels.close()
        if self._control is not None:
            await self._control.close()
        if self._server is not None:
            await self._server.stop(0.5)
        self._peers.close()
        # The server holds our stream handler, and so us: drop both, so that gRPC's poller thread
        # can go as soon as the last channel and server are gone, without waiting for the GC.
        self._server = None
        self._control = None
        if lifeline is not None:
            self._lifeline = None
        if self._metrics is not None:
            self._metrics.close()
        if self._planes.timeline is not None:
            self._planes.timeline.close()

    async def __aenter__(self) -> Worker:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def set_timeline(self, timeline: Timeline | None) -> Timeline | None:
        """Makes the collectives started from now on write to ``timeline`` (None: to none), in this
        view and the next; returns the timeline it replaced, for the caller to close. A coroutine,
        so that the swap happens on the loop, between collectives. (ringserve.torch's start_timeline.)
        """
        previous, self._planes.timeline = self._planes.timeline, timeline
        if self._planes.current is not None:
            self._planes.current.timeline = timeline
        return previous

    # -- failures --------------------------------------------------------------------------

    def _fail(self, failure: RingserveError) -> None:
        """Makes every call, wait and collective fail with ``failure`` from now on."""
        if self._failure is not None:
            return
        self._failure = failure
        log.error("%s: %s", self.tag, failure)
        self._planes.stop(failure)
        self._publish()

    async def _give_up(self, view_id: int, exc: Exception) -> None:
        """A view could not be installed: fails whoever waits (start(), a collective) at once with
        the cause chained, and leaves, so that the others get a view without this worker instead
        of waiting for it until their deadlines."""
        failure = ViewInstallError(f"The worker at {self.address} could not install view {view_id}: {type(exc).__name__}: {exc}")
        failure.__cause__ = exc
        self._fail(failure)
        await self._leave()

    def _crashed(self, name: str, exc: BaseException) -> None:
        """A background task crashed (see tasks.py): the worker cannot go on, and leaves."""
        failure = WorkerFailedError(
            f"The {name} task of the worker at {self.address} crashed ({type(exc).__name__}: {exc}); "
            f"the worker left the world."
        )
        failure.__cause__ = exc
        self._fail(failure)
        if not self._closed:
            self._tasks.spawn(self._leave(), "leave")

    def _exclude(self, exc: ExcludedError) -> None:
        self._left = True  # the coordinator cannot be reached, and dropped this worker already
        self._fail(exc)

    async def _leave(self) -> None:
        if self._control is not None and self.worker_id:
            with contextlib.suppress(RingserveError):
                await self._control.leave(self.worker_id)
                self._left = True

    # -- where we are (any thread: from the published standing, see standing.py) ------------

    def _publish(self) -> None:
        current = self._planes.current
        lifeline = self._lifeline
        self._standing = Standing(
            running=self._started and not self._closed,
            place=current.place if current is not None else None,
            last=self._planes.last_place,
            latest_view=self._planes.latest_view,
            pending_workers=lifeline.pending_workers if lifeline is not None and current is not None else 0,
            pinned=self._pinned,
            failure=self._failure,
        )

    # -- calls from other threads, routed to the loop --------------------------------------

    def pin_view(self, view_id: int | None) -> None:
        """Makes collectives fail with RingChangedError once the current view is not ``view_id``.

        Elastic training pins the view its state was synced in: a rank that hears of a new view
        before its next collective must not start that collective in the new world while the
        others are restoring and syncing there (their collectives would never meet). None unpins.
        Callable from any thread; the pin holds once this returns.
        """
        on_loop(self._loop, self._pin, view_id, wait_s=self.config.rpc_timeout_s)

    def _pin(self, view_id: int | None) -> None:
        self._pinned = view_id
        self._publish()

    # -- the loop's side of views ----------------------------------------------------------

    def _install(self, view: cpb.View) -> None:
        if self._planes.install(view):
            if self._lifeline is not None:
                self._lifeline.pending_workers = 0
            self._publish()

    async def _wait_for_view(self, ready: Callable[[], bool], timeout_s: float, message: str) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not ready():
                    raise_failure(self._failure)
                    await self._planes.changed()
        except TimeoutError:
            raise RendezvousTimeoutError(message) from None
        raise_failure(self._failure)

    def _plane(self) -> Plane:
        """The plane collectives run on now: the current view's, checked against the pin."""
        if not self._started or self._closed:
            raise NotInitializedError("The worker is not running: call start() (or ringserve.init()) first.")
        raise_failure(self._failure)
        plane = self._planes.current
        if plane is None:
            latest = self._planes.latest_view
            raise RingChangedError(latest, latest, "this worker is not in the current view")
        if self._pinned is not None and plane.view_id != self._pinned:
            raise RingChangedError(self._pinned, plane.view_id, "the view moved on since the elastic state was synced")
        self._process_sets.enter(plane.view_id, plane.place.rank, plane.place.size)
        return plane

    def _report(self, view_id: int, suspect_rank: int, reason: str) -> None:
        """Tells the coordinator a peer looks dead, so it can confirm that fast (a probe)."""
        control = self._control
        if control is None or self._closed:
            return

        async def report() -> None:
            with contextlib.suppress(RingserveError):
                await control.report_failure(self.worker_id, view_id, suspect_rank, reason)

        self._tasks.spawn(report(), "failure report")

    def _make_channel(self, address: str) -> grpc.aio.Channel:
        return self._security.channel(address, channel_options(self.config.max_message_bytes))

    # -- parameter store -------------------------------------------------------------------

    async def put_params(self, key: str, data: bytes) -> int:
        """Stores a blob on the coordinator (initial parameters for joiners); returns its version."""
        assert self._control is not None
        return await self._control.put_params(key, data)

    async def get_params(self, key: str) -> bytes:
        assert self._control is not None
        return await self._control.get_params(key)
