"""The Worker: its peer server, its membership (join, heartbeats, view watch), and one ring session
per view that the collectives run on. Everything lives on the event loop that started it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ringserve import _malloc, wire
from ringserve._proto import coordinator_pb2 as cpb
from ringserve._proto import peer_pb2
from ringserve.commits import Commit, Mark, Seen
from ringserve.config import WorkerConfig
from ringserve.errors import (
    ExcludedError,
    InvalidArgumentError,
    NotInitializedError,
    PeerUnavailableError,
    ProtocolError,
    RendezvousTimeoutError,
    RingChangedError,
    RingserveError,
    ViewInstallError,
)
from ringserve.observe import Counters, Timeline
from ringserve.ring import predecessor, successor
from ringserve.security import Security
from ringserve.transport import channel_options, server_options
from ringserve.worker import adasum, collectives, exclusion, grouped, shared, sighting
from ringserve.worker import join as joining
from ringserve.worker.control import ControlClient
from ringserve.worker.gate import StreamGate
from ringserve.worker.reports import CommitReports
from ringserve.worker.session import Place, Received, Session
from ringserve.worker.shared import InboundRing, OutboundRing

log = logging.getLogger("ringserve.worker")

PEER_SERVICE = "ringserve.v1.Peer"


class Worker:
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
        self._server: grpc.aio.Server | None = None
        self._control: ControlClient | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._session: Session | None = None
        self._last_place: Place | None = None
        self._retired: list[Session] = []
        self._latest_view = 0
        self._early: dict[int, list[tuple[wire.FrameHeader, Received]]] = {}
        self._view_changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeat_interval_s = 1.0
        self._started = False
        self._closed = False
        self._timeline: Timeline | None = None
        self._metrics: Any = None
        self._reports: set[asyncio.Task[None]] = set()
        self.pending_workers = 0
        self._pinned: int | None = None
        self._security = Security()
        # Why this worker could not take its place in a view (see _give_up); set, it has left.
        self._failure: ViewInstallError | None = None
        self._left = False
        self._gate = StreamGate(cap=config.max_unverified_streams, deadline_s=config.peer_hello_timeout_s)
        # Streams open from a (view, sender rank): a heartbeat says the ring link into us is up.
        self._inbound: dict[tuple[int, int], int] = {}
        self._heartbeat_timeout_s = 5.0
        self._heard_at = 0.0  # when the last heartbeat that the coordinator answered was sent
        self._excluded: ExcludedError | None = None
        # The commit this worker's elastic state holds once synced, reported with heartbeats (see
        # worker/reports.py), and the job's mark from the last heartbeat answer (a fallback when
        # the coordinator cannot be asked at a sync).
        self._held = CommitReports()
        self._heard_mark: Commit | None = None
        self._heartbeat_now = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set at the commit where this worker leaves (elastic, SIGTERM): the coordinator drops it
        # then (see admit_waiting), and a heartbeat answered "unknown" must not make it rejoin.
        self.leaving = False

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
        self._security = Security.load(cfg)
        server = grpc.aio.server(
            options=server_options(cfg.max_message_bytes, idle_timeout_s=cfg.peer_idle_timeout_s,
                                   handshake_timeout_s=cfg.peer_hello_timeout_s),
            interceptors=self._security.server_interceptors(),
            maximum_concurrent_rpcs=cfg.server_rpc_cap,
        )
        handler = grpc.stream_unary_rpc_method_handler(
            self._on_stream, response_serializer=peer_pb2.StreamSummary.SerializeToString
        )
        latest = grpc.unary_unary_rpc_method_handler(
            self._on_latest, request_deserializer=peer_pb2.LatestRequest.FromString,
            response_serializer=peer_pb2.LatestView.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(PEER_SERVICE, {"Stream": handler, "Latest": latest})]
        )
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
            self._heartbeat_interval_s = joined.heartbeat_interval_s
            self._heartbeat_timeout_s = joined.heartbeat_timeout_s
            self._heard_at = asyncio.get_running_loop().time()
            if cfg.metrics_port >= 0:
                from ringserve.metrics import MetricsServer, WorkerCollector

                self._metrics = MetricsServer(WorkerCollector(self.counters, self._labels), cfg.bind_host, cfg.metrics_port)
            loop = self._loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._watch_loop(), name="ringserve-watch"),
                loop.create_task(self._heartbeat_loop(), name="ringserve-heartbeat"),
            ]
            self._started = True
            await self._wait_for_view(cfg.rendezvous_timeout_s)
        except BaseException:
            await self.close()
            raise
        return self

    async def _wait_for_view(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while self._session is None:
                    self._raise_failure()
                    await self._view_changed.wait()
        except TimeoutError:
            raise RendezvousTimeoutError(
                f"No view that includes the worker at {self.address} formed within {timeout_s:g} s "
                f"(coordinator {self.config.coordinator})."
            ) from None

    async def close(self) -> None:
        """Leaves the world and releases every task, stream, channel and the server."""
        if self._closed:
            return
        self._closed = True
        session, self._session = self._session, None
        self._last_place = None
        if session is not None:
            session.retire(RingChangedError(session.view_id, session.view_id, "the worker shut down"))
            self._retired.append(session)
        # Let collectives in flight finish and tell the successors we are done, then leave: the
        # others then see a graceful leave and their last collectives are not cut off. That holds
        # for a session retired by a view change just before, too: its stream may still be
        # flushing the last frames its successor needs.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.drain_timeout_s):
                for retired in self._retired:
                    await retired.wait_closed()
        if self._control is not None and self.worker_id and not self._left:
            with contextlib.suppress(RingserveError):
                await self._control.leave(self.worker_id)
        for task in [*self._tasks, *self._reports]:
            task.cancel()
        for task in [*self._tasks, *self._reports]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for session in self._retired:
            session.close(RingChangedError(session.view_id, self._latest_view, "the worker shut down"))
            await session.wait_closed()
        self._retired.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self._control is not None:
            await self._control.close()
        if self._server is not None:
            await self._server.stop(0.5)
        # The server holds our stream handler, and so us: drop both, so that gRPC's poller thread
        # can go as soon as the last channel and server are gone, without waiting for the GC.
        self._server = None
        self._control = None
        if self._metrics is not None:
            self._metrics.close()
        if self._timeline is not None:
            self._timeline.close()

    async def set_timeline(self, timeline: Timeline | None) -> Timeline | None:
        """Makes the collectives started from now on write to ``timeline`` (None: to none), in this
        view and the next; returns the timeline it replaced, for the caller to close. A coroutine,
        so that the swap happens on the loop, between collectives. (ringserve.torch's start_timeline.)
        """
        previous, self._timeline = self._timeline, timeline
        if self._session is not None:
            self._session.timeline = timeline
        return previous

    async def __aenter__(self) -> Worker:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- where we are ----------------------------------------------------------------------

    def _place(self) -> Place:
        if not self._started or self._closed:
            raise NotInitializedError("The worker is not running: call start() (or ringserve.init()) first.")
        self._raise_failure()
        if self._session is None:
            raise RingChangedError(self._latest_view, self._latest_view, "this worker is not in the current view")
        return self._session.place

    def _known_place(self) -> Place:
        """The current place, else the last one this worker held.

        Like Horovod's, rank() and size() keep answering after a peer shut down (a job's last
        print) and until the next view: only collectives need the worker in the current view.
        """
        if self._session is None and self._last_place is not None:
            return self._last_place
        return self._place()

    def _labels(self) -> tuple[int, int]:
        session = self._session
        return (session.place.rank, session.view_id) if session is not None else (-1, self._latest_view)

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this worker, when metrics_port is set."""
        return self._metrics.url if self._metrics is not None else None

    @property
    def rank(self) -> int:
        return self._known_place().rank

    @property
    def size(self) -> int:
        return self._known_place().size

    @property
    def local_rank(self) -> int:
        return self._known_place().local_rank

    @property
    def local_size(self) -> int:
        return self._known_place().local_size

    @property
    def cross_rank(self) -> int:
        return self._known_place().cross_rank

    @property
    def cross_size(self) -> int:
        return self._known_place().cross_size

    @property
    def view_id(self) -> int:
        return self._place().view_id

    # -- collectives -----------------------------------------------------------------------

    def _ring(self) -> Session:
        self._place()
        assert self._session is not None
        if self._pinned is not None and self._session.view_id != self._pinned:
            raise RingChangedError(self._pinned, self._session.view_id, "the view moved on since the elastic state was synced")
        return self._session

    @property
    def tag(self) -> str:
        """"rank R view V" (or "worker ADDRESS view V" outside any view), for log lines."""
        session = self._session
        if session is not None:
            return f"rank {session.place.rank} view {session.view_id}"
        return f"worker {self.address} view {self._latest_view}"

    @property
    def running_view(self) -> int:
        """The view collectives run in: the pinned one, else the current one (0 if none)."""
        if self._pinned is not None:
            return self._pinned
        return self._session.view_id if self._session is not None else 0

    def pin_view(self, view_id: int | None) -> None:
        """Makes collectives fail with RingChangedError once the current view is not ``view_id``.

        Elastic training pins the view its state was synced in: a rank that hears of a new view
        before its next collective must not start that collective in the new world while the
        others are restoring and syncing there (their collectives would never meet). None unpins.
        """
        self._pinned = view_id

    def _opts(self) -> dict[str, Any]:
        return {"chunk_bytes": self.config.chunk_bytes, "timeout_s": self.config.collective_timeout_s}

    async def allreduce(
        self,
        a: Any,
        op: str = "average",
        name: str | None = None,
        out: np.ndarray | None = None,
        *,
        compression: str | None = None,
        residual: np.ndarray | None = None,
        check_finite: bool = False,
        parts: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Reduces ``a`` across ranks; returns a new array of a's shape and dtype on every rank.

        With ``out`` (an array of a's shape and dtype, or ``a`` itself) the result is written
        there instead, and no result buffer is allocated. ``compression`` ("fp16", "bf16" or
        "int8") packs floating point chunks on the wire and adds in float32 (see
        ringserve.codecs for each codec's error bound). ``residual``, a float32 array of a's size
        (float64 for float64), turns on error feedback: it is added to ``a`` and then replaced by
        what this rank's encodings lost; keep it from call to call. ``check_finite`` raises
        NonFiniteError on every rank when the result holds NaN or Inf.

        ``op="adasum"``: Adasum (see worker/adasum.py) of floating point arrays, on a world whose
        size is a power of two, without compression or residual; ``parts`` (element counts that
        tile ``a``) gives each tensor fused in ``a`` its own coefficients, as Horovod does.
        """
        if op == "adasum":
            if compression is not None or residual is not None:
                raise InvalidArgumentError("op adasum takes no compression and no residual.")
            result = await adasum.allreduce(self._ring(), a, name=name, out=out,
                                            parts=None if parts is None else list(parts), **self._opts())
            if check_finite and not np.isfinite(result).all():
                raise collectives._non_finite_error(name or "adasum")
            return result
        if parts is not None:
            raise InvalidArgumentError("parts is for op adasum only.")
        return await collectives.allreduce(self._ring(), a, op=op, name=name, out=out, compression=compression,
                                           residual=residual, check_finite=check_finite, **self._opts())

    async def broadcast(self, a: Any, root: int = 0, name: str | None = None) -> np.ndarray:
        """Returns root's ``a`` on every rank; every rank passes an array of the same shape and dtype."""
        return await collectives.broadcast(self._ring(), a, root=root, name=name, **self._opts())

    async def allgather(self, a: Any, name: str | None = None) -> np.ndarray:
        """Concatenates every rank's ``a`` along axis 0, in rank order (first dimensions may differ)."""
        return await collectives.allgather(self._ring(), a, name=name, **self._opts())

    async def reduce_scatter(
        self, a: Any, op: str = "average", name: str | None = None, *, compression: str | None = None
    ) -> np.ndarray:
        """Reduces ``a`` and returns this rank's part along axis 0 (the first ranks get a row more)."""
        return await collectives.reduce_scatter(self._ring(), a, op=op, name=name, compression=compression,
                                                **self._opts())

    async def alltoall(self, a: Any, splits: Any = None, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Sends ``splits[d]`` rows of ``a`` to rank d (an even split of axis 0 without splits);
        returns the rows every rank sent this one, in rank order, and how many came from each."""
        return await collectives.alltoall(self._ring(), a, splits=splits, name=name, **self._opts())

    async def grouped_allgather(self, arrays: Sequence[Any], name: str | None = None) -> list[np.ndarray]:
        """allgather of each array of a list, in one collective."""
        return await grouped.grouped_allgather(self._ring(), list(arrays), name=name, **self._opts())

    async def grouped_reduce_scatter(self, arrays: Sequence[Any], op: str = "average", name: str | None = None, *,
                                     compression: str | None | list[str | None] = None) -> list[np.ndarray]:
        """reduce_scatter of each array of a list, in one collective per dtype (and codec: one for
        every floating point array, or one per array)."""
        return await grouped.grouped_reduce_scatter(self._ring(), list(arrays), op=op, name=name,
                                                    compression=compression, **self._opts())

    async def join(self) -> int:
        """Horovod's join for uneven data: until every rank has joined, this rank takes part in the
        others' allreduces with zeros (and refuses their other collectives, as Horovod does; see
        join.py); returns the rank that joined last, the same on every rank."""
        return await joining.join(self._ring(), chunk_bytes=self.config.chunk_bytes,
                               timeout_s=self.config.collective_timeout_s, join_timeout_s=self.config.join_timeout_s)

    async def barrier(self) -> None:
        """Returns once every rank has called barrier."""
        await collectives.barrier(self._ring(), timeout_s=self.config.collective_timeout_s)

    async def broadcast_object(self, obj: object = None, root: int = 0, name: str | None = None) -> object:
        """Returns root's picklable ``obj`` on every rank. Objects travel only between the view's peers."""
        return await collectives.broadcast_object(self._ring(), obj, root=root, name=name, **self._opts())

    async def allgather_object(self, obj: object, name: str | None = None) -> list[object]:
        """Returns every rank's picklable ``obj`` in rank order."""
        return await collectives.allgather_object(self._ring(), obj, name=name, **self._opts())

    # -- parameter store -------------------------------------------------------------------

    async def put_params(self, key: str, data: bytes) -> int:
        """Stores a blob on the coordinator (initial parameters for joiners); returns its version."""
        assert self._control is not None
        return await self._control.put_params(key, data)

    async def get_params(self, key: str) -> bytes:
        assert self._control is not None
        return await self._control.get_params(key)

    # -- data plane ------------------------------------------------------------------------

    async def _on_stream(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> peer_pb2.StreamSummary:
        # Streams that have proved nothing are bounded in number and in time (see gate.py).
        admitted = self._gate.enter()
        frames = 0
        ring: InboundRing | None = None
        offered = False  # the HELLO offers a shared ring, not mapped until the sender is verified
        clean = False
        try:
            async with asyncio.timeout(self._gate.deadline_s) as admitted.deadline:
                async for raw in request_iterator:
                    header, payload = wire.decode(raw)
                    frames += 1
                    hello = admitted.hello
                    if hello is None:
                        if header.kind != wire.HELLO:
                            raise ProtocolError("A peer stream must open with a HELLO frame.")
                        admitted.hello = header
                        link = (header.view_id, header.sender_rank)
                        self._inbound[link] = self._inbound.get(link, 0) + 1
                        offered = header.HasField("shared_ring") and self.config.shared_memory
                        # Checked at once where the view is known (else when it is installed, see
                        # _install): an impostor is refused before it can pass for the predecessor.
                        session = self._session_of(header.view_id)
                        if session is not None:
                            session.check_sender(header)
                            self._gate.verify(admitted)
                        continue
                    if header.view_id != hello.view_id:
                        raise ProtocolError(
                            f"A stream opened for view {hello.view_id} carried a frame of view {header.view_id}."
                        )
                    if header.kind == wire.BYE:
                        clean = True
                        continue
                    if offered and admitted.verified:
                        # The first frame from a verified predecessor maps its ring; until the echo
                        # reaches the sender, its payloads come in the frames.
                        ring, offered = InboundRing.attach(hello.shared_ring), False
                    if header.HasField("shm_slot"):
                        if ring is None:
                            raise ProtocolError("A frame names a slot of a shared ring that this stream never set up.")
                        payload = ring.payload(header)
                    self._route(hello, Received(header, payload, raw))
        except ProtocolError as exc:
            log.warning("%s: rejected a peer stream: %s", self.tag, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError:
            if admitted.evicted:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                    f"The peer server of {self.tag} holds {self._gate.cap} streams whose HELLO is not verified "
                    "(max_unverified_streams); this one, the oldest, was ended to make room."
                ))
            what = "sent no HELLO" if admitted.hello is None else (
                f"sent a HELLO (view {admitted.hello.view_id}, rank {admitted.hello.sender_rank}) "
                "that no view of this worker verified"
            )
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, (
                f"The peer stream {what} within {self._gate.deadline_s:g} s (peer_hello_timeout_s) and was ended."
            ))
        finally:
            if ring is not None:
                ring.close()  # unmapped once the collectives are done with its payloads
            self._gate.leave(admitted)
            if admitted.hello is not None:
                link = (admitted.hello.view_id, admitted.hello.sender_rank)
                if self._inbound.get(link, 0) > 1:
                    self._inbound[link] -= 1
                else:
                    self._inbound.pop(link, None)
            # Only the real predecessor's stream ending says anything about the ring.
            if admitted.verified and admitted.hello is not None:
                self._predecessor_gone(admitted.hello, clean)
        return peer_pb2.StreamSummary(frames=frames)

    async def _on_latest(self, request: peer_pb2.LatestRequest, context: grpc.aio.ServicerContext) -> peer_pb2.LatestView:
        return peer_pb2.LatestView(view_id=self._latest_view, worker_id=self.worker_id)

    def _linked_view(self) -> int:
        """The current view if the stream from our ring predecessor in it has reached us, else 0."""
        session = self._session
        if session is None:
            return 0
        place = session.place
        if place.size == 1 or (place.view_id, predecessor(place.rank, place.size)) in self._inbound:
            return place.view_id
        return 0

    def _predecessor_gone(self, hello: wire.FrameHeader, clean: bool) -> None:
        for session in [self._session, *self._retired]:
            if session is None or session.view_id != hello.view_id:
                continue
            if session.retired is not None:
                session.predecessor_gone(session.retired)
                continue
            how = "ended" if clean else "broke"
            session.predecessor_gone(PeerUnavailableError(
                f"The stream from rank {hello.sender_rank} of view {hello.view_id} {how}."
            ))
            if not clean:
                self._report(session.view_id, hello.sender_rank, f"its stream to rank {session.place.rank} broke")

    def _report(self, view_id: int, suspect_rank: int, reason: str) -> None:
        """Tells the coordinator a peer looks dead, so it can confirm that fast (a probe)."""
        if self._control is None or self._closed:
            return
        control = self._control

        async def report() -> None:
            with contextlib.suppress(RingserveError):
                await control.report_failure(self.worker_id, view_id, suspect_rank, reason)

        task = asyncio.get_running_loop().create_task(report(), name="ringserve-report")
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _session_of(self, view_id: int) -> Session | None:
        session = self._session
        if session is not None and session.view_id == view_id:
            return session
        return next((s for s in self._retired if s.view_id == view_id and s.error is None), None)

    def _sender_checks(self, hello: wire.FrameHeader) -> bool:
        session = self._session_of(hello.view_id)
        if session is None:
            return False
        try:
            session.check_sender(hello)
        except ProtocolError:
            return False
        return True

    def _route(self, hello: wire.FrameHeader, frame: Received) -> None:
        view_id = hello.view_id
        session = self._session_of(view_id)
        if session is not None:
            session.check_sender(hello)
            session.on_frame(frame)
        elif view_id > self._latest_view:
            # The predecessor heard of the new view before we did: keep its frames until we do.
            self._early.setdefault(view_id, []).append((hello, frame))
        else:
            self.counters.frames_rejected += 1

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._security.channel(
                address, channel_options(self.config.max_message_bytes)
            )
        return channel

    # -- membership ------------------------------------------------------------------------

    def _install(self, view: cpb.View) -> None:
        if view.view_id <= self._latest_view or self._closed or self._excluded is not None:
            return
        old = self._session
        self._latest_view = view.view_id
        mine = [m for m in view.members if m.worker_id == self.worker_id]
        self.pending_workers = 0
        if old is not None:
            self.counters.view_changes += 1
            exc = RingChangedError(old.view_id, view.view_id)
            if view.failed_worker_ids:
                old.close(exc)
                # Older views still draining may wait on the failed worker too: end them as well.
                for retired in self._retired:
                    retired.close(exc)
            else:
                # Members only joined or left gracefully: the old ring is intact, so collectives
                # already in flight on it may finish (a leaver drains its part before it leaves).
                old.retire(exc)
                # A predecessor that left had sent all it ever will (it drains, then leaves), or
                # never opened its stream in that view at all: waiting for more is waiting forever.
                # A view with no members (the world fell below min_workers) names no one: only the
                # workers listed as leaving are gone, the others are still draining their streams.
                ids = old.place.worker_ids
                remaining = {m.worker_id for m in view.members}
                before_rank = predecessor(old.place.rank, old.place.size)
                before = ids[before_rank] if ids else None
                # Unless its stream is still open: a leaver let go at a commit (elastic.py names it in
                # the admit) is dropped before it drains, and its last frames may still be on the way;
                # that stream's end starves the waits instead (_predecessor_gone).
                draining = (old.view_id, before_rank) in self._inbound
                if before is not None and not draining and (before in view.left_worker_ids or (remaining and before not in remaining)):
                    old.predecessor_gone(exc)
            self._retired.append(old)
        self._session = None
        if mine:
            me = mine[0]
            addresses = tuple(m.address for m in view.members)
            place = Place(
                view_id=view.view_id, rank=me.rank, size=len(addresses), addresses=addresses,
                worker_ids=tuple(m.worker_id for m in view.members),
                local_rank=me.local_rank, local_size=me.local_size,
                cross_rank=me.cross_rank, cross_size=me.cross_size,
            )
            nxt = addresses[successor(me.rank, place.size)]
            channel = self._channel(nxt) if place.size > 1 else None
            if self.config.timeline and self._timeline is None:
                self._timeline = Timeline(Timeline.path_for(self.config.timeline, me.rank), me.rank)
            self._last_place = place
            self._session = Session(
                place, channel, self.counters, self.config.abort_grace_s, self.config.drain_timeout_s,
                timeline=self._timeline, on_peer_failure=self._report, checksum=self.config.checksum,
                ring=self._outbound_ring(place),
            )
            log.info("%s: joined as rank %d of %d (peer server %s)", self.tag, me.rank, place.size, self.address)
        for vid in [v for v in self._early if v <= view.view_id]:
            frames = self._early.pop(vid)
            if self._session is not None and vid == view.view_id:
                for hello, frame in frames:
                    try:
                        self._session.check_sender(hello)
                        self._session.on_frame(frame)
                    except ProtocolError as exc:
                        log.warning("%s: dropped a held frame: %s", self.tag, exc)
                        self.counters.frames_rejected += 1
            else:
                self.counters.frames_rejected += len(frames)
        # Streams that said HELLO for this view before we knew it are the ring's: let them in.
        self._gate.verify_where(self._sender_checks)
        self._view_changed.set()
        self._view_changed = asyncio.Event()

    def _outbound_ring(self, place: Place) -> OutboundRing | None:
        """A shared-memory ring to offer this view's successor, if it may be on this host."""
        if not self.config.shared_memory or place.size == 1 or not shared.supported():
            return None
        try:
            return OutboundRing(self.config.shared_slots, self.config.chunk_bytes)
        except OSError as exc:  # no memfd (a seccomp profile), or out of fds
            log.info("%s: no shared-memory ring (%s); payloads travel over the stream", self.tag, exc)
            return None

    async def _watch_loop(self) -> None:
        assert self._control is not None
        backoff = 0.05
        while True:
            try:
                async for view in self._control.watch(self.worker_id):
                    try:
                        self._install(view)
                    except Exception as exc:  # noqa: BLE001 - whatever it is, the worker cannot go on
                        await self._give_up(view.view_id, exc)
                        return
                    backoff = 0.05
            except RingserveError as exc:  # the coordinator is away: watch again
                log.warning("%s: view watch broke: %s", self.tag, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
            await self._drain_retired()

    async def _give_up(self, view_id: int, exc: Exception) -> None:
        """A view could not be installed: fails whoever waits (start(), a collective) at once with
        the cause chained, and leaves, so that the others get a view without this worker instead
        of waiting for it until their deadlines."""
        failure = ViewInstallError(f"The worker at {self.address} could not install view {view_id}: {type(exc).__name__}: {exc}")
        failure.__cause__ = exc
        self._failure = failure
        log.error("%s: %s; leaving the world", self.tag, failure)
        session, self._session = self._session, None
        for s in [session, *self._retired]:
            if s is not None:
                s.close(failure)
        self._view_changed.set()
        self._view_changed = asyncio.Event()
        assert self._control is not None
        with contextlib.suppress(RingserveError):
            await self._control.leave(self.worker_id)
            self._left = True

    def _raise_failure(self) -> None:
        if self._excluded is not None:
            raise self._excluded
        if self._failure is not None:
            # A new error each time, so that tracebacks do not pile up on one object.
            raise ViewInstallError(*self._failure.args) from self._failure.__cause__

    async def _drain_retired(self) -> None:
        """Forgets the retired sessions whose streams have ended, and closes the channels that no
        session streams on any more (peers that left, or that are no longer this rank's successor)."""
        done = [s for s in self._retired if s.drained]
        for session in done:
            await session.wait_closed()
            self._retired.remove(session)
        sessions = [s for s in (self._session, *self._retired) if s is not None and s.place.size > 1]
        in_use = {s.successor_address for s in sessions}
        for address in [a for a in self._channels if a not in in_use]:
            await self._channels.pop(address).close()

    async def _heartbeat_loop(self) -> None:
        assert self._control is not None
        while self._failure is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._heartbeat_interval_s):
                    await self._heartbeat_now.wait()
            self._heartbeat_now.clear()
            c = self.counters
            counters = cpb.WorkerCounters(
                collectives_done=c.collectives_done, bytes_sent=c.bytes_sent, bytes_received=c.bytes_received
            )
            session = self._session
            view_id = session.view_id if session is not None else 0
            stalled = session.stalled(self.config.stall_warning_s) if session is not None else []
            sent_at = asyncio.get_running_loop().time()
            committed, committed_view = self._held.committed, self._held.view
            try:
                answer = await self._control.heartbeat(
                    self.worker_id, view_id, counters, stalled, self._linked_view(), committed, committed_view
                )
            except RingserveError as exc:
                self._held.failed()
                self.counters.heartbeats_missed += 1
                log.warning("%s: heartbeat failed: %s", self.tag, exc)
                if await self._excluded_now():
                    return
                continue
            self._heard_at = sent_at
            self._heartbeat_interval_s = answer.heartbeat_interval_s or self._heartbeat_interval_s
            self._held.answered(committed, answer.known)
            # Counted against the view the answer is about: stale news of joiners already admitted
            # must not make a commit wait for a view that never comes.
            current = self._session.view_id if self._session is not None else 0
            self.pending_workers = answer.pending_workers if answer.view_id == current else 0
            if answer.HasField("mark_step"):
                self._heard_mark = max(self._heard_mark or Commit(0, 0), Commit(answer.mark_lineage, answer.mark_step))
            for warning in answer.stall_warnings:
                self.counters.stall_warnings += 1
                log.warning("%s: stalled collective %s", self.tag, warning)
            if not answer.known and self._failure is None and not self.leaving:  # one that gave up or leaves stays out
                await self._rejoin()
            await self._drain_retired()

    async def _excluded_now(self) -> bool:
        """After a heartbeat timeout without the coordinator: whether the peers went on without us.

        If they did, every collective of this worker fails with ExcludedError from now on (see
        ringserve.worker.exclusion), and so does a wait for a view.
        """
        silent_s = asyncio.get_running_loop().time() - self._heard_at
        place = self._last_place
        if place is None or place.size == 1 or not exclusion.must_ask(silent_s, self._heartbeat_timeout_s):
            return False
        peers = [a for r, a in enumerate(place.addresses) if r != place.rank]
        views = await exclusion.peer_views(peers, self._channel, self.config.rpc_timeout_s)
        # Against the last view we were in, not the newest we heard of: the view that dropped us
        # may have reached us before the coordinator's route went.
        newer = exclusion.excluded(place.view_id, views)
        if not newer:
            return False
        exc = ExcludedError(self.address, self.config.coordinator, silent_s, newer, place.view_id)
        log.error("%s: %s", self.tag, exc)
        self._excluded = exc
        for session in [self._session, *self._retired]:
            if session is not None:
                session.close(exc)
        self._view_changed.set()
        self._view_changed = asyncio.Event()
        return True

    async def _rejoin(self) -> None:
        """Registers again under the same id, claiming the view we run in (after a coordinator
        restart, or after being declared dead while stopped)."""
        assert self._control is not None
        session = self._session
        claim = {}
        if session is not None:
            claim = {"view_id": session.view_id, "rank": session.place.rank, "view_size": session.place.size}
        log.warning("%s: the coordinator does not know this worker; rejoining with %s", self.tag, claim or "no view")
        try:
            joined = await self._control.join(
                address=self.address, hostname=self.config.hostname, rank_hint=self.config.rank_hint,
                worker_id=self.worker_id, **claim,
            )
            self._heartbeat_timeout_s = joined.heartbeat_timeout_s
        except RingserveError as exc:
            log.warning("%s: rejoin failed: %s", self.tag, exc)

    # -- elastic support -------------------------------------------------------------------

    async def wait_for_view(self, newer_than: int, timeout_s: float) -> int:
        """Waits until this worker is in a view numbered above ``newer_than``; returns its id.

        Raises:
            RendezvousTimeoutError: no such view within timeout_s.
            ViewInstallError: a view could not be installed, and the worker left.
        """
        try:
            async with asyncio.timeout(timeout_s):
                while self._session is None or self._session.view_id <= newer_than:
                    self._raise_failure()
                    await self._view_changed.wait()
        except TimeoutError:
            raise RendezvousTimeoutError(
                f"The worker at {self.address} was in no view newer than {newer_than} within {timeout_s:g} s."
            ) from None
        return self._session.view_id

    @property
    def latest_view(self) -> int:
        """The newest view this worker has heard of (it may not be a member)."""
        return self._latest_view

    @property
    def committed(self) -> Commit | None:
        """The commit this worker's elastic state holds (None before its first sync)."""
        return self._held.committed

    def report_committed(self, commit: Commit, *, now: bool = False, view: int = 0) -> None:
        """Sets the commit this worker's elastic state holds, reported with the next heartbeat;
        ``view``: the view every member of which holds it (a commit-time allreduce in it finished).

        ``now`` sends that heartbeat at once: at a sync, and at a commit where the world changes,
        the coordinator must know who holds what before the new view's members are admitted
        with nothing (callable from any thread).
        """
        self._held.hold(commit, view)
        if now and self._loop is not None and not self._closed:
            self._loop.call_soon_threadsafe(self._heartbeat_now.set)

    async def wait_reported(self, commit: Commit, timeout_s: float) -> bool:
        """Whether the coordinator has recorded ``commit``, waiting up to timeout_s (see
        worker/reports.py: not at all while the coordinator does not answer)."""
        return await self._held.wait(commit, timeout_s)

    async def commit_mark(self) -> Mark:
        """The job's committed high-water mark, asked of the coordinator now.

        When the coordinator cannot answer within rpc_timeout_s (it is restarting), the mark its
        last heartbeat answer carried, without holders, and a warning: a sync must not wait on
        the coordinator, and that mark is at most a heartbeat old.
        """
        assert self._control is not None
        try:
            return await self._control.commit_mark(self.worker_id)
        except RingserveError as exc:
            log.warning("%s: could not ask the coordinator for the job's last commit (%s); using %s from a heartbeat",
                        self.tag, exc, self._heard_mark or "none")
            return Mark(self._heard_mark)

    async def admit_waiting(self, leaving: Sequence[str] = (), view_id: int = 0) -> int:
        """Asks the coordinator to admit the workers waiting to join (call at a commit boundary),
        and to let the members named in ``leaving`` (worker ids) go in that same view. ``view_id``:
        the view of that commit (0: the current one); the coordinator ignores a request of an older one.

        Returns:
            How many the next view adds. A new view comes either way (with the same members if
            nobody is waiting any more), so every rank that waits for a newer view gets one.
        """
        assert self._control is not None
        return await self._control.admit(self.worker_id, view_id or self.view_id, leaving)

    @property
    def heartbeat_interval_s(self) -> float:
        """The heartbeat interval the coordinator gave this worker."""
        return self._heartbeat_interval_s

    async def sight(self, worker_id: str, address: str) -> Seen:
        """Whether the worker ``worker_id`` still listens at ``address`` (ringserve.worker.sighting),
        within a heartbeat interval: a worker that cannot answer in one cannot heartbeat either."""
        timeout = min(self.config.rpc_timeout_s, self._heartbeat_interval_s)
        options = channel_options(self.config.max_message_bytes)
        return await sighting.sight(worker_id, address, lambda a: self._security.channel(a, options), timeout)
