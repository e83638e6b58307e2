"""A client that multiplexes its calls on one connection, as gRPC does in most languages, holds
hundreds of WatchView streams and heartbeats with unary calls: under the coordinator's caps no call
is refused, and past a cap the refusal names it.

A scaled-down reproduction of 1,000 workers beside 1,000 more WatchView streams, where 0.8-1.9% of
unary Heartbeat calls were refused with REFUSED_STREAM: the transport's 256 streams per connection
bit before any named cap (see coordinator/server.connection_stream_cap).
"""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import pytest

from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.config import CoordinatorConfig
from ringserve.coordinator import Coordinator

ONE_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


async def _beat_for(stub: pb_grpc.CoordinatorStub, beaters: int, seconds: float) -> tuple[int, collections.Counter[str]]:
    """``beaters`` loops of unary heartbeats for ``seconds``; the calls answered, and the errors."""
    end = time.monotonic() + seconds
    errors: collections.Counter[str] = collections.Counter()
    answered = 0

    async def beat(i: int) -> None:
        nonlocal answered
        while time.monotonic() < end:
            try:
                await stub.Heartbeat(pb.HeartbeatRequest(worker_id=f"beater-{i}"), timeout=10)
                answered += 1
            except grpc.aio.AioRpcError as exc:
                errors[f"{exc.code().name}: {exc.details()}"] += 1

    await asyncio.gather(*(beat(i) for i in range(beaters)))
    return answered, errors


@pytest.mark.timeout(60)
async def test_unary_heartbeats_beside_hundreds_of_watch_streams_on_one_connection_are_never_refused() -> None:
    config = CoordinatorConfig(min_workers=10_000, max_workers=10_000)
    async with Coordinator(config) as coord, grpc.aio.insecure_channel(coord.address, options=ONE_CONNECTION) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        # 250 streams and 30 calls at a time: past the 256 streams a worker's server allows a connection.
        watches = [stub.WatchView(pb.WatchViewRequest(worker_id=f"watcher-{i}")) for i in range(250)]
        try:
            async with asyncio.timeout(20):
                while coord.service.watch_streams < len(watches):
                    await asyncio.sleep(0.05)
            answered, errors = await _beat_for(stub, beaters=30, seconds=2.0)
        finally:
            for call in watches:
                call.cancel()
        assert not errors, f"{sum(errors.values())} of {answered + sum(errors.values())} heartbeats refused: {errors}"
        assert answered > 100


@pytest.mark.timeout(60)
async def test_past_the_watch_cap_a_stream_is_refused_naming_the_cap_and_heartbeats_still_pass() -> None:
    config = CoordinatorConfig(min_workers=10_000, max_workers=10_000, max_watch_streams=40)
    async with Coordinator(config) as coord, grpc.aio.insecure_channel(coord.address, options=ONE_CONNECTION) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        watches = [stub.WatchView(pb.WatchViewRequest(worker_id=f"watcher-{i}")) for i in range(40)]
        try:
            async with asyncio.timeout(20):
                while coord.service.watch_streams < len(watches):
                    await asyncio.sleep(0.05)
            extra = stub.WatchView(pb.WatchViewRequest(worker_id="one-too-many"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await extra.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_watch_streams" in (refused.value.details() or "")
            answered, errors = await _beat_for(stub, beaters=10, seconds=1.0)
        finally:
            for call in watches:
                call.cancel()
        assert not errors and answered > 10, errors
