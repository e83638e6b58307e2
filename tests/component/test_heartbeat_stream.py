"""The Heartbeats stream on one real coordinator: raw streams speaking the wire contract, and the
worker's client of it (HeartbeatStream) with its unary fallback, deadline and re-opening."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from worlds import coordinator_config

from ringserve import Coordinator, CoordinatorUnreachableError, RingserveError
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.coordinator.server import SERVICE_NAME
from ringserve.coordinator.service import CoordinatorService
from ringserve.worker.control import client as control
from ringserve.worker.control.client import HeartbeatStream

Stub = pb_grpc.CoordinatorStub
# Each channel on a connection of its own, as each worker's is.
OWN = [("grpc.use_local_subchannel_pool", 1)]


@pytest_asyncio.fixture
async def stub(coordinator: Coordinator) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        yield Stub(channel)


async def join(stub: Stub, worker_id: str = "") -> str:
    answer = await stub.Join(pb.JoinRequest(address="127.0.0.1:9", hostname="h", worker_id=worker_id), timeout=5)
    return answer.worker_id


async def until(predicate: object, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def ask(call: grpc.aio.StreamStreamCall, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
    await call.write(request)
    answer = await call.read()
    assert isinstance(answer, pb.HeartbeatResponse), answer
    return answer


def fields(answer: pb.HeartbeatResponse) -> tuple[object, ...]:
    return (answer.view_id, answer.known, answer.pending_workers, list(answer.stall_warnings),
            answer.HasField("mark_step"), answer.mark_step, answer.mark_lineage)


@pytest.mark.parametrize("coordinator", [{"min_workers": 2, "max_workers": 3}], indirect=True)
async def test_each_heartbeat_on_a_stream_is_answered_in_order_as_the_unary_call_answers_it(
    coordinator: Coordinator, stub: Stub
) -> None:
    a, b = await join(stub), await join(stub)
    await until(lambda: coordinator.service.view.view_id == 1)
    await join(stub)  # joins a running world: waits for an Admit, so answers count one pending worker
    # b reports a stall by a unary call, so that a's answers name who has not submitted it.
    await stub.Heartbeat(pb.HeartbeatRequest(worker_id=b, view_id=1, stalled=["grad#1"]), timeout=5)
    requests = [
        pb.HeartbeatRequest(worker_id=a, view_id=1, counters=pb.WorkerCounters(collectives_done=3)),
        pb.HeartbeatRequest(worker_id=a, view_id=1, stalled=["grad#1"], committed_step=7, committed_lineage=0),
        pb.HeartbeatRequest(worker_id=a, view_id=1, stalled=["grad#1"]),
    ]
    beats_before = coordinator.service.counts["heartbeats"]
    stream = stub.Heartbeats()
    streamed, unary = [], []
    for request in requests:  # each one on the stream, then the same as a unary call
        streamed.append(fields(await ask(stream, request)))
        unary.append(fields(await stub.Heartbeat(request, timeout=5)))
    assert streamed == unary
    assert streamed[0] == (1, True, 1, [], False, 0, 0)
    assert streamed[1][4:6] == (True, 7)
    assert streamed[2][3] == ["'grad#1': ranks none have not submitted it; ranks 0, 1 wait"]
    assert coordinator.service.counts["heartbeats"] == beats_before + 6
    assert coordinator.service.heartbeat_streams.open == 1 and coordinator.service.metrics()["heartbeat_streams"] == 1
    stream.cancel()
    await until(lambda: coordinator.service.heartbeat_streams.open == 0)


async def test_a_stream_naming_an_unknown_worker_is_answered_unknown_and_ended(coordinator: Coordinator, stub: Stub) -> None:
    stream = stub.Heartbeats()
    answer = await ask(stream, pb.HeartbeatRequest(worker_id="nobody"))
    assert not answer.known
    assert await stream.read() is grpc.aio.EOF and await stream.code() == grpc.StatusCode.OK
    await until(lambda: coordinator.service.heartbeat_streams.open == 0)
    assert coordinator.service.counts["heartbeats"] == 0


async def test_a_newer_stream_of_a_worker_replaces_the_older_one_which_ends_on_its_next_beat(
    coordinator: Coordinator, stub: Stub
) -> None:
    wid = await join(stub)
    old, new = stub.Heartbeats(), stub.Heartbeats()
    assert (await ask(old, pb.HeartbeatRequest(worker_id=wid))).known
    assert (await ask(new, pb.HeartbeatRequest(worker_id=wid))).known
    await old.write(pb.HeartbeatRequest(worker_id=wid))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await old.read()
    assert info.value.code() == grpc.StatusCode.ABORTED and "newer heartbeat stream" in str(info.value.details())
    assert (await ask(new, pb.HeartbeatRequest(worker_id=wid))).known
    await until(lambda: coordinator.service.heartbeat_streams.open == 1)
    new.cancel()


async def test_a_stream_that_names_another_worker_later_is_refused(coordinator: Coordinator, stub: Stub) -> None:
    a, b = await join(stub), await join(stub)
    stream = stub.Heartbeats()
    assert (await ask(stream, pb.HeartbeatRequest(worker_id=a))).known
    await stream.write(pb.HeartbeatRequest(worker_id=b))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and repr(b) in str(info.value.details())


@pytest.mark.parametrize("coordinator", [{"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.6}], indirect=True)
async def test_a_silent_stream_is_ended_after_the_heartbeat_timeout_and_its_slot_freed(coordinator: Coordinator, stub: Stub) -> None:
    wid = await join(stub)
    stream = stub.Heartbeats()
    assert (await ask(stream, pb.HeartbeatRequest(worker_id=wid))).known
    began = time.monotonic()
    code = await stream.code()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "0.6 s" in str(await stream.details())
    assert 0.5 < time.monotonic() - began < 3.0
    silent = stub.Heartbeats()  # one that never sends is ended too
    assert await silent.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The client hears the status before the server's handler has finished and freed the slot.
    await until(lambda: coordinator.service.heartbeat_streams.open == 0)


@pytest.mark.parametrize("coordinator", [{"max_heartbeat_streams": 2}], indirect=True)
async def test_streams_past_the_cap_are_refused_naming_it_and_their_workers_heartbeat_by_unary_calls(
    coordinator: Coordinator,
) -> None:
    channels = [grpc.aio.insecure_channel(coordinator.address, options=OWN) for _ in range(3)]
    try:
        stubs = [Stub(c) for c in channels]
        ids = [await join(s) for s in stubs]
        beats = [HeartbeatStream(s, coordinator.address, 5.0) for s in stubs]
        answers = [await b.beat(pb.HeartbeatRequest(worker_id=w)) for b, w in zip(beats, ids, strict=True)]
        assert all(a.known for a in answers)
        assert [b.streaming for b in beats] == [True, True, False]
        assert coordinator.service.heartbeat_streams.open == 2
        refused = stubs[2].Heartbeats()
        await refused.write(pb.HeartbeatRequest(worker_id=ids[2]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await refused.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_heartbeat_streams" in str(info.value.details())
        # Every beat was counted, whichever way it came; a freed slot takes a stream again.
        assert coordinator.service.counts["heartbeats"] == 3
        beats[0].close()
        await until(lambda: coordinator.service.heartbeat_streams.open == 1)
        fresh = stubs[2].Heartbeats()
        assert (await ask(fresh, pb.HeartbeatRequest(worker_id=ids[2]))).known
        fresh.cancel()
    finally:
        for c in channels:
            await c.close()


async def test_a_worker_heartbeats_on_one_stream(coordinator: Coordinator, stub: Stub) -> None:
    wid = await join(stub)
    beats = HeartbeatStream(stub, coordinator.address, 5.0)
    for _ in range(20):
        assert (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known
    assert beats.streams_opened == 1 and beats.streaming
    assert coordinator.service.counts["heartbeats"] == 20 and coordinator.service.heartbeat_streams.open == 1
    beats.close()
    await until(lambda: coordinator.service.heartbeat_streams.open == 0)


async def test_an_unknown_worker_is_told_and_after_its_rejoin_beats_on_a_new_stream(coordinator: Coordinator, stub: Stub) -> None:
    wid = await join(stub)
    beats = HeartbeatStream(stub, coordinator.address, 5.0)
    assert (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known
    await stub.Leave(pb.LeaveRequest(worker_id=wid), timeout=5)
    assert not (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known
    assert not beats.streaming
    await join(stub, wid)
    assert (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known
    assert beats.streaming and beats.streams_opened == 2
    beats.close()


async def test_a_coordinator_without_the_stream_is_heartbeated_by_unary_calls_and_asked_again_only_later() -> None:
    """An older coordinator: the same service, without the Heartbeats method."""
    service = CoordinatorService(coordinator_config())
    server = grpc.aio.server()
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            service.Join, request_deserializer=pb.JoinRequest.FromString, response_serializer=pb.JoinResponse.SerializeToString),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            service.Heartbeat, request_deserializer=pb.HeartbeatRequest.FromString,
            response_serializer=pb.HeartbeatResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = Stub(channel)
            wid = await join(stub)
            beats = HeartbeatStream(stub, f"127.0.0.1:{port}", 5.0)
            for _ in range(5):
                assert (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known
            assert beats.streams_opened == 1 and not beats.streaming
            assert service.counts["heartbeats"] == 5
    finally:
        await server.stop(0)


async def _coordinator_process(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ringserve.cli", "coordinator", "--port", "0", *args, stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    found = re.search(r"listening on (\S+)", line)
    assert found, line
    return proc, found.group(1)


@pytest.mark.timeout(60)
async def test_a_heartbeat_unanswered_within_the_deadline_is_missed_and_the_stream_is_opened_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(control, "REOPEN_FIRST_S", 0.5)
    proc, address = await _coordinator_process("--heartbeat-interval", "1", "--heartbeat-timeout", "20")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = Stub(channel)
            wid = await join(stub)
            beats = HeartbeatStream(stub, address, 0.5)
            assert (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known and beats.streaming
            os.kill(proc.pid, signal.SIGSTOP)  # a hung coordinator: the connection stays up, nothing answers
            began = time.monotonic()
            with pytest.raises(CoordinatorUnreachableError, match=r"no answer on the heartbeat stream"):
                await beats.beat(pb.HeartbeatRequest(worker_id=wid))
            assert 0.45 < time.monotonic() - began < 1.5
            assert not beats.streaming
            os.kill(proc.pid, signal.SIGCONT)
            # Within the backoff the beat goes as a unary call; after it, on a new stream.
            assert (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known and not beats.streaming
            await asyncio.sleep(0.5)
            assert (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known and beats.streaming
            assert beats.streams_opened == 2
            beats.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_a_stopped_coordinator_fails_the_beat_as_unreachable(coordinator: Coordinator) -> None:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        stub = Stub(channel)
        wid = await join(stub)
        beats = HeartbeatStream(stub, coordinator.address, 2.0)
        assert (await beats.beat(pb.HeartbeatRequest(worker_id=wid))).known
        await coordinator.stop()
        began = time.monotonic()
        with pytest.raises(RingserveError) as info:
            await beats.beat(pb.HeartbeatRequest(worker_id=wid))
        assert isinstance(info.value, CoordinatorUnreachableError) and time.monotonic() - began < 2.5
        assert not beats.streaming


@pytest.mark.parametrize("coordinator", [{"heartbeat_interval_s": 0.2, "max_heartbeats_per_s": 5.0}], indirect=True)
async def test_joins_and_answers_carry_the_interval_stretched_for_the_workers_known(coordinator: Coordinator, stub: Stub) -> None:
    first = await stub.Join(pb.JoinRequest(address="127.0.0.1:9", hostname="h"), timeout=5)
    assert first.heartbeat_interval_s == pytest.approx(0.2)
    ids = [first.worker_id] + [await join(stub) for _ in range(3)]
    stream = stub.Heartbeats()
    answer = await ask(stream, pb.HeartbeatRequest(worker_id=ids[0]))
    assert answer.heartbeat_interval_s == pytest.approx(0.8)  # 4 workers at 5 beats a second in all
    late = await stub.Join(pb.JoinRequest(address="127.0.0.1:9", hostname="h"), timeout=5)
    assert late.heartbeat_interval_s == pytest.approx(1.0)
    stream.cancel()
