"""Hostile input, through crafted raw clients against real servers: each is refused with a clear
status or dropped, never summed, and the server stays up with its state and its ring intact.

Most peer-server cases need a client that speaks the data plane as an impostor would:
``Impostor`` opens a stream to a worker's peer server under any HELLO and writes raw frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from _secure import TOKEN

from ringserve import Coordinator, ProtocolError, healthcheck, wire
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve._proto import peer_pb2
from ringserve.ring import predecessor

pytestmark = pytest.mark.timeout(60)

STREAM = "/ringserve.v1.Peer/Stream"
DESCRIPTOR = "allreduce float32 (4,) op=sum"


class Impostor:
    """A raw client stream to a peer server; ``code()`` is how the server ended it."""

    def __init__(self, address: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._channel = grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
        self.call = self._channel.stream_unary(STREAM, response_deserializer=peer_pb2.StreamSummary.FromString)(metadata=metadata)

    async def write(self, *frames: bytes) -> None:
        for frame in frames:
            # A call the server has already ended (refused) raises on write; its status tells why.
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await self.call.write(frame)

    async def code(self, timeout_s: float = 5.0) -> tuple[grpc.StatusCode, str]:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self.call.done_writing()
        try:
            async with asyncio.timeout(timeout_s):
                await self.call
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    async def close(self) -> None:
        self.call.cancel()
        await self._channel.close()


@pytest.fixture
async def impostors() -> AsyncIterator[Any]:
    made: list[Impostor] = []

    def make(address: str) -> Impostor:
        made.append(Impostor(address))
        return made[-1]

    yield make
    for impostor in made:
        await impostor.close()


def hello(view_id: int, sender_rank: int) -> bytes:
    return wire.encode(wire.FrameHeader(kind=wire.HELLO, view_id=view_id, sender_rank=sender_rank))


def data(view_id: int, key: str, step: int, values: Any, *, chunk: int = 0, dtype: int = peer_pb2.FLOAT32,
         count: int | None = None, descriptor: str = DESCRIPTOR, payload: bytes | None = None) -> bytes:
    body = np.asarray(values, dtype=np.float32).tobytes() if payload is None else payload
    header = wire.FrameHeader(
        kind=wire.DATA, view_id=view_id, sender_rank=0, op_key=key, descriptor=descriptor, step=step, chunk=chunk,
        dtype=dtype, count=len(body) // 4 if count is None else count,  # type: ignore[arg-type]
    )
    return wire.encode(header, body)


async def still_serving(world: Any, name: str) -> None:
    """The world's servers answer health checks and its ring still reduces correctly."""
    for w in world.workers:
        serving, message = await asyncio.to_thread(healthcheck.check, w.address)
        assert serving, message
    outs = await world.each(lambda w: w.allreduce(np.full(3, w.rank + 1, dtype=np.int64), op="sum", name=name))
    expected = sum(range(1, world.size + 1))
    assert [o.tolist() for o in outs] == [[expected] * 3] * world.size


# -- the peer server: malformed streams are refused with INVALID_ARGUMENT --------------------------


@pytest.mark.parametrize("first", [b"\xff\x00garbage", b"\x0a\x7f", wire.encode(wire.FrameHeader(kind=wire.DATA))],
                         ids=["garbage", "truncated-header", "data-before-hello"])
async def test_a_stream_that_does_not_open_with_a_valid_hello_is_refused(world_factory, impostors, first: bytes) -> None:
    world = await world_factory(2)
    impostor = impostors(world.workers[1].address)
    await impostor.write(first)
    code, details = await impostor.code()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "HELLO" in details or "could not be parsed" in details or "ended inside" in details
    await still_serving(world, "after-bad-open")


