"""Calls to a shard whose transport breaks mid-call, a shard's own verdicts, and fan-outs that fail.

- A push or a pull whose stream breaks mid-call (the connection reset: INTERNAL or UNAVAILABLE,
  as the race goes; the stream reset by the peer: INTERNAL always) is asked again once the shard
  is back, within shard_wait_s, as for UNAVAILABLE (issue 40: a worker died on "INTERNAL:
  Internal error from Core" while a killed shard restarted).
- A shard's deliberate refusal, INTERNAL included, is raised at once, never retried.
- When one shard's call fails, the client's calls to the other shards are cancelled and awaited
  before the error reaches the caller, as the typed ringserve error, not an ExceptionGroup; a
  caller's own cancellation is never mistaken for a shard's CANCELLED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np
import pytest
from breaker import Breaker
from psworlds import PSWorld, shard_config
from worlds import start_world

from ringserve._proto import ps_pb2 as pb
from ringserve._proto import ps_pb2_grpc as pb_grpc
from ringserve.errors import InvalidArgumentError, RingserveError
from ringserve.ps import Optimizer, Shard
from ringserve.ps.client.aio import first_error
from ringserve.ps.shard.service import ShardService
from ringserve.ps.verdicts import VERDICT_KEY, is_transient, refuse

pytestmark = pytest.mark.timeout(60)

SGD = Optimizer(kind="sgd", lr=1.0)
SIZE = 1 << 16                # float32s: 256 KiB, 64 chunks of 4 KiB
CHUNK = 4096
SHARD_WAIT_S = 20.0
# Breaks in a row, each asked again. A reset comes out as INTERNAL or as UNAVAILABLE as a race
# goes (see breaker.py), so several give INTERNAL its chances; rst_stream is INTERNAL every time.
BREAKS = 4


async def until(ready: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not ready():
            await asyncio.sleep(0.01)


# -- the rule --------------------------------------------------------------------------------

Code = grpc.StatusCode


@pytest.mark.parametrize(("code", "marked", "transient"), [
    (Code.UNAVAILABLE, False, True), (Code.UNAVAILABLE, True, True),    # the shard's "starting" too
    (Code.INTERNAL, False, True), (Code.INTERNAL, True, False),
    (Code.CANCELLED, False, True), (Code.CANCELLED, True, False),
    (Code.UNKNOWN, False, True), (Code.UNKNOWN, True, False),
    (Code.INVALID_ARGUMENT, True, False), (Code.INVALID_ARGUMENT, False, False),
    (Code.DEADLINE_EXCEEDED, False, False), (Code.RESOURCE_EXHAUSTED, False, False),
    (Code.UNAUTHENTICATED, False, False), (Code.NOT_FOUND, True, False),
])
def test_a_failed_call_is_asked_again_when_grpc_gave_it_a_transport_code_and_the_shard_did_not_mark_it(
        code: grpc.StatusCode, marked: bool, transient: bool) -> None:
    trailing = grpc.aio.Metadata((VERDICT_KEY, "1")) if marked else grpc.aio.Metadata()
    exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="Internal error from Core")
    assert is_transient(exc) is transient


def test_the_first_error_of_a_group_is_raised_with_the_others_noted_on_it() -> None:
    first, second = InvalidArgumentError("shard 0 refused"), RingserveError("shard 1 broke")
    error = first_error(ExceptionGroup("calls", [ExceptionGroup("nested", [first]), second]))
    assert error is first
    assert error.__notes__ == ["1 more shard call(s) failed at the same time: RingserveError: shard 1 broke"]


# -- a stream broken mid-call ----------------------------------------------------------------


@pytest.mark.parametrize("call", ["push", "pull"])
@pytest.mark.parametrize(("fault", "down_s"), [("reset", 0.3), ("rst_stream", 0.0)])
async def test_a_call_whose_stream_breaks_midway_is_asked_again_once_the_shard_is_back(
        call: str, fault: str, down_s: float) -> None:
    breaker = Breaker()
    port = await breaker.start()
    ps = PSWorld(await start_world(1), [], [])
    try:
        shard = await ps.start_shard(1, advertise_port=port)
        breaker.target_port = shard.port
        client = ps.client_for(0, chunk_bytes=CHUNK, shard_wait_s=SHARD_WAIT_S)
        ps.clients = [client]
        await client.init({"w": np.zeros(SIZE, np.float32)}, mode="async", optimizer=SGD)
        await client.pull()
        if call == "pull":
            assert await client.push({"w": np.ones(SIZE, np.float32)}) == ["applied"]
        breaker.arm(fault, after_bytes=SIZE, times=BREAKS, down_s=down_s)   # each a quarter of the way through
        started = asyncio.get_running_loop().time()
        if call == "push":
            assert await client.push({"w": np.ones(SIZE, np.float32)}) == ["applied"]
        else:
            await client.pull()
        assert asyncio.get_running_loop().time() - started < SHARD_WAIT_S
        assert breaker.broken == BREAKS and client.counts["retries"] >= BREAKS
        values = await client.pull()
        np.testing.assert_array_equal(values["w"], -1.0)      # the one push, applied once
        assert client.versions == [1]
    finally:
        await ps.close()
        await breaker.close()


# -- a shard's verdicts, and fan-outs that fail ----------------------------------------------


class Wrapped(pb_grpc.ParameterServerServicer):
    """A shard's servicer behind a wrapper that injects a fault into its pushes: ``refusing``, a
    deliberate refusal with that code; ``stalling``, a push that waits until its caller cancels it."""

    def __init__(self) -> None:
        self.service: ShardService | None = None
        self.refusing: grpc.StatusCode | None = None
        self.stalling = False
        self.pushes = 0
        self.open = 0

    def _service(self) -> ShardService:
        assert self.service is not None
        return self.service

    async def Init(self, request_iterator: AsyncIterator[pb.InitMessage], context: grpc.aio.ServicerContext) -> pb.InitResponse:
        return await self._service().Init(request_iterator, context)

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PullMessage]:
        async for message in self._service().Pull(request, context):
            yield message

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return await self._service().Info(request, context)

    async def Push(self, request_iterator: AsyncIterator[pb.PushMessage], context: grpc.aio.ServicerContext) -> pb.PushResponse:
        self.pushes += 1
        if self.refusing is not None:
            await refuse(context, self.refusing, "The wrapped shard refuses this push on purpose.")
        if self.stalling:
            self.open += 1
            try:
                await asyncio.Event().wait()
            finally:
                self.open -= 1
        return await self._service().Push(request_iterator, context)


async def start_wrapped(ps: PSWorld, shards: int, index: int) -> tuple[Wrapped, grpc.aio.Server]:
    """A real shard of ``index`` that advertises a server of its servicer behind a wrapper."""
    wrapped = Wrapped()
    server = grpc.aio.server()
    pb_grpc.add_ParameterServerServicer_to_server(wrapped, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    shard = Shard(shard_config(ps.address, shards, shard_index=index, advertise_port=port))
    wrapped.service = shard.service
    ps.shards.append(await shard.start())
    return wrapped, server


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED])
async def test_a_shards_deliberate_refusal_is_raised_at_once_whatever_its_code(code: grpc.StatusCode) -> None:
    ps = PSWorld(await start_world(1), [], [])
    wrapped, server = await start_wrapped(ps, 1, 0)
    try:
        client = ps.client_for(0, shard_wait_s=SHARD_WAIT_S)
        ps.clients = [client]
        await client.init({"w": np.zeros(8, np.float32)}, mode="async", optimizer=SGD)
        await client.pull()
        wrapped.refusing = code
        started = asyncio.get_running_loop().time()
        with pytest.raises(RingserveError, match=f"answered {code.name}: The wrapped shard refuses"):
            await client.push({"w": np.ones(8, np.float32)})
        assert asyncio.get_running_loop().time() - started < 2.0
        assert (wrapped.pushes, client.counts["retries"]) == (1, 0)
    finally:
        await ps.close()
        await server.stop(0)


async def test_when_one_shards_call_fails_the_calls_to_the_others_are_cancelled_before_it_is_raised() -> None:
    ps = PSWorld(await start_world(1), [], [])
    servers: list[grpc.aio.Server] = []
    try:
        await ps.start_shard(2, shard_index=0)
        wrapped, server = await start_wrapped(ps, 2, 1)
        servers.append(server)
        client = ps.client_for(0, round_timeout_s=30.0)
        ps.clients = [client]
        tensors = {"a": np.zeros(64, np.float32), "b": np.zeros(64, np.float32)}
        await client.init(tensors, mode="async", optimizer=SGD)
        await client.pull()
        assert all(link.pieces for link in client.links)
        wrapped.stalling = True
        bad = {key: np.ones(64, np.float64) for key in tensors}  # shard 0 refuses the dtype at once
        with pytest.raises(InvalidArgumentError, match="float64") as caught:
            await client.push(bad)
        assert not isinstance(caught.value, BaseExceptionGroup)
        assert wrapped.pushes == 1
        await until(lambda: wrapped.open == 0, timeout_s=5.0)  # shard 1's push was cancelled, not left to run
        wrapped.stalling = False
        assert await client.push({key: np.ones(64, np.float32) for key in tensors}) == ["applied", "applied"]
    finally:
        await ps.close()
        for server in servers:
            await server.stop(0)



async def test_a_push_cancelled_by_its_caller_is_cancelled_on_every_shard_and_not_asked_again() -> None:
    ps = PSWorld(await start_world(1), [], [])
    wrapped, server = await start_wrapped(ps, 1, 0)
    try:
        client = ps.client_for(0, shard_wait_s=SHARD_WAIT_S)
        ps.clients = [client]
        await client.init({"w": np.zeros(8, np.float32)}, mode="async", optimizer=SGD)
        await client.pull()
        wrapped.stalling = True
        pushing = asyncio.create_task(client.push({"w": np.ones(8, np.float32)}))
        await until(lambda: wrapped.open == 1)
        pushing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pushing
        await until(lambda: wrapped.open == 0)
        assert (wrapped.pushes, client.counts["retries"]) == (1, 0)
        wrapped.stalling = False
        assert await client.push({"w": np.ones(8, np.float32)}) == ["applied"]
    finally:
        await ps.close()
        await server.stop(0)
