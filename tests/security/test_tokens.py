"""The job token on every RPC of both services: without it or with a wrong one, UNAUTHENTICATED and
no change of state; with it, OK. The token never reaches a log line or a repr."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest
from _secure import TOKEN

from ringserve import InvalidArgumentError, RingserveError, Worker, WorkerConfig, healthcheck, wire
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.coordinator import membership
from ringserve.security import Security

pytestmark = pytest.mark.timeout(60)

RIGHT = (("authorization", f"Bearer {TOKEN}"),)
CREDENTIALS = {"none": (), "wrong": (("authorization", "Bearer not-the-token"),), "right": RIGHT}
EXPECTED = {"none": grpc.StatusCode.UNAUTHENTICATED, "wrong": grpc.StatusCode.UNAUTHENTICATED, "right": grpc.StatusCode.OK}
WORKER_ID = "w-0"


async def _one(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        return


async def _first_answer(call: Any) -> None:
    """A Heartbeats stream's first answer; a refused stream raises its status."""
    with contextlib.suppress(grpc.aio.AioRpcError):  # the refusal is read below
        await call.write(pb.HeartbeatRequest(worker_id=WORKER_ID, view_id=1, stalled=["x#1"], committed_step=9))
    try:
        if await call.read() is grpc.aio.EOF:
            raise AssertionError("the stream ended without an answer")
    finally:
        call.cancel()


async def _chunks() -> AsyncIterator[pb.ParamChunk]:
    yield pb.ParamChunk(key="p", offset=0, total_bytes=3, data=b"new")


# Each coordinator RPC, as a call that returns once it has been answered (a stream: its first message).
CALLS: dict[str, Callable[[pb_grpc.CoordinatorStub, Any], Awaitable[Any]]] = {
    "Join": lambda s, md: s.Join(pb.JoinRequest(address="127.0.0.1:9", hostname="h", worker_id="w-new"), metadata=md, timeout=5),
    "Leave": lambda s, md: s.Leave(pb.LeaveRequest(worker_id=WORKER_ID), metadata=md, timeout=5),
    "Heartbeat": lambda s, md: s.Heartbeat(pb.HeartbeatRequest(worker_id=WORKER_ID, view_id=1, stalled=["x#1"], committed_step=9),
                                           metadata=md, timeout=5),
    "Heartbeats": lambda s, md: _first_answer(s.Heartbeats(metadata=md, timeout=5)),
    "WatchView": lambda s, md: _one(s.WatchView(pb.WatchViewRequest(worker_id=WORKER_ID), metadata=md, timeout=5)),
    "ReportFailure": lambda s, md: s.ReportFailure(
        pb.ReportFailureRequest(reporter_id=WORKER_ID, view_id=1, suspect_rank=0, reason="test"), metadata=md, timeout=5),
    "Admit": lambda s, md: s.Admit(pb.AdmitRequest(worker_id=WORKER_ID, view_id=1), metadata=md, timeout=5),
    "PutParams": lambda s, md: s.PutParams(_chunks(), metadata=md, timeout=5),
    "GetParams": lambda s, md: _one(s.GetParams(pb.GetParamsRequest(key="p"), metadata=md, timeout=5)),
    "Status": lambda s, md: s.Status(pb.StatusRequest(), metadata=md, timeout=5),
    "CommitMark": lambda s, md: s.CommitMark(pb.CommitMarkRequest(worker_id=WORKER_ID), metadata=md, timeout=5),
    "RegisterShard": lambda s, md: s.RegisterShard(
        pb.RegisterShardRequest(shard_id="s", address="127.0.0.1:9", shards=1, index=-1, first=True), metadata=md, timeout=5),
    "ListShards": lambda s, md: s.ListShards(pb.ListShardsRequest(), metadata=md, timeout=5),
}


def test_every_rpc_of_the_coordinator_service_is_in_the_matrix() -> None:
    methods = pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name
    assert set(CALLS) == set(methods)


async def send(call: Any, frames: list[bytes]) -> Any:
    """Writes frames on a client stream and returns its answer; a refused stream's status wins
    over the failed write that reports it."""
    try:
        for frame in frames:
            await call.write(frame)
        await call.done_writing()
    except grpc.aio.AioRpcError:
        pass
    return await call


def snapshot(service: Any) -> tuple[Any, ...]:
    """Everything the coordinator keeps: membership, parameters, counters and stall reports."""
    state = service._state
    # Membership as a caller could change it; the bookkeeping a tick redoes (folded heartbeats,
    # whether a view needs another look) is left out, since ticks change it on their own.
    members = (state.workers, membership.seen(state), state.view, state.suspects, state.claims, state.admit,
               state.bump, state.check, state.held)
    return (members, dict(service.params._blobs), dict(service.params._versions), dict(service.counts),
            dict(service._counters), service.stalls.reported(), service.views_formed, service.prober.running, service.mark,
            service.heartbeat_streams.open,
            tuple((i, s.shard_id, s.address, s.seen_at, s.incarnation) for i, s in service.shards.slots.items()))


