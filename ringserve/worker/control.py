"""The worker's client of the coordinator: unary calls with deadlines, and the view watch."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.commits import Commit, Holder, Mark
from ringserve.config import WorkerConfig
from ringserve.security import Security
from ringserve.transport import channel_options, coordinator_error

PARAM_CHUNK_BYTES = 1 << 20


class ControlClient:
    """Calls the coordinator; every failure comes back as a ringserve error naming its address."""

    def __init__(self, config: WorkerConfig, security: Security | None = None) -> None:
        self.address = config.coordinator
        self._config = config
        security = security or Security.load(config)
        self._channel = security.channel(self.address, channel_options(64 << 20))
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    async def _call(self, method: str, request: object, timeout_s: float, wait_for_ready: bool = False) -> object:
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, self.address, timeout_s) from None

    async def join(
        self, *, address: str, hostname: str, rank_hint: int, worker_id: str = "",
        view_id: int = 0, rank: int = 0, view_size: int = 0,
    ) -> pb.JoinResponse:
        request = pb.JoinRequest(
            address=address, hostname=hostname, rank_hint=rank_hint, worker_id=worker_id,
            view_id=view_id, rank=rank, view_size=view_size,
        )
        # wait_for_ready: a coordinator that is still starting is waited for, up to the deadline.
        return await self._call("Join", request, self._config.connect_timeout_s, wait_for_ready=True)  # type: ignore[return-value]

    async def leave(self, worker_id: str) -> None:
        await self._call("Leave", pb.LeaveRequest(worker_id=worker_id), self._config.rpc_timeout_s)

    async def heartbeat(
        self, worker_id: str, view_id: int, counters: pb.WorkerCounters, stalled: list[str] | None = None,
        committed: Commit | None = None,
    ) -> pb.HeartbeatResponse:
        request = pb.HeartbeatRequest(worker_id=worker_id, view_id=view_id, counters=counters, stalled=stalled or [])
        if committed is not None:
            request.committed_step, request.committed_lineage = committed.step, committed.lineage
        return await self._call("Heartbeat", request, self._config.rpc_timeout_s)  # type: ignore[return-value]

    async def report_failure(self, worker_id: str, view_id: int, suspect_rank: int, reason: str) -> None:
        request = pb.ReportFailureRequest(reporter_id=worker_id, view_id=view_id, suspect_rank=suspect_rank, reason=reason)
        await self._call("ReportFailure", request, self._config.rpc_timeout_s)

    async def admit(self, worker_id: str, view_id: int) -> int:
        answer = await self._call("Admit", pb.AdmitRequest(worker_id=worker_id, view_id=view_id), self._config.rpc_timeout_s)
        return int(answer.admitted)  # type: ignore[attr-defined]

    async def commit_mark(self, worker_id: str) -> Mark:
        """The job's committed high-water mark as the coordinator knows it now."""
        answer = await self._call("CommitMark", pb.CommitMarkRequest(worker_id=worker_id), self._config.rpc_timeout_s)
        assert isinstance(answer, pb.CommitMarkResponse)
        if not answer.known:
            return Mark()
        holders = tuple(Holder(h.worker_id, h.address, h.view_id, h.rank) for h in answer.holders)
        return Mark(Commit(answer.lineage, answer.step), holders)

    async def status(self) -> pb.StatusResponse:
        return await self._call("Status", pb.StatusRequest(), self._config.rpc_timeout_s)  # type: ignore[return-value]

    async def watch(self, worker_id: str) -> AsyncIterator[pb.View]:
        """Every view from the current one on. Long-lived by design: liveness comes from keepalive
        and from heartbeats, which also carry the current view id."""
        call = self._stub.WatchView(pb.WatchViewRequest(worker_id=worker_id))
        try:
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
            response = await self._stub.PutParams(chunks(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, self.address, timeout) from None
        return response.version

    async def get_params(self, key: str) -> bytes:
        parts: list[bytes] = []
        try:
            async for chunk in self._stub.GetParams(pb.GetParamsRequest(key=key), timeout=self._config.collective_timeout_s):
                parts.append(chunk.data)
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, self.address, self._config.collective_timeout_s) from None
        return b"".join(parts)

    async def close(self) -> None:
        await self._channel.close()
