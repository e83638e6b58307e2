"""The worker's client of the coordinator: unary calls with deadlines, heartbeats on a stream, and
the view watch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.commits import Commit, Holder, Mark
from ringserve.config import WorkerConfig
from ringserve.errors import CoordinatorUnreachableError, TLSHandshakeError
from ringserve.handshake import PROBE_TIMEOUT_S, diagnose
from ringserve.security import Security
from ringserve.transport import control_channel_options, coordinator_error

PARAM_CHUNK_BYTES = 1 << 20
# After a heartbeat stream fails, unary heartbeats are sent until it is opened again, first this
# long after the failure, then twice as long after each failure in a row, up to the cap: a
# coordinator that refuses streams (its cap, an older version) is asked again now and then,
# not at every beat.
REOPEN_FIRST_S = 1.0
REOPEN_MAX_S = 60.0


class HeartbeatStream:
    """A worker's heartbeats on one long-lived Heartbeats stream, unary Heartbeat calls while the
    stream is down: the same answers for about half the coordinator's CPU (see
    ringserve.coordinator.beats).

    One request is in flight at a time. A beat whose answer has not come within ``timeout_s``
    is missed (CoordinatorUnreachableError, as a unary call past its deadline), and the stream is
    dropped: an answer that comes late would be taken for the next request's. Any other failure
    of the stream (ended by the coordinator, refused, replaced, a coordinator without the
    method) drops it too, and the beat goes as a unary call within what is left of its deadline,
    so that the beat's outcome is the coordinator's, not the stream's. A dropped stream is opened
    again with backoff (REOPEN_FIRST_S doubling to REOPEN_MAX_S); after an answer with
    ``known: false`` (the coordinator ends that stream) a new one is opened at once, for the
    beats after the rejoin.

    Example:
        ```python
        beats = HeartbeatStream(pb_grpc.CoordinatorStub(channel), "10.0.0.2:50051", timeout_s=5.0)
        answer = await beats.beat(pb.HeartbeatRequest(worker_id=worker_id, view_id=view_id))
        ```
    """

    def __init__(
        self, stub: pb_grpc.CoordinatorStub, address: str, timeout_s: float, *,
        metadata: tuple[tuple[str, str], ...] = (), use_stream: bool = True,
    ) -> None:
        """``metadata``: sent with each stream (the token on a plaintext channel, see
        Security.call_metadata)."""
        self._stub = stub
        self._metadata = metadata
        self.address = address
        self.timeout_s = timeout_s
        self.use_stream = use_stream  # False: unary calls only (the benchmark's comparison)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reopen_at = 0.0
        self._failures = 0
        self._lock = asyncio.Lock()
        self.streams_opened = 0

    @property
    def streaming(self) -> bool:
        """Whether a stream is open now (the next beat goes on it)."""
        return self._call is not None

    async def beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """Sends one heartbeat and returns the coordinator's answer.

        Raises:
            CoordinatorUnreachableError: no answer within timeout_s.
            RingserveError: the coordinator refused the heartbeat (a bad token, ...).
        """
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout_s
            if self._call is None and self.use_stream and loop.time() >= self._reopen_at:
                self._call = self._stub.Heartbeats(metadata=self._metadata or None)
                self.streams_opened += 1
            call = self._call
            if call is not None:
                try:
                    async with asyncio.timeout_at(deadline):
                        await call.write(request)
                        answer = await call.read()
                except TimeoutError:
                    self._drop(loop.time())
                    raise CoordinatorUnreachableError(
                        self.address, self.timeout_s, "DEADLINE_EXCEEDED: no answer on the heartbeat stream"
                    ) from None
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                    self._drop(loop.time(), give_up=code == grpc.StatusCode.UNIMPLEMENTED)
                except BaseException:
                    self._drop(loop.time())  # cancelled mid-beat: the stream's state is unknown
                    raise
                else:
                    if answer is grpc.aio.EOF:
                        self._drop(loop.time())
                    else:
                        assert isinstance(answer, pb.HeartbeatResponse)
                        self._failures = 0
                        if not answer.known:  # the coordinator ends this stream; a new one after the rejoin
                            self._drop(loop.time(), failed=False)
                        return answer
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise CoordinatorUnreachableError(self.address, self.timeout_s, "DEADLINE_EXCEEDED: heartbeat")
            try:
                answer = await self._stub.Heartbeat(request, timeout=remaining)
            except grpc.aio.AioRpcError as exc:
                raise coordinator_error(exc, self.address, self.timeout_s) from None
            assert isinstance(answer, pb.HeartbeatResponse)
            return answer

    def _drop(self, now: float, *, failed: bool = True, give_up: bool = False) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if not failed:
            self._reopen_at = now
            return
        self._failures += 1
        wait = REOPEN_MAX_S if give_up else min(REOPEN_MAX_S, REOPEN_FIRST_S * 2 ** (self._failures - 1))
        self._reopen_at = now + wait

    def rebind(self, stub: pb_grpc.CoordinatorStub) -> None:
        """Ends the stream; the next beats go through ``stub`` (a channel dialled afresh)."""
        self.close()
        self._stub = stub

    def close(self) -> None:
        """Ends the stream (the channel's owner closes the channel)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None


class ControlClient:
    """Calls the coordinator; every failure comes back as a ringserve error naming its address."""

    def __init__(self, config: WorkerConfig, security: Security | None = None) -> None:
        self.address = config.coordinator
        self._config = config
        security = security or Security.load(config)
        self._security = security
        self._channel = security.channel(self.address, control_channel_options(64 << 20))
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._call_metadata = security.call_metadata()  # client streams send the token themselves
        self.heartbeats = HeartbeatStream(self._stub, self.address, config.rpc_timeout_s, metadata=self._call_metadata)

    async def redial(self, timeout_s: float) -> bool:
        """Dials the coordinator on a new connection, and takes it if it is up within ``timeout_s``.

        A connection that lived through a link outage can stay stuck in TCP's retransmission
        backoff (seconds, doubling, and no FIN or RST to end it) for a while after the link is back,
        and gRPC's keepalive gives up on it only after 15 s; a new connection is up at once. The
        calls in flight on the old channel end with it (the view watch is then watched again).
        """
        # A channel of its own subchannel pool: one with the same target and options would share
        # the old connection (gRPC's global pool), stuck or not.
        options = [*control_channel_options(64 << 20), ("grpc.use_local_subchannel_pool", 1)]
        channel = self._security.channel(self.address, options)
        # READY means only that the TCP connection (and TLS) is up: a route that takes new
        # connections but drops what goes over them (a half-broken middlebox) is READY too. A
        # health check (open without a token) proves the coordinator answers on it.
        try:
            async with asyncio.timeout(timeout_s):
                await channel.channel_ready()
                answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            up = answer.status == health_pb2.HealthCheckResponse.SERVING
        except (TimeoutError, grpc.aio.AioRpcError):
            up = False
        if not up:
            await channel.close()
            return False
        old, self._channel, self._stub = self._channel, channel, pb_grpc.CoordinatorStub(channel)
        self.heartbeats.rebind(self._stub)
        await old.close()  # its calls end with a CancelledError, which _on_old_channel turns into a failure
        return True

    @contextlib.contextmanager
    def _on_old_channel(self, timeout_s: float) -> Iterator[None]:
        """A call whose channel ``redial`` closed under it ends with a CancelledError that nobody
        asked of its task: it fails as the coordinator unreachable on that connection (its caller
        tries again, on the new one). A cancellation of the task itself goes through."""
        try:
            yield
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling() > 0:
                raise
            raise CoordinatorUnreachableError(self.address, timeout_s, "CANCELLED: its connection was replaced") from None

    async def _call(self, method: str, request: object, timeout_s: float, wait_for_ready: bool = False) -> object:
        try:
            with self._on_old_channel(timeout_s):
                return await getattr(self._stub, method)(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, self.address, timeout_s) from None

    async def join(
        self, *, address: str, hostname: str, rank_hint: int, worker_id: str = "",
        view_id: int = 0, rank: int = 0, view_size: int = 0, prepare: bool = False,
    ) -> pb.JoinResponse:
        request = pb.JoinRequest(
            address=address, hostname=hostname, rank_hint=rank_hint, worker_id=worker_id,
            view_id=view_id, rank=rank, view_size=view_size, prepare=prepare,
            gang=self._config.gang, gang_size=self._config.gang_size,
        )
        # wait_for_ready: a coordinator that is still starting is waited for, up to the deadline;
        # one that refuses our TLS is not (see _unless_handshake_fails).
        call = self._call("Join", request, self._config.connect_timeout_s, wait_for_ready=True)
        answer = await self._unless_handshake_fails(call)
        assert isinstance(answer, pb.JoinResponse)
        return answer

    async def _unless_handshake_fails(self, call: Awaitable[object]) -> object:
        """Awaits call, unless the channel meanwhile fails to connect for a TLS reason: then
        raises TLSHandshakeError at once, where wait_for_ready would wait out the deadline.

        Raises:
            TLSHandshakeError: the handshake with the coordinator failed (which side, why).
        """
        task = asyncio.ensure_future(call)
        watcher = asyncio.ensure_future(self._handshake_failure())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise watcher.result()
        finally:
            task.cancel()
            watcher.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)

    async def _handshake_failure(self) -> TLSHandshakeError:
        """Returns once the channel has failed to connect and diagnose names a TLS cause; each
        failed attempt (paced by gRPC's reconnect backoff) is looked at once."""
        state = self._channel.get_state(try_to_connect=True)
        while True:
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                found = await asyncio.to_thread(diagnose, self.address, self._security, PROBE_TIMEOUT_S)
                if found is not None:
                    return found
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=True)

    async def leave(self, worker_id: str) -> None:
        await self._call("Leave", pb.LeaveRequest(worker_id=worker_id), self._config.rpc_timeout_s)

    async def heartbeat(
        self, worker_id: str, view_id: int, counters: pb.WorkerCounters, stalled: list[str] | None = None,
        linked_view: int = 0, committed: Commit | None = None, committed_view: int = 0, ready: bool = True,
    ) -> pb.HeartbeatResponse:
        request = pb.HeartbeatRequest(
            worker_id=worker_id, view_id=view_id, counters=counters, stalled=stalled or [], linked_view=linked_view,
            ready=ready,
        )
        if committed is not None:
            request.committed_step, request.committed_lineage = committed.step, committed.lineage
            request.committed_view = committed_view
        return await self.heartbeats.beat(request)

    async def report_failure(self, worker_id: str, view_id: int, suspect_rank: int, reason: str) -> None:
        request = pb.ReportFailureRequest(reporter_id=worker_id, view_id=view_id, suspect_rank=suspect_rank, reason=reason)
        await self._call("ReportFailure", request, self._config.rpc_timeout_s)

    async def admit(self, worker_id: str, view_id: int, leaving: Sequence[str] = ()) -> int:
        request = pb.AdmitRequest(worker_id=worker_id, view_id=view_id, leaving_worker_ids=list(leaving))
        answer = await self._call("Admit", request, self._config.rpc_timeout_s)
        return int(answer.admitted)  # type: ignore[attr-defined]

    async def commit_mark(self, worker_id: str) -> Mark:
        """The job's committed high-water mark as the coordinator knows it now."""
        answer = await self._call("CommitMark", pb.CommitMarkRequest(worker_id=worker_id), self._config.rpc_timeout_s)
        assert isinstance(answer, pb.CommitMarkResponse)
        if not answer.known:
            return Mark()
        holders = tuple(Holder(h.worker_id, h.address, h.view_id, h.rank) for h in answer.holders)
        present = frozenset(h.worker_id for h in answer.holders if h.present)
        return Mark(Commit(answer.lineage, answer.step), holders, present)

    async def status(self, *, limit: int = 0, offset: int = 0, summary_only: bool = False) -> pb.StatusResponse:
        """The coordinator's status; ``limit`` members from rank ``offset`` on (0: all).

        Raises:
            TLSHandshakeError: the coordinator and this client do not agree on TLS.
            CoordinatorUnreachableError: no answer within rpc_timeout_s.
        """
        request = pb.StatusRequest(summary_only=summary_only, offset=offset, limit=limit)
        try:
            return await self._call("Status", request, self._config.rpc_timeout_s)  # type: ignore[return-value]
        except CoordinatorUnreachableError as exc:
            found = await asyncio.to_thread(diagnose, self.address, self._security, PROBE_TIMEOUT_S)
            if found is not None:
                raise found from exc
            raise

    async def watch(self, worker_id: str) -> AsyncIterator[pb.View]:
        """Every view from the current one on. Long-lived by design: liveness comes from keepalive
        and from heartbeats, which also carry the current view id."""
        call = self._stub.WatchView(pb.WatchViewRequest(worker_id=worker_id))
        try:
            with self._on_old_channel(self._config.rpc_timeout_s):
                async for view in call:
                    yield view
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, self.address, self._config.rpc_timeout_s) from None
        finally:
            call.cancel()

    async def put_params(self, key: str, data: bytes) -> int:
        async def chunks() -> AsyncIterator[pb.ParamChunk]:
            for offset in range(0, max(len(data), 1), PARAM_CHUNK_BYTES):
                yield pb.ParamChunk(key=key, offset=offset, total_bytes=len(data),
                                    data=data[offset : offset + PARAM_CHUNK_BYTES])

        timeout = self._config.rpc_timeout_s + len(data) / (50 << 20)
        try:
            with self._on_old_channel(timeout):
                response = await self._stub.PutParams(chunks(), timeout=timeout, metadata=self._call_metadata or None)
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, self.address, timeout) from None
        version: int = response.version
        return version

    async def get_params(self, key: str) -> bytes:
        try:
            with self._on_old_channel(self._config.collective_timeout_s):
                stream = self._stub.GetParams(pb.GetParamsRequest(key=key), timeout=self._config.collective_timeout_s)
                parts = [chunk.data async for chunk in stream]
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, self.address, self._config.collective_timeout_s) from None
        return b"".join(parts)

    async def close(self) -> None:
        self.heartbeats.close()
        await self._channel.close()
