"""Coordinator lifecycle: the gRPC server, the health service and the deadline ticker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ringserve import _malloc
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.config import CoordinatorConfig
from ringserve.coordinator import membership
from ringserve.coordinator.service import PARAM_CHUNK_BYTES, CoordinatorService
from ringserve.coordinator.views import view_bytes
from ringserve.security import Security
from ringserve.transport import MAX_STREAMS_PER_CONNECTION, server_options

if TYPE_CHECKING:
    from ringserve.coordinator.http import StatusPage
    from ringserve.metrics import MetricsServer

log = logging.getLogger("ringserve.coordinator")

SERVICE_NAME = "ringserve.v1.Coordinator"
# With release_memory: the heap's free pages go back to the system this often, and as soon as
# this many parameter bytes were given up (a malloc_trim costs some 6 ms of the loop).
TRIM_EVERY_S = 10.0
TRIM_AFTER_FREED_BYTES = 16 << 20


def coordinator_server_options(config: CoordinatorConfig) -> list[tuple[str, int]]:
    """The shared server options, and the connection limits of a server facing thousands of
    clients, some hostile.

    No ``grpc.max_connection_age_ms``: it would end every connection at that age, and with it a
    worker's WatchView stream, which must last the job. Idleness in gRPC means no RPC in flight,
    so a worker, whose WatchView stream is always open, is never idle; an idle connection that is
    closed costs a real client only a reconnect on its next call.
    """
    options = dict(server_options(config.max_message_bytes))
    # The data plane's window (four messages) would let each of thousands of streams park up to
    # 256 MiB in gRPC's buffers, outside every cap; parameter chunks are 1 MiB.
    options["grpc.http2.lookahead_bytes"] = 4 * PARAM_CHUNK_BYTES
    options["grpc.max_concurrent_streams"] = connection_stream_cap(config)
    # What a coordinator receives is small: a parameter chunk is 1 MiB, everything else a few KiB.
    # A 100 MB message under the 64 MiB send cap was read whole before it was refused, and left the
    # process 150 MiB larger (benchmarks/hostile_memory.py).
    options["grpc.max_receive_message_length"] = min(config.max_message_bytes, MAX_RECEIVE_BYTES)
    return [
        *options.items(),
        ("grpc.max_connection_idle_ms", int(config.idle_connection_s * 1000)),
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000)),
        # Calls that arrived before the Python server asked for them wait in gRPC's core. Past
        # 1,000 of them (its default) it cancels new ones: 2,000 workers joining at once lost
        # about a hundred joins to that. The concurrency cap bounds them instead (when it is
        # the larger; a cap below gRPC's defaults must not turn its refusals into cancels).
        ("grpc.server.max_pending_requests", max(1000, config.max_concurrent_rpcs)),
        ("grpc.server.max_pending_requests_hard_limit", max(3000, config.max_concurrent_rpcs)),
    ]


# The largest message a coordinator takes: four parameter chunks' worth.
MAX_RECEIVE_BYTES = 4 * PARAM_CHUNK_BYTES


def connection_stream_cap(config: CoordinatorConfig) -> int:
    """The HTTP/2 streams one connection may hold open on the coordinator: twice max_concurrent_rpcs.

    The coordinator's limits are its named caps (max_watch_streams, max_heartbeat_streams,
    max_concurrent_rpcs, all connections together), each refused with RESOURCE_EXHAUSTED. The
    transport's own limit per connection (256 for the workers' servers) must not bite first: a
    client that multiplexes its calls (gRPC in most languages shares one connection per process)
    and holds some 250 WatchView streams on it got 20% of its unary Heartbeat calls refused with
    REFUSED_STREAM, an HTTP/2 refusal that names nothing. gRPC refuses a new stream once the
    streams it still holds for a connection pass the limit, and it holds a finished call's stream
    a while after the client has counted it free, so near the limit even a client that keeps
    within it is refused; twice the RPC cap leaves that lag room, and the caps answer first.
    """
    return max(MAX_STREAMS_PER_CONNECTION, 2 * config.max_concurrent_rpcs)


class _Handlers:
    """Stands in for the server while the generated code registers the servicer, so that the
    handlers can be changed before they reach the real one."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = dict(handlers)


def _add_service(service: CoordinatorService, server: grpc.aio.Server) -> None:
    """The generated registration, except that WatchView sends views as the bytes encoded once
    per view (one serialization for 2,000 watchers instead of 2,000)."""
    captured = _Handlers()
    pb_grpc.add_CoordinatorServicer_to_server(service, captured)
    handlers = captured.handlers
    handlers["WatchView"] = handlers["WatchView"]._replace(response_serializer=view_bytes)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class Coordinator:
    """A coordinator on its own gRPC server, in the running event loop.

    Example:
        ```python
        async with Coordinator(CoordinatorConfig(min_workers=2)) as coord:
            print(coord.address)   # 127.0.0.1:<free port>
        ```
    """

    def __init__(
        self, config: CoordinatorConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
        release_memory: bool = False,
    ) -> None:
        """``release_memory``: give freed heap pages back to the system now and then, so that a
        flood's memory does not stay with the process. Process-wide, hence only for a process of
        its own (``ringserve coordinator``); a worker's process keeps its buffers."""
        self.config = config or CoordinatorConfig()
        self._release_memory = release_memory
        self.security = Security.load(self.config)
        self.service = CoordinatorService(self.config, clock, security=self.security)
        self._server: grpc.aio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.metrics: MetricsServer | None = None
        self.status_page: StatusPage | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> Coordinator:
        server = grpc.aio.server(
            options=coordinator_server_options(self.config),
            interceptors=self.security.server_interceptors(),
            maximum_concurrent_rpcs=self.config.max_concurrent_rpcs,
        )
        _add_service(self.service, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        # Reflection lets grpcurl and other tools explore the coordinator without the protos.
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        self.port = self.security.add_port(server, f"{self.config.host}:{self.config.port}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="ringserve-coordinator-tick")
        if self.config.metrics_port >= 0:
            from ringserve.metrics import CoordinatorCollector, MetricsServer

            self.metrics = MetricsServer(CoordinatorCollector(self.service.metrics), self.config.host, self.config.metrics_port)
        if self.config.http_port >= 0:
            from ringserve.coordinator.http import StatusPage

            try:
                self.status_page = await StatusPage(self.service.status, self.config, self.security).start()
            except BaseException:
                await self.stop(0)  # a port in use: nothing of this coordinator is left running
                raise
        log.info(
            "coordinator serving on %s (min_workers=%d, %s, %s)", self.address, self.config.min_workers,
            ("mTLS" if self.security.require_client_auth else "TLS") if self.security.tls else "plaintext",
            "token required" if self.security.token else "no token",
        )
        return self

    async def _tick(self) -> None:
        trimmed_at, freed = time.monotonic(), 0
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.service.apply(membership.Tick())
            if self._release_memory:
                now, freed_now = time.monotonic(), self.service.params.freed_bytes
                if freed_now - freed >= TRIM_AFTER_FREED_BYTES or now - trimmed_at >= TRIM_EVERY_S:
                    _malloc.trim()
                    trimmed_at, freed = now, freed_now

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        await self.service.close()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.status_page is not None:
            await self.status_page.stop()
            self.status_page = None

    async def __aenter__(self) -> Coordinator:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()