async def test_a_frame_larger_than_the_message_limit_is_refused_with_resource_exhausted(world_factory, impostors) -> None:
    world = await world_factory(2, chunk_bytes=64 << 10)
    target = world.workers[1]
    impostor = impostors(target.address)
    await impostor.write(hello(0, 0), data(0, "big#1", 0, np.zeros(target.config.max_message_bytes // 4 + 1)))
    code, _ = await impostor.code()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    await still_serving(world, "after-big")


async def test_a_frame_of_another_view_inside_a_stream_is_refused(world_factory, impostors) -> None:
    world = await world_factory(2)
    impostor = impostors(world.workers[1].address)
    await impostor.write(hello(0, 0), data(world.workers[1].view_id, "x#1", 0, [1, 2]))
    code, details = await impostor.code()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "opened for view 0 carried a frame of view" in details
    await still_serving(world, "after-other-view")


async def test_frames_of_a_past_view_are_dropped_and_counted_never_summed(world_factory, impostors) -> None:
    world = await world_factory(2)
    target = world.workers[1]
    rejected = target.counters.frames_rejected
    impostor = impostors(target.address)
    await impostor.write(hello(target.view_id - 1, 0), data(target.view_id - 1, "old#1", 0, [1e9, 1e9]))
    assert (await impostor.code())[0] == grpc.StatusCode.OK
    assert target.counters.frames_rejected == rejected + 1
    await still_serving(world, "old")


@pytest.mark.parametrize(("rank", "says"), [(3, "claims rank 3, but view {v} has ranks 0 to 2"),
                                           (1, "claims rank 1 of view {v}, the rank of the worker it reached")],
                         ids=["not a member", "the target itself"])
async def test_a_hello_that_claims_no_other_member_of_the_view_is_refused_at_once(
    world_factory, impostors, rank: int, says: str
) -> None:
    world = await world_factory(3)
    target = world.workers[1]
    impostor = impostors(target.address)
    await impostor.write(hello(target.view_id, rank))
    code, details = await impostor.code()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert says.format(v=target.view_id) in details
    await still_serving(world, f"after-claim-{rank}")


async def test_a_frame_from_a_member_that_does_not_precede_this_rank_in_its_ring_is_refused(world_factory, impostors) -> None:
    # Any member may stream to rank 1 (sub-rings), but the whole view's collectives reach rank 1
    # from rank 0 only: rank 2's frame for one of them is refused, and never summed.
    world = await world_factory(3)
    target = world.workers[1]
    impostor = impostors(target.address)
    await impostor.write(hello(target.view_id, 2), data(target.view_id, "claim#1", 0, [1, 2]))
    code, details = await impostor.code()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert (f"A frame of collective 'claim#1' came from rank 2, but rank 1 of view {target.view_id} receives "
            "that collective's frames from rank 0 only") in details
    await still_serving(world, "after-stray-sender")


async def test_a_frame_whose_key_names_a_ring_without_this_rank_is_refused(world_factory, impostors) -> None:
    world = await world_factory(3)
    target = world.workers[1]
    impostor = impostors(target.address)
    await impostor.write(hello(target.view_id, 0), data(target.view_id, "sub#1/0.2", 0, [1, 2]))
    code, details = await impostor.code()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "names a ring (0.2) that is not made of distinct ranks of view" in details
    await still_serving(world, "after-foreign-ring")


async def test_a_refused_impostor_leaves_the_real_ring_working(world_factory, impostors) -> None:
    world = await world_factory(3, collective_timeout_s=5.0)
    target = world.workers[1]
    impostor = impostors(target.address)
    await impostor.write(hello(target.view_id, 2), data(target.view_id, "claim#1", 0, [1, 2]))
    assert (await impostor.code())[0] == grpc.StatusCode.INVALID_ARGUMENT
    await still_serving(world, "after-claim")


# -- the peer server: frames from the view's predecessor that break the contract ---------------------


async def forged_allreduce(world: Any, impostors: Any, name: str, *frames_of: Any) -> tuple[Any, Impostor]:
    """Rank 1 of a world of 2 runs ``allreduce([1, 1, 1, 1], sum)`` alone, fed by an impostor that
    speaks as rank 0 and writes ``frames_of(view, key)``; returns rank 1's outcome (a result or an
    exception) and the impostor, whose stream stays open so that the real ring is untouched."""
    target = world.workers[1]
    view = target.view_id
    impostor = impostors(target.address)
    await impostor.write(hello(view, 0))
    for make in frames_of:
        await impostor.write(*make(view, f"{name}#1"))
    try:
        async with asyncio.timeout(3):
            outcome: Any = await target.allreduce(np.ones(4, dtype=np.float32), op="sum", name=name)
    except Exception as exc:
        outcome = exc
    return outcome, impostor


def honest(view: int, key: str) -> list[bytes]:
    """Rank 0's part for rank 1's segment (elements 2..3), then the reduced segment 0."""
    return [data(view, key, 0, [10, 10]), data(view, key, 1, [11, 11])]


async def test_forged_frames_that_keep_the_contract_complete_the_collective(world_factory, impostors) -> None:
    world = await world_factory(2)
    outcome, _ = await forged_allreduce(world, impostors, "honest", honest)
    assert outcome.tolist() == [11.0] * 4


async def test_a_frame_with_a_wrong_payload_length_fails_the_collective_and_is_never_summed(world_factory, impostors) -> None:
    world = await world_factory(2)
    outcome, _ = await forged_allreduce(world, impostors, "short", lambda v, k: [data(v, k, 0, [10, 10, 10])])
    assert isinstance(outcome, ProtocolError), outcome
    assert "carries 3 elements of dtype code 2 in 12 bytes, where 2 elements of float32 were expected" in str(outcome)
    await still_serving(world, "after-short")


async def test_frames_of_another_collective_or_a_chunk_out_of_range_are_never_summed(world_factory, impostors) -> None:
    world = await world_factory(2)

    def strays(view: int, key: str) -> list[bytes]:
        return [
            data(view, "someone-else#1", 0, [1e6, 1e6]),      # another op's inbox
            data(view, key, 0, [1e6, 1e6], chunk=7),           # a chunk the segment does not have
            data(view, key, 9, [1e6, 1e6]),                    # a step the ring does not have
        ]

    outcome, _ = await forged_allreduce(world, impostors, "strays", strays, honest)
    assert outcome.tolist() == [11.0] * 4
    await still_serving(world, "after-strays")


async def test_a_chunk_sent_twice_is_refused(world_factory, impostors) -> None:
    world = await world_factory(2)
    target = world.workers[1]
    impostor = impostors(target.address)
    frame = data(target.view_id, "twice#1", 0, [1, 1])
    await impostor.write(hello(target.view_id, 0), frame, frame)
    code, details = await impostor.code()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "arrived twice" in details


@pytest.mark.parametrize("field", ["dtype", "count"])
async def test_a_frame_whose_dtype_or_count_disagrees_with_the_collective_is_never_summed(world_factory, impostors, field: str) -> None:
    world = await world_factory(2)
    bad = {"dtype": {"dtype": peer_pb2.INT32}, "count": {"count": 3}}[field]
    outcome, _ = await forged_allreduce(
        world, impostors, f"bad-{field}", lambda v, k: [data(v, k, 0, [10, 10], **bad), data(v, k, 1, [11, 11])]
    )
    assert isinstance(outcome, ProtocolError), outcome


# -- floods and limits -------------------------------------------------------------------------------


async def test_a_flood_of_streams_past_the_cap_gets_resource_exhausted_and_the_ring_survives(world_factory, impostors) -> None:
    world = await world_factory(2, max_unverified_streams=8)
    await still_serving(world, "before-flood")
    target = world.workers[1]
    # A stream call starts at once: no frame needs writing for it to take a slot or be refused (and a
    # write racing the refusal would end the call INTERNAL on the client, not as the server said).
    flood = [impostors(target.address) for _ in range(20)]
    async with asyncio.timeout(10):  # the 8 that fit stay open; the others are refused
        while len(refused := [i for i in flood if i.call.done()]) < 12:
            await asyncio.sleep(0.02)
    for impostor in refused:
        code = await impostor.code(1)
        assert code[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, code
    for impostor in flood:
        await impostor.close()
    await asyncio.sleep(0.1)
    await still_serving(world, "after-flood")


async def test_a_flood_of_watch_streams_on_the_coordinator_is_capped_and_it_keeps_serving(make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(max_concurrent_rpcs=8)) as coord:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            calls = [stub.WatchView(pb.WatchViewRequest(worker_id=f"w{i}")) for i in range(20)]
            async with asyncio.timeout(10):  # the 8 that fit stay open; the others are refused
                while sum(c.done() for c in calls) < 12:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            codes = [await c.code() for c in calls if c.done()]
            assert len(codes) >= 12 and set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            for c in calls:
                c.cancel()
            await asyncio.sleep(0.1)
            assert (await stub.Status(pb.StatusRequest(), timeout=5)).view.view_id == 0


async def test_a_message_over_the_coordinators_limit_is_refused_and_stores_nothing(make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(max_message_bytes=1 << 20)) as coord:
        async with grpc.aio.insecure_channel(coord.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
            stub = pb_grpc.CoordinatorStub(channel)

            async def chunks() -> AsyncIterator[pb.ParamChunk]:
                yield pb.ParamChunk(key="p", offset=0, total_bytes=2 << 20, data=bytes(2 << 20))

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PutParams(chunks(), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert coord.service.params.get("p") is None and coord.service.params.stored_bytes == 0
            assert (await stub.Status(pb.StatusRequest(), timeout=5)).min_workers == 1


# -- the coordinator: replays and false claims --------------------------------------------------------


async def test_a_replayed_join_or_heartbeat_changes_no_view(make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(min_workers=1, token=TOKEN)) as coord:
        md = (("authorization", f"Bearer {TOKEN}"),)
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            join = pb.JoinRequest(address="127.0.0.1:9", hostname="h", rank_hint=0)
            worker_id = (await stub.Join(join, metadata=md, timeout=5)).worker_id
            async with asyncio.timeout(5):
                while coord.service.view.view_id == 0:
                    await asyncio.sleep(0.01)
            view = coord.service.view
            replay = pb.JoinRequest(address="127.0.0.1:9", hostname="h", rank_hint=0, worker_id=worker_id)
            beat = pb.HeartbeatRequest(worker_id=worker_id, view_id=view.view_id)
            for _ in range(3):
                assert (await stub.Join(replay, metadata=md, timeout=5)).worker_id == worker_id
                assert (await stub.Heartbeat(beat, metadata=md, timeout=5)).known
            await asyncio.sleep(0.2)
            assert coord.service.view == view
            assert coord.service.views_formed == 1


@pytest.mark.parametrize("claim", [dict(rank=5, view_size=2), dict(rank=0, view_size=4_000_000_000)], ids=["rank-past-size", "huge-view"])
async def test_a_rejoin_that_claims_an_impossible_rank_is_refused_and_changes_nothing(make_coordinator_config, claim: dict[str, int]) -> None:
    async with Coordinator(make_coordinator_config(min_workers=1)) as coord:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            before = coord.service._state
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Join(pb.JoinRequest(address="127.0.0.1:9", worker_id="w", view_id=7, **claim), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "must be below the size" in (info.value.details() or "")
            assert coord.service._state == before
            assert (await stub.Status(pb.StatusRequest(), timeout=5)).pending_workers == 0


async def test_a_worker_never_unpickles_objects_from_an_unauthenticated_stream(world_factory, impostors) -> None:
    import pickle

    world = await world_factory(2, coordinator={"token": TOKEN}, token=TOKEN)
    target = world.workers[1]
    bomb = pickle.dumps(RuntimeError("unpickled"))
    received = target.counters.bytes_received
    impostor = impostors(target.address)  # no token
    await impostor.write(hello(target.view_id, 0), data(target.view_id, "obj#1", 0, None, payload=bomb))
    assert (await impostor.code())[0] == grpc.StatusCode.UNAUTHENTICATED
    assert target.counters.bytes_received == received
    outs = await world.each(lambda w: w.broadcast_object({"rank": w.rank}, root=0, name="obj"))
    assert outs == [{"rank": 0}] * 2



async def test_two_rejoins_that_claim_one_rank_neither_crash_the_coordinator_nor_overfill_the_view(make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(min_workers=1, max_workers=2, heartbeat_timeout_s=0.5,
                                                   heartbeat_interval_s=0.1)) as coord:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            views = stub.WatchView(pb.WatchViewRequest(worker_id="watcher"))
            for worker_id in ("a", "b", "c"):
                claim = pb.JoinRequest(address=f"127.0.0.1:{ord(worker_id)}", worker_id=worker_id, view_id=9, rank=0, view_size=2)
                await stub.Join(claim, timeout=5)

            async def alive() -> None:  # the claimants keep beating; only rank 1 never comes back
                while True:
                    for worker_id in ("a", "b", "c"):
                        await stub.Heartbeat(pb.HeartbeatRequest(worker_id=worker_id), timeout=5)
                    await asyncio.sleep(0.05)

            beating = asyncio.create_task(alive())
            try:
                async with asyncio.timeout(5):
                    async for view in views:
                        if view.view_id >= 10:  # view 10 forms without the missing rank 1
                            break
            finally:
                beating.cancel()
                views.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await beating
            assert view.view_id == 10
            assert [m.worker_id for m in view.members] == ["a"]
            assert coord._ticker is not None and not coord._ticker.done()
            assert (await stub.Status(pb.StatusRequest(), timeout=5)).view.view_id >= 10


async def test_a_hello_for_a_view_not_yet_installed_is_let_in_when_the_view_comes_and_a_wrong_one_is_refused(
    world_factory, impostors
) -> None:
    world = await world_factory(3, coordinator={"min_workers": 2}, peer_hello_timeout_s=1.0)
    target, leaving = world.workers[0], world.workers[2]
    future = target.view_id + 1
    # The next view has two ranks: one of these claims the target's predecessor there, the other
    # claims the target itself; a third claims a view that never comes. None sends anything after
    # its HELLO.
    claims = {rank: impostors(target.address) for rank in (0, 1)}
    for rank, impostor in claims.items():
        await impostor.write(hello(future, rank))
    never = impostors(target.address)
    await never.write(hello(future + 100, 0))
    await leaving.close()
    async with asyncio.timeout(5):
        while target.latest_view < future:
            await asyncio.sleep(0.01)
    world.workers.remove(leaving)
    true_rank = predecessor(target.rank, target.size)
    code, details = await claims[1 - true_rank].code(1)  # refused as soon as the view came
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"claims rank {1 - true_rank} of view {future}, the rank of the worker it reached" in details
    await asyncio.sleep(1.5)  # past the deadline
    assert not claims[true_rank].call.done()  # verified when the view came: no deadline
    code, details = await never.code(1)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"sent a HELLO (view {future + 100}, rank 0) that no view of this worker verified within 1 s" in details
