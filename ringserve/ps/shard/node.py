"""One parameter-server shard: its gRPC server, its place in the coordinator's directory, the view
it counts members from, and its checkpoints.

A shard starts its server (with the job's TLS and token, as every ringserve server), takes an
index from the coordinator (RegisterShard; see ringserve/coordinator/directory.py), resumes from
its newest checkpoint if ``checkpoint_dir`` holds one for that index, and then owns three tasks:

- the **lease**: RegisterShard again every ``refresh_s`` the coordinator gave it;
- the **view watch**: the coordinator's views (WatchView), whose members are the workers that
  sync, ssp and average count; re-opened with backoff when the coordinator goes away;
- the **checkpoint writer**: every ``checkpoint_updates`` updates, a snapshot written on a thread
  (see checkpoint.py); and one last checkpoint when the shard stops.

A task that crashes is logged and fails the shard's ``wait()``: nothing dies silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ringserve._proto import coordinator_pb2 as cpb
from ringserve._proto import coordinator_pb2_grpc as cpb_grpc
from ringserve._proto import ps_pb2_grpc as pb_grpc
from ringserve.config import ShardConfig
from ringserve.errors import CoordinatorUnreachableError, RingserveError
from ringserve.ps.shard import checkpoint
from ringserve.ps.shard.service import ShardService
from ringserve.security import Security
from ringserve.transport import control_channel_options, coordinator_error, server_options

log = logging.getLogger("ringserve.ps")

SERVICE_NAME = "ringserve.v1.ParameterServer"
# Between attempts to register while the coordinator is not up or the index is still held.
REGISTER_RETRY_S = 0.2
CHECKPOINT_RETRY_S = 5.0  # a checkpoint that could not be written is tried again after this, at an update
# The view watch is opened again after a failure this long after, doubling up to the cap.
WATCH_RETRY_FIRST_S = 0.1
WATCH_RETRY_MAX_S = 2.0


class Shard:
    """One shard on its own gRPC server, in the running event loop.

    Example:
        ```python
        async with Shard(ShardConfig(coordinator=coord.address, shards=2)) as shard:
            print(shard.index, shard.address)
        ```
    """

    def __init__(self, config: ShardConfig | None = None, *, shard_id: str = "") -> None:
        self.config = config or ShardConfig()
        self.security = Security.load(self.config)
        self.shard_id = shard_id or uuid.uuid4().hex
        self.service = ShardService(self.config, on_update=self._updated)
        self.port = 0
        self.index = -1
        self.incarnation = 0
        self.restored_from = ""
        self._refresh_s = 1.0
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: cpb_grpc.CoordinatorStub | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: asyncio.Future[None] | None = None
        self._writing: asyncio.Task[None] | None = None
        self._written = 0   # the version of the newest checkpoint written (once it is)
        self._retry_at = 0.0  # the loop's clock before which a failed checkpoint is not tried again

    @property
    def address(self) -> str:
        """host:port workers dial (the advertised one)."""
        return f"{self.config.advertised_host()}:{self.config.advertise_port or self.port}"

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Shard:
        """Serves, registers with the coordinator, and resumes from a checkpoint if there is one.

        Raises:
            CoordinatorUnreachableError: no registration within register_timeout_s.
            RingserveError: the coordinator refused the registration (S disagrees, the index is held).
            OSError: the address could not be bound.
        """
        cfg = self.config
        self._failed = asyncio.get_running_loop().create_future()
        server = grpc.aio.server(
            options=server_options(cfg.max_message_bytes, handshake_timeout_s=cfg.connect_timeout_s),
            interceptors=self.security.server_interceptors(),
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        )
        pb_grpc.add_ParameterServerServicer_to_server(self.service, server)
        healthy = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(healthy, server)
        self.port = self.security.add_port(server, f"{cfg.bind_host}:{cfg.bind_port}")
        self.service.starting = True
        await server.start()
        self._server = server
        try:
            self._channel = self.security.channel(cfg.coordinator, control_channel_options(4 << 20))
            self._stub = cpb_grpc.CoordinatorStub(self._channel)
            await self._register_first()
            if cfg.checkpoint_dir:
                self._restore()
            self.service.starting = False
            for name in ("", SERVICE_NAME):
                await healthy.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._spawn(self._lease(), "lease")
            self._spawn(self._watch(), "view-watch")
        except BaseException:
            await self.stop(checkpoint_last=False)
            raise
        log.info("shard %d of %d serving on %s (%s%s)", self.index, cfg.shards, self.address,
                 "TLS" if self.security.tls else "plaintext", ", token required" if self.security.token else "")
        return self

    async def stop(self, grace_s: float = 0.5, *, checkpoint_last: bool = True) -> None:
        """Stops the tasks, writes a last checkpoint (if due), and closes the server."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._writing is not None:
            try:
                await self._writing  # its own failure is counted and logged (_write); a bug is said here
            except Exception as exc:
                log.error("shard %d: the checkpoint under way failed: %r", self.index, exc, exc_info=exc)
        if checkpoint_last and self.config.checkpoint_dir and self.index >= 0:
            held = self.service.held()
            if held is not None and held[1].version > self._written:
                await self._write()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def wait(self) -> None:
        """Returns never while the shard runs; raises the error of a task that crashed."""
        assert self._failed is not None, "start() first"
        await self._failed

    async def __aenter__(self) -> Shard:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"ringserve-shard-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("shard %d: task %s crashed: %r", self.index, task.get_name(), exc, exc_info=exc)
            if self._failed is not None and not self._failed.done():
                self._failed.set_exception(exc)

    # -- the directory ---------------------------------------------------------------------

    def _request(self, first: bool) -> cpb.RegisterShardRequest:
        return cpb.RegisterShardRequest(shard_id=self.shard_id, address=self.address, shards=self.config.shards,
                                        index=self.index if self.index >= 0 else self.config.shard_index, first=first)

    async def _register_first(self) -> None:
        cfg = self.config
        assert self._stub is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.register_timeout_s
        while True:
            try:
                # No try outlives the deadline: the error comes within register_timeout_s.
                left = max(0.05, deadline - loop.time())
                answer = await self._stub.RegisterShard(self._request(True), timeout=min(cfg.connect_timeout_s, left))
                break
            except grpc.aio.AioRpcError as exc:
                retry = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS,
                                       grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retry or loop.time() >= deadline:
                    error = coordinator_error(exc, cfg.coordinator, cfg.register_timeout_s)
                    if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                        error = RingserveError(f"Shard {self.shard_id} could not take an index within "
                                               f"{cfg.register_timeout_s:g} s: {exc.details()}")
                    raise error from None
            await asyncio.sleep(REGISTER_RETRY_S)
        self._took(answer)

    def _took(self, answer: cpb.RegisterShardResponse) -> None:
        self.index, self.incarnation = answer.index, answer.incarnation
        self._refresh_s = answer.refresh_s or 1.0
        self.service.index, self.service.incarnation = answer.index, answer.incarnation

    async def _lease(self) -> None:
        assert self._stub is not None
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                answer = await self._stub.RegisterShard(self._request(False), timeout=self.config.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                # A coordinator that is away is waited for (workers keep training meanwhile); one that
                # gave the index to another shard has declared this one dead.
                log.warning("shard %d: the lease could not be renewed: %s", self.index,
                            coordinator_error(exc, self.config.coordinator, self.config.rpc_timeout_s))
                continue
            if answer.index != self.index:
                raise RingserveError(f"Shard {self.shard_id} held index {self.index}, and the coordinator moved it "
                                     f"to {answer.index}.")
            self._took(answer)

    async def _watch(self) -> None:
        """Feeds the coordinator's views to the service, for as long as the shard runs."""
        assert self._stub is not None
        delay = WATCH_RETRY_FIRST_S
        request = cpb.WatchViewRequest(worker_id=f"ps-shard-{self.shard_id}")
        while True:
            try:
                async for view in self._stub.WatchView(request):
                    delay = WATCH_RETRY_FIRST_S
                    self.service.install_view(view.view_id, frozenset(m.worker_id for m in view.members))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise CoordinatorUnreachableError(self.config.coordinator, 0, exc.details() or "") from None
            await asyncio.sleep(delay)
            delay = min(2 * delay, WATCH_RETRY_MAX_S)

    # -- checkpoints -----------------------------------------------------------------------

    def _restore(self) -> None:
        found = checkpoint.newest(self.config.checkpoint_dir, self.index, self.config.shards)
        if found is None:
            return
        self.service.adopt(found.store, found.ledger)
        self._written = self.service.checkpoint_version = found.ledger.version
        self.restored_from = str(found.path)
        log.warning("shard %d of %d resumes at version %d from %s; updates after it are lost (workers report "
                    "how many)", self.index, self.config.shards, found.ledger.version, found.path)

    def _updated(self) -> None:
        """After every update: a checkpoint when K updates passed since the last one."""
        held = self.service.held()
        if not self.config.checkpoint_dir or held is None or self._writing is not None:
            return
        loop = asyncio.get_running_loop()
        if held[1].version - self._written >= self.config.checkpoint_updates and loop.time() >= self._retry_at:
            self._writing = loop.create_task(self._write(), name="ringserve-shard-checkpoint")
            self._writing.add_done_callback(self._done)  # a failure other than the disk's fails the shard

    async def _write(self) -> None:
        """Writes a checkpoint of the shard as it is: the snapshot taken on a thread between two
        updates (it holds the service's ``mutating``), the file written on a thread after. The
        version counts as written only once it is (``_written``), so a failed one is tried again
        at the next update after CHECKPOINT_RETRY_S, and at stop."""
        cfg = self.config
        service = self.service
        try:
            async with service.mutating:
                held = service.held()
                snap = None if held is None else await asyncio.to_thread(checkpoint.snapshot, *held)
        except BaseException:
            self._writing = None
            raise
        if snap is None:
            self._writing = None
            return
        try:
            path = await asyncio.to_thread(checkpoint.write, cfg.checkpoint_dir, self.index, cfg.shards, snap,
                                           cfg.checkpoint_keep)
        except OSError as exc:
            service.checkpoint_failures += 1
            service.checkpoint_error = f"version {snap.version}: {exc}"
            self._retry_at = asyncio.get_running_loop().time() + CHECKPOINT_RETRY_S
            log.error("shard %d: the checkpoint of version %d could not be written (%s); failures so far: %d; "
                      "tried again in %g s", self.index, snap.version, exc, service.checkpoint_failures,
                      CHECKPOINT_RETRY_S)
            return
        finally:
            self._writing = None
        self._written = service.checkpoint_version = snap.version
        service.checkpoint_error = ""
        log.info("shard %d: checkpoint of version %d written to %s", self.index, snap.version, path)
        self._updated()  # updates that came while writing may make the next one due
