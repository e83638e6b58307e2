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

from ringserve import membership
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.config import CoordinatorConfig
from ringserve.coordinator.service import CoordinatorService
from ringserve.security import Security
from ringserve.transport import server_options

if TYPE_CHECKING:
    from ringserve.metrics import MetricsServer

log = logging.getLogger("ringserve.coordinator")

SERVICE_NAME = "ringserve.v1.Coordinator"


class Coordinator:
    """A coordinator on its own gRPC server, in the running event loop.

    Example::

        async with Coordinator(CoordinatorConfig(min_workers=2)) as coord:
            print(coord.address)   # 127.0.0.1:<free port>
    """

    def __init__(self, config: CoordinatorConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or CoordinatorConfig()
        self.security = Security.load(self.config)
        self.service = CoordinatorService(self.config, clock, security=self.security)
        self._server: grpc.aio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.metrics: MetricsServer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> Coordinator:
        server = grpc.aio.server(
            options=server_options(self.config.max_message_bytes),
            interceptors=self.security.server_interceptors(),
            maximum_concurrent_rpcs=self.config.max_concurrent_rpcs,
        )
        pb_grpc.add_CoordinatorServicer_to_server(self.service, server)
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
        log.info(
            "coordinator serving on %s (min_workers=%d, %s, %s)", self.address, self.config.min_workers,
            ("mTLS" if self.security.require_client_auth else "TLS") if self.security.tls else "plaintext",
            "token required" if self.security.token else "no token",
        )
        return self

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.service.apply(membership.Tick())

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

    async def __aenter__(self) -> Coordinator:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()