async def code_of(call: Awaitable[Any]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("who", list(CREDENTIALS))
@pytest.mark.parametrize("method", list(CALLS))
async def test_a_coordinator_rpc_needs_the_token_and_a_refused_one_changes_nothing(
    method: str, who: str, make_coordinator_config
) -> None:
    from ringserve import Coordinator

    async with Coordinator(make_coordinator_config(min_workers=1, token=TOKEN)) as coord:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            # A world of one worker, a stored blob: state for a refused call to disturb.
            await stub.Join(pb.JoinRequest(address="127.0.0.1:9", hostname="h", worker_id=WORKER_ID), metadata=RIGHT, timeout=5)
            await stub.PutParams(_chunks(), metadata=RIGHT, timeout=5)
            async with asyncio.timeout(5):
                while coord.service.view.view_id == 0:
                    await asyncio.sleep(0.01)
            before = snapshot(coord.service)
            assert await code_of(CALLS[method](stub, CREDENTIALS[who])) == EXPECTED[who]
            if who != "right":
                await asyncio.sleep(0.05)  # a tick or two: anything the call set off would show
                assert snapshot(coord.service) == before


async def test_the_peer_stream_needs_the_token_and_a_refused_one_changes_nothing(world_factory) -> None:
    world = await world_factory(2, coordinator={"token": TOKEN}, token=TOKEN)
    target = world.workers[1]
    hello = wire.encode(wire.FrameHeader(kind=wire.HELLO, view_id=0, sender_rank=0))
    for who, expected in EXPECTED.items():
        before = dataclasses.asdict(target.counters)
        async with grpc.aio.insecure_channel(target.address) as channel:
            call = channel.stream_unary("/ringserve.v1.Peer/Stream")(metadata=CREDENTIALS[who], timeout=5)
            assert await code_of(send(call, [hello])) == expected, who
        if who != "right":
            assert dataclasses.asdict(target.counters) == before
    outs = await world.each(lambda w: w.allreduce(np.arange(5.0), op="sum", name="after"))
    assert [o.tolist() for o in outs] == [[0.0, 2.0, 4.0, 6.0, 8.0]] * 2


async def test_reflection_and_unknown_methods_need_the_token_and_health_stays_open(make_coordinator_config) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from ringserve import Coordinator

    async with Coordinator(make_coordinator_config(token=TOKEN)) as coord:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            for who, expected in EXPECTED.items():
                async def ask(md: Any = CREDENTIALS[who]) -> None:
                    async def requests() -> AsyncIterator[Any]:
                        yield reflection_pb2.ServerReflectionRequest(list_services="")
                    await _one(stub.ServerReflectionInfo(requests(), metadata=md, timeout=5))
                assert await code_of(ask()) == expected, who
            unknown = channel.unary_unary("/ringserve.v1.Coordinator/NoSuchMethod")
            assert await code_of(unknown(b"", timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
            assert await code_of(unknown(b"", metadata=RIGHT, timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
        # Docker's and Kubernetes' probes cannot send a token: health answers without one.
        serving, message = await asyncio.to_thread(healthcheck.check, coord.address)
        assert serving, message


async def test_a_worker_with_a_wrong_token_cannot_join_and_leaves_no_trace(make_coordinator_config, make_worker_config) -> None:
    from ringserve import Coordinator

    async with Coordinator(make_coordinator_config(token=TOKEN)) as coord:
        before = snapshot(coord.service)
        for token in ("", "wrong"):
            worker = Worker(config=make_worker_config(coord.address, token=token))
            with pytest.raises(RingserveError, match=f"The coordinator at {coord.address} answered UNAUTHENTICATED"):
                await worker.start()
        assert snapshot(coord.service) == before


async def test_a_heartbeat_stream_with_a_wrong_token_is_refused_and_the_client_says_so(make_coordinator_config, make_worker_config) -> None:
    from ringserve import Coordinator
    from ringserve.worker.control.client import ControlClient

    async with Coordinator(make_coordinator_config(token=TOKEN)) as coord:
        member = ControlClient(make_worker_config(coord.address, token=TOKEN))
        stranger = ControlClient(make_worker_config(coord.address, token="wrong"))
        try:
            joined = await member.join(address="127.0.0.1:9", hostname="h", rank_hint=-1)
            async with asyncio.timeout(5):
                while coord.service.view.view_id == 0:
                    await asyncio.sleep(0.01)
            before = snapshot(coord.service)
            tasks = asyncio.all_tasks()
            with pytest.raises(RingserveError, match=f"The coordinator at {coord.address} answered UNAUTHENTICATED"):
                await stranger.heartbeat(joined.worker_id, 0, pb.WorkerCounters(collectives_done=5), ["x#1"])
            await asyncio.sleep(0.05)
            assert snapshot(coord.service) == before and coord.service.heartbeat_streams.open == 0
            # The refused stream left no task behind (grpc.aio's stream-stream interceptor would);
            # the coordinator's server (in this loop too) waits for calls in tasks of its own.
            assert [t for t in asyncio.all_tasks() - tasks if "AioServer" not in repr(t)] == []
            assert (await member.heartbeat(joined.worker_id, 0, pb.WorkerCounters())).known
            assert member.heartbeats.streaming and coord.service.heartbeat_streams.open == 1
        finally:
            await member.close()
            await stranger.close()


async def test_a_job_with_a_token_file_runs_and_the_token_is_never_logged_or_shown(
    world_factory, tmp_path, caplog
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    caplog.set_level(logging.DEBUG)
    world = await world_factory(2, coordinator={"token_file": str(token_file)}, token_file=str(token_file))
    outs = await world.each(lambda w: w.allgather(np.full(2, w.rank)))
    assert [o.tolist() for o in outs] == [[0, 0, 1, 1]] * 2
    await world.workers[0].close()
    assert TOKEN not in caplog.text
    assert "Bearer" not in caplog.text
    config = WorkerConfig(token=TOKEN)
    assert TOKEN not in repr(config) and TOKEN not in repr(Security.load(config))


async def test_an_empty_or_missing_token_file_is_an_error_at_start(tmp_path, make_worker_config) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, message in ((empty, "is empty"), (tmp_path / "missing", "could not be read")):
        worker = Worker(config=make_worker_config("127.0.0.1:1", token_file=str(path)))
        with pytest.raises(InvalidArgumentError, match=message):
            await worker.start()
    with pytest.raises(InvalidArgumentError, match=r"not both"):
        WorkerConfig(token="a", token_file=str(empty))
