"""The coordinator's resources stay bounded under floods: parameter bytes, WatchView streams, silent
and idle connections; and its members keep heartbeating and Status keeps answering meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from swarm import Scale

from ringserve import Coordinator
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


async def put(stub: pb_grpc.CoordinatorStub, key: str, size: int, chunk: int = MiB) -> int | grpc.StatusCode:
    """Puts ``size`` bytes under ``key``; the version, or the code it was refused with."""

    async def chunks() -> AsyncIterator[pb.ParamChunk]:
        for offset in range(0, max(size, 1), chunk):
            yield pb.ParamChunk(key=key, offset=offset, total_bytes=size, data=bytes(min(chunk, size - offset)))

    try:
        return int((await stub.PutParams(chunks(), timeout=20)).version)
    except grpc.aio.AioRpcError as exc:
        return exc.code()


# A put refused while its client still streams may end INTERNAL on the client instead of with the
# server's status: grpc.aio overwrites it when a later write fails (grpc/grpc#36066).
REFUSED = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL}


async def test_parameters_past_the_cap_are_refused_naming_it_and_a_put_under_a_used_key_replaces_the_blob(make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(max_param_bytes=8 * MiB)) as coord:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            store = coord.service.params
            for i in range(10):
                assert await put(stub, "a", 3 * MiB, chunk=3 * MiB) == i + 1
            assert store.stored_bytes == 3 * MiB  # replaced, never accumulated
            assert await put(stub, "b", 3 * MiB, chunk=3 * MiB) == 1
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.PutParams(iter([pb.ParamChunk(key="c", total_bytes=3 * MiB, data=bytes(3 * MiB))]), timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_param_bytes" in (refused.value.details() or "") and str(8 * MiB) in (refused.value.details() or "")
            assert (store.stored_bytes, store.streaming_bytes, store.get("c")) == (6 * MiB, 0, None)
            assert await put(stub, "a", 1) == 11
            assert store.stored_bytes == 3 * MiB + 1
            assert await put(stub, "c", 3 * MiB) == 1


async def test_a_put_in_flight_holds_its_declared_size_against_the_cap_until_it_ends(make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(max_param_bytes=8 * MiB)) as coord:
        async with grpc.aio.insecure_channel(coord.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            store = coord.service.params
            slow = stub.PutParams(timeout=20)
            await slow.write(pb.ParamChunk(key="big", offset=0, total_bytes=6 * MiB, data=bytes(MiB)))
            async with asyncio.timeout(5):
                while store.streaming_bytes != 6 * MiB:
                    await asyncio.sleep(0.01)
            assert await put(stub, "other", 3 * MiB, chunk=3 * MiB) == grpc.StatusCode.RESOURCE_EXHAUSTED
            slow.cancel()
            async with asyncio.timeout(5):
                while store.streaming_bytes:
                    await asyncio.sleep(0.01)
            assert await put(stub, "other", 3 * MiB) == 1
            # Puts at once are admitted whole or refused at once: two of five fit.
            results = await asyncio.gather(*(put(stub, f"k{i}", 2 * MiB) for i in range(5)))
            assert sorted(r for r in results if isinstance(r, int)) == [1, 1]
            assert set(results) - {1} <= REFUSED
            assert (store.stored_bytes, store.streaming_bytes) == (7 * MiB, 0)


async def test_watch_streams_are_capped_per_worker_id_and_in_all_and_released_when_they_end(make_coordinator_config) -> None:
    config = make_coordinator_config(max_watch_streams=6, max_watches_per_worker=2)
    async with Coordinator(config) as coord, grpc.aio.insecure_channel(coord.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)

        async def refusal(worker_id: str) -> tuple[grpc.StatusCode, str]:
            """How a new stream under ``worker_id`` ends: OK if it is still open after a while."""
            call = stub.WatchView(pb.WatchViewRequest(worker_id=worker_id))
            calls.append(call)
            # Polled, not read with a timeout: a cancelled read would cancel the call.
            for _ in range(20):
                if call.done():
                    return await call.code(), await call.details()
                await asyncio.sleep(0.01)
            return grpc.StatusCode.OK, ""

        calls: list[grpc.aio.UnaryStreamCall] = []
        assert [(await refusal("w"))[0] for _ in range(2)] == [grpc.StatusCode.OK] * 2
        code, details = await refusal("w")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_watches_per_worker" in details
        # Unknown worker ids are served too, within the cap on all streams.
        assert [(await refusal(f"stranger-{i}"))[0] for i in range(4)] == [grpc.StatusCode.OK] * 4
        code, details = await refusal("stranger-4")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_watch_streams" in details
        assert coord.service.watch_streams == 6
        for call in calls:
            call.cancel()
        async with asyncio.timeout(5):
            while coord.service.watch_streams:
                await asyncio.sleep(0.01)
        assert (await refusal("w"))[0] == grpc.StatusCode.OK
        calls[-1].cancel()


async def test_silent_sockets_and_idle_connections_are_closed_but_a_long_watch_stream_is_kept(make_coordinator_config) -> None:
    config = make_coordinator_config(handshake_timeout_s=0.5, idle_connection_s=1.0, min_workers=1, settle_s=0.0)
    async with Coordinator(config) as coord:
        host, port = coord.address.rsplit(":", 1)
        sockets = [await asyncio.open_connection(host, int(port)) for _ in range(300)]
        try:
            async with asyncio.timeout(5):  # each reads the server's preface, then the end
                await asyncio.gather(*(reader.read() for reader, _ in sockets))
        finally:
            for _, writer in sockets:
                writer.close()
        # Each channel on a connection of its own (gRPC would otherwise share one between them).
        own = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(coord.address, options=own) as idle, \
                grpc.aio.insecure_channel(coord.address, options=own) as busy:
            await pb_grpc.CoordinatorStub(idle).Status(pb.StatusRequest(), timeout=5)
            stub = pb_grpc.CoordinatorStub(busy)
            views = stub.WatchView(pb.WatchViewRequest(worker_id="watcher"))
            await asyncio.sleep(2.5)
            # The idle connection was closed (the channel went back to IDLE); the one carrying
            # the stream was not: a view formed now still arrives on it.
            assert idle.get_state() == grpc.ChannelConnectivity.IDLE
            await stub.Join(pb.JoinRequest(address="127.0.0.1:9", hostname="h"), timeout=5)
            async with asyncio.timeout(5):
                view = await views.read()
            assert isinstance(view, pb.View) and view.view_id == 1
            views.cancel()


async def _flood(scale: Scale, *, sockets: int, watches: int, puts: int) -> tuple[float, int]:
    """Floods the coordinator of ``scale`` while its members heartbeat; returns the slowest Status
    and the coordinator's largest RSS seen."""
    host, port = scale.address.rsplit(":", 1)
    opened = [await asyncio.open_connection(host, int(port)) for _ in range(sockets)]
    channels = [grpc.aio.insecure_channel(scale.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(8)]
    calls = [pb_grpc.CoordinatorStub(channels[i % 8]).WatchView(pb.WatchViewRequest(worker_id=f"flood-{i}"))
             for i in range(watches)]
    slowest, peak = 0.0, 0
    try:
        for round_ in range(3):
            # The first round fills the store up to its cap; the next ones find it full.
            keys = [f"k{i}" if not round_ else f"more-{round_}-{i}" for i in range(puts)]
            results = await asyncio.gather(*(put(scale.stub, key, 8 * MiB) for key in keys))
            stored = [r for r in results if isinstance(r, int)]
            assert set(results) - set(stored) <= REFUSED and (len(stored) > 0) == (round_ == 0)
            peak = max(peak, scale.coordinator_rss_bytes())
            began = time.monotonic()
            status = await scale.stub.Status(pb.StatusRequest(limit=20), timeout=5)
            slowest = max(slowest, time.monotonic() - began)
            assert status.view_size == scale.n
    finally:
        for _, writer in opened:
            writer.close()
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
    # Every blob replaced by an empty one: the store gives its memory back.
    assert all(isinstance(r, int) for r in [await put(scale.stub, f"k{i}", 0) for i in range(puts)])
    return slowest, peak


async def _rss_settles(scale: Scale, limit: int, timeout_s: float) -> None:
    rss = scale.coordinator_rss_bytes()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while (rss := scale.coordinator_rss_bytes()) > limit:
                await asyncio.sleep(0.25)
    assert rss <= limit, f"the coordinator's RSS stayed at {rss / MiB:.0f} MiB, above {limit / MiB:.0f} MiB"


@pytest.mark.timeout(90)
async def test_a_flood_of_puts_sockets_and_streams_leaves_members_heartbeating_status_fast_and_memory_returned() -> None:
    args = ["--max-param-bytes", str(64 * MiB), "--handshake-timeout-seconds", "1", "--max-watch-streams", "200"]
    async with Scale(20, procs=1, interval=0.25, timeout=2.0, settle=0.2, extra_args=args) as scale:
        await scale.start_swarms()
        await scale.wait_view(lambda v: len(v.members) == 20, 10)
        await asyncio.sleep(0.5)
        before = scale.coordinator_rss_bytes()
        slowest, peak = await _flood(scale, sockets=500, watches=300, puts=10)
        assert slowest < 1.0
        assert peak > before + 64 * MiB  # the store filled up to its cap
        await _rss_settles(scale, before + 48 * MiB, timeout_s=15)
        assert [v.view_id for v in scale.views] == [1]
        report = await scale.report()
        assert report["unknown"] == 0 and report["errors"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_bigger_flood_against_two_hundred_members_changes_no_view_and_gives_its_memory_back() -> None:
    args = ["--max-param-bytes", str(256 * MiB), "--handshake-timeout-seconds", "2", "--max-watch-streams", "1000"]
    async with Scale(200, procs=1, interval=0.5, timeout=4.0, settle=0.5, extra_args=args) as scale:
        await scale.start_swarms()
        await scale.wait_view(lambda v: len(v.members) == 200, 20)
        await asyncio.sleep(1)
        before = scale.coordinator_rss_bytes()
        slowest, peak = await _flood(scale, sockets=2000, watches=2000, puts=40)
        assert slowest < 1.0
        assert peak > before + 256 * MiB
        # Not all of it: thousands of connections and streams leave some of Python's and gRPC's
        # small allocations behind, and the members' heartbeat streams, live through the flood,
        # keep the allocator from handing back some of the pages it took (measured with unary
        # heartbeats: 65 MiB before, 110 to 180 after; on streams, 69 before, 180 to 240 after,
        # 490 to 650 at the peak; three floods in a row end at 221 and 231 MiB alike, so it is
        # not a leak). The 256 MiB of puts not given back would still show.
        await _rss_settles(scale, before + 180 * MiB, timeout_s=30)
        assert [v.view_id for v in scale.views] == [1]
        report = await scale.report()
        assert report["unknown"] == 0 and report["errors"] == 0


async def test_a_flood_of_heartbeat_streams_cannot_keep_members_from_heartbeating(make_coordinator_config) -> None:
    """Streams that never send, streams naming strangers, and streams under a member's own id, past
    the cap: every beat of the members is answered (on a stream or, while refused one, by a unary
    call), Status answers, and once the flood's silent streams time out the members stream again."""
    from ringserve.worker.control.client import HeartbeatStream

    config = make_coordinator_config(max_heartbeat_streams=8, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5)
    own = [("grpc.use_local_subchannel_pool", 1)]
    async with Coordinator(config) as coord:
        channels = [grpc.aio.insecure_channel(coord.address, options=own) for _ in range(4)]
        try:
            stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
            members = [(await s.Join(pb.JoinRequest(address="127.0.0.1:9", hostname="h"), timeout=5)).worker_id
                       for s in stubs[:2]]
            attacker = stubs[3]
            silent = [attacker.Heartbeats() for _ in range(20)]  # hold slots, send nothing
            strangers = [attacker.Heartbeats() for _ in range(20)]
            for call in strangers:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call.write(pb.HeartbeatRequest(worker_id="stranger"))
            squatter = attacker.Heartbeats()  # under a member's own id: it replaces that member's stream
            with contextlib.suppress(grpc.aio.AioRpcError):
                await squatter.write(pb.HeartbeatRequest(worker_id=members[0]))
            await asyncio.sleep(0.1)
            assert coord.service.heartbeat_streams.open <= 8
            beats = [HeartbeatStream(s, coord.address, 1.0) for s in stubs[:2]]
            began = time.monotonic()
            answered = 0
            # The flood's silent streams end at 1.5 s; a refused member asks again after 1 s, then 2 s.
            while time.monotonic() - began < 4.5:
                for b, wid in zip(beats, members, strict=True):
                    assert (await b.beat(pb.HeartbeatRequest(worker_id=wid))).known
                    answered += 1
                if answered == 2:  # the first round: the silent streams hold every slot
                    assert not any(b.streaming for b in beats)
                assert (await stubs[2].Status(pb.StatusRequest(summary_only=True), timeout=1)).pending_workers >= 0
                await asyncio.sleep(0.2)
            assert answered >= 20 and coord.service.counts["heartbeats"] >= answered
            assert all(b.streaming for b in beats)  # the flood's streams ended, the members' took their slots
            assert coord.service.heartbeat_streams.open == 2
            assert len(coord.service.view.members) == 2 and coord.service.views_formed == 1
            for call in [*silent, *strangers, squatter]:
                call.cancel()
        finally:
            for c in channels:
                await c.close()
