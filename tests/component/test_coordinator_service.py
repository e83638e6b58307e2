"""One real Coordinator on 127.0.0.1:0, driven by a raw grpc.aio client speaking the wire contract."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve import Coordinator
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc

Stub = pb_grpc.CoordinatorStub


@pytest_asyncio.fixture
async def channel(coordinator: Coordinator) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(coordinator.address) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> Stub:
    return Stub(channel)


@pytest.fixture
def unused_address() -> Iterator[str]:
    """A loopback address that refuses connections: a worker that is gone."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


async def join(stub: Stub, address: str, *, hostname: str = "host", rank_hint: int = -1, worker_id: str = "") -> str:
    answer = await stub.Join(
        pb.JoinRequest(address=address, hostname=hostname, rank_hint=rank_hint, worker_id=worker_id), timeout=5
    )
    return answer.worker_id


class Views:
    """A WatchView stream read by a task of its own, so that waiting for a view can time out
    without ending the stream (a cancelled ``anext`` would close grpc's response generator)."""

    def __init__(self, stub: Stub) -> None:
        self._call = stub.WatchView(pb.WatchViewRequest(worker_id="watcher"))
        self._queue: asyncio.Queue[pb.View] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for view in self._call:
            self._queue.put_nowait(view)

    async def next(self, timeout_s: float = 5.0) -> pb.View:
        async with asyncio.timeout(timeout_s):
            return await self._queue.get()

    async def close(self) -> None:
        self._call.cancel()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._task


@pytest_asyncio.fixture
async def watch(stub: Stub) -> AsyncIterator[Callable[[], Views]]:
    """``views = watch()`` starts a WatchView stream; every stream is closed after the test."""
    streams: list[Views] = []

    def start() -> Views:
        streams.append(Views(stub))
        return streams[-1]

    yield start
    for views in streams:
        await views.close()


async def next_view(views: Views, timeout_s: float = 5.0) -> pb.View:
    return await views.next(timeout_s)


def ids(view: pb.View) -> list[str]:
    return [m.worker_id for m in view.members]


def test_the_coordinator_binds_a_free_loopback_port_and_reports_it(coordinator: Coordinator) -> None:
    host, port = coordinator.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


async def test_the_grpc_health_service_reports_serving(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "ringserve.v1.Coordinator"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_join_gives_a_new_worker_an_id_and_the_heartbeat_settings(stub: Stub, coordinator: Coordinator) -> None:
    answer = await stub.Join(pb.JoinRequest(address="127.0.0.1:1001", hostname="h", rank_hint=-1), timeout=5)
    assert answer.worker_id
    assert answer.heartbeat_interval_s == coordinator.config.heartbeat_interval_s
    assert answer.heartbeat_timeout_s == coordinator.config.heartbeat_timeout_s
    other = await join(stub, "127.0.0.1:1002")
    assert other != answer.worker_id


async def test_a_rejoin_with_an_id_keeps_that_id(stub: Stub) -> None:
    wid = await join(stub, "127.0.0.1:1001")
    assert await join(stub, "127.0.0.1:1001", worker_id=wid) == wid


@pytest.mark.parametrize("coordinator", [{"min_workers": 2}], indirect=True, ids=["min_workers=2"])
async def test_watch_view_streams_the_view_once_min_workers_have_joined_and_settled(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    a = await join(stub, "127.0.0.1:1001", hostname="h1")
    b = await join(stub, "127.0.0.1:1002", hostname="h2")
    view = await next_view(views)
    assert view.view_id == 1
    assert ids(view) == [a, b]
    assert [m.rank for m in view.members] == [0, 1]
    assert [m.address for m in view.members] == ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert [(m.cross_rank, m.cross_size, m.local_size) for m in view.members] == [(0, 2, 1), (1, 2, 1)]


async def test_a_late_watcher_gets_the_current_view_first(watch: Callable[[], Views], stub: Stub) -> None:
    first = watch()
    a = await join(stub, "127.0.0.1:1001")
    await next_view(first)
    late = watch()
    view = await next_view(late)
    assert view.view_id == 1 and ids(view) == [a]


async def test_a_watcher_before_any_view_gets_nothing_until_one_forms(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    with pytest.raises(TimeoutError):
        await next_view(views, timeout_s=0.3)


async def test_heartbeats_are_acknowledged_with_the_current_view_and_unknown_workers_are_told(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    wid = await join(stub, "127.0.0.1:1001")
    await next_view(views)
    answer = await stub.Heartbeat(
        pb.HeartbeatRequest(worker_id=wid, view_id=1, counters=pb.WorkerCounters(collectives_done=3)), timeout=5
    )
    assert answer.known and answer.view_id == 1
    stranger = await stub.Heartbeat(pb.HeartbeatRequest(worker_id="nobody"), timeout=5)
    assert not stranger.known


async def test_leave_publishes_a_view_without_the_worker_at_once(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    a = await join(stub, "127.0.0.1:1001")
    b = await join(stub, "127.0.0.1:1002")
    view = await next_view(views)
    if ids(view) != [a, b]:  # the settle window may split two joins into two views
        view = await next_view(views)
    assert ids(view) == [a, b]
    await stub.Leave(pb.LeaveRequest(worker_id=a), timeout=5)
    after = await next_view(views)
    assert after.view_id == view.view_id + 1
    assert ids(after) == [b]
    assert list(after.left_worker_ids) == [a] and list(after.failed_worker_ids) == []
    assert not (await stub.Heartbeat(pb.HeartbeatRequest(worker_id=a), timeout=5)).known


@pytest.mark.parametrize(
    "coordinator",
    [{"min_workers": 1, "heartbeat_interval_s": 0.05, "heartbeat_timeout_s": 0.5}],
    indirect=True,
    ids=["heartbeat_timeout_s=0.5"],
)
async def test_a_worker_that_stops_heartbeating_is_removed_after_the_timeout(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    silent = await join(stub, "127.0.0.1:1001")
    alive = await join(stub, "127.0.0.1:1002")
    view = await next_view(views)
    while ids(view) != [silent, alive]:
        view = await next_view(views)

    async def beat() -> None:
        while True:
            await stub.Heartbeat(pb.HeartbeatRequest(worker_id=alive), timeout=5)
            await asyncio.sleep(0.05)

    beater = asyncio.create_task(beat())
    try:
        after = await next_view(views, timeout_s=5)
    finally:
        beater.cancel()
        with pytest.raises(asyncio.CancelledError):
            await beater
    assert ids(after) == [alive]
    assert list(after.failed_worker_ids) == [silent]


@pytest.mark.parametrize("coordinator", [{"min_workers": 2}], indirect=True, ids=["min_workers=2"])
async def test_falling_below_min_workers_publishes_an_empty_view(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    a = await join(stub, "127.0.0.1:1001")
    await join(stub, "127.0.0.1:1002")
    view = await next_view(views)
    await stub.Leave(pb.LeaveRequest(worker_id=a), timeout=5)
    empty = await next_view(views)
    assert empty.view_id == view.view_id + 1 and list(empty.members) == []


def param_chunks(key: str, data: bytes, size: int) -> list[pb.ParamChunk]:
    return [
        pb.ParamChunk(key=key, offset=o, total_bytes=len(data), data=data[o : o + size])
        for o in range(0, max(len(data), 1), size)
    ]


async def get_params(stub: Stub, key: str) -> bytes:
    chunks = [c async for c in stub.GetParams(pb.GetParamsRequest(key=key), timeout=10)]
    return b"".join(c.data for c in chunks)


@pytest.mark.parametrize("size", [0, 1, 1000, (1 << 20) + 17, 3 << 20])
async def test_params_put_in_chunks_come_back_byte_for_byte(stub: Stub, size: int) -> None:
    data = bytes((i * 31 + 7) % 251 for i in range(size))
    answer = await stub.PutParams(iter(param_chunks("model", data, 256 * 1024)), timeout=10)
    assert answer.version == 1
    assert await get_params(stub, "model") == data


async def test_putting_params_again_replaces_them_and_bumps_the_version(stub: Stub) -> None:
    assert (await stub.PutParams(iter(param_chunks("k", b"one", 2)), timeout=5)).version == 1
    assert (await stub.PutParams(iter(param_chunks("k", b"second", 4)), timeout=5)).version == 2
    assert await get_params(stub, "k") == b"second"


async def test_getting_unknown_params_fails_with_not_found_naming_the_key(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await get_params(stub, "missing")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'missing'" in (info.value.details() or "")


async def test_params_with_a_gap_or_a_short_total_are_rejected_and_not_stored(stub: Stub) -> None:
    gap = [
        pb.ParamChunk(key="g", offset=0, total_bytes=6, data=b"ab"),
        pb.ParamChunk(key="g", offset=4, total_bytes=6, data=b"ef"),
    ]
    short = [pb.ParamChunk(key="s", offset=0, total_bytes=10, data=b"abc")]
    for chunks, key in ((gap, "g"), (short, "s")):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PutParams(iter(chunks), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await get_params(stub, key)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("coordinator", [{"min_workers": 2, "max_workers": 2}], indirect=True, ids=["min_workers=2,max_workers=2"])
async def test_status_reports_the_view_its_members_and_the_workers_still_waiting(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    a = await join(stub, "127.0.0.1:1001")
    b = await join(stub, "127.0.0.1:1002")
    await next_view(views)
    await join(stub, "127.0.0.1:1003")
    await stub.Heartbeat(
        pb.HeartbeatRequest(worker_id=b, view_id=1, counters=pb.WorkerCounters(collectives_done=5, bytes_sent=64)),
        timeout=5,
    )
    status = await stub.Status(pb.StatusRequest(), timeout=5)
    assert status.view.view_id == 1 and ids(status.view) == [a, b]
    assert status.views_formed == 1
    assert status.pending_workers == 1
    assert (status.min_workers, status.max_workers) == (2, 2)
    assert status.uptime_s > 0
    by_id = {s.member.worker_id: s for s in status.members}
    assert by_id[b].counters.collectives_done == 5 and by_id[b].counters.bytes_sent == 64
    assert all(0 <= s.seconds_since_heartbeat < 5 for s in status.members)


async def test_a_stopped_coordinator_releases_its_port() -> None:
    coord = await Coordinator().start()
    address = coord.address
    await coord.stop()
    async with grpc.aio.insecure_channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await Stub(ch).Status(pb.StatusRequest(), timeout=1)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_a_waiting_worker_enters_a_running_world_only_when_a_member_calls_admit(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    a = await join(stub, "127.0.0.1:1001")
    assert ids(await next_view(views)) == [a]
    b = await join(stub, "127.0.0.1:1002")
    with pytest.raises(TimeoutError):
        await next_view(views, timeout_s=0.3)
    beat = await stub.Heartbeat(pb.HeartbeatRequest(worker_id=a, view_id=1), timeout=5)
    assert beat.pending_workers == 1
    await stub.Admit(pb.AdmitRequest(worker_id=b), timeout=5)  # not a member: ignored
    with pytest.raises(TimeoutError):
        await next_view(views, timeout_s=0.3)
    await stub.Admit(pb.AdmitRequest(worker_id=a), timeout=5)
    view = await next_view(views)
    assert view.view_id == 2 and ids(view) == [a, b]


async def test_a_reported_peer_that_fails_its_probe_is_removed_at_once(
    watch: Callable[[], Views], stub: Stub, unused_address: str, coordinator: Coordinator
) -> None:
    views = watch()
    dead = await join(stub, unused_address)
    # The reporter is alive but sends no heartbeat here, so the sweep that follows a death
    # probes it (silent for more than an interval): the coordinator's own health service stands
    # in for its peer server. At an address where nothing listens it would rightly be found
    # dead too, as a silent worker whose process is gone.
    reporter = await join(stub, coordinator.address)
    view = await next_view(views)
    while ids(view) != [dead, reporter]:
        view = await next_view(views)
    await stub.ReportFailure(
        pb.ReportFailureRequest(reporter_id=reporter, view_id=view.view_id, suspect_rank=0, reason="stream reset"),
        timeout=5,
    )
    after = await next_view(views)
    assert ids(after) == [reporter] and list(after.failed_worker_ids) == [dead]


async def test_a_reported_peer_that_answers_its_probe_stays_in_a_new_ring_once_its_links_come_up(
    watch: Callable[[], Views], stub: Stub, coordinator: Coordinator
) -> None:
    views = watch()
    # The coordinator's own health service answers SERVING, standing in for a live worker.
    alive = await join(stub, coordinator.address)
    reporter = await join(stub, "127.0.0.1:1002")
    view = await next_view(views)
    while ids(view) != [alive, reporter]:
        view = await next_view(views)
    await stub.ReportFailure(
        pb.ReportFailureRequest(reporter_id=reporter, view_id=view.view_id, suspect_rank=0, reason="slow"), timeout=5
    )
    # A link is down, not the worker: the same members, in a new view, dial each other again.
    bump = await next_view(views)
    assert bump.view_id == view.view_id + 1 and ids(bump) == [alive, reporter] and not bump.failed_worker_ids
    for worker_id in (alive, reporter):
        await stub.Heartbeat(pb.HeartbeatRequest(worker_id=worker_id, view_id=bump.view_id, linked_view=bump.view_id),
                             timeout=5)
    with pytest.raises(TimeoutError):
        await next_view(views, timeout_s=1.0)
    status = await stub.Status(pb.StatusRequest(), timeout=5)
    assert ids(status.view) == [alive, reporter]


async def test_a_report_from_an_unknown_worker_or_an_old_view_is_ignored(watch: Callable[[], Views], stub: Stub, unused_address: str) -> None:
    views = watch()
    target = await join(stub, unused_address)
    view = await next_view(views)
    for request in (
        pb.ReportFailureRequest(reporter_id="stranger", view_id=view.view_id, suspect_rank=0),
        pb.ReportFailureRequest(reporter_id=target, view_id=view.view_id + 5, suspect_rank=0),
        pb.ReportFailureRequest(reporter_id=target, view_id=view.view_id, suspect_rank=9),
    ):
        await stub.ReportFailure(request, timeout=5)
    with pytest.raises(TimeoutError):
        await next_view(views, timeout_s=0.5)


async def test_a_restarted_coordinator_adopts_the_view_its_rejoining_workers_claim(watch: Callable[[], Views], stub: Stub) -> None:
    views = watch()
    for rank, address in ((1, "127.0.0.1:1002"), (0, "127.0.0.1:1001")):
        await stub.Join(
            pb.JoinRequest(address=address, hostname="h", rank_hint=-1, worker_id=f"w{rank}", view_id=12, rank=rank, view_size=2),
            timeout=5,
        )
    view = await next_view(views)
    assert view.view_id == 12 and ids(view) == ["w0", "w1"]


@pytest.mark.parametrize("coordinator", [{"min_workers": 2}], indirect=True, ids=["min_workers=2"])
async def test_the_commit_mark_is_the_furthest_commit_synced_workers_reported_with_their_ranks(
    watch: Callable[[], Views], stub: Stub
) -> None:
    views = watch()
    a = await join(stub, "127.0.0.1:1001", rank_hint=0)
    b = await join(stub, "127.0.0.1:1002", rank_hint=1)
    await next_view(views)
    assert not (await stub.CommitMark(pb.CommitMarkRequest(worker_id=a), timeout=5)).known

    async def beat(wid: str, step: int | None, lineage: int = 0) -> pb.HeartbeatResponse:
        request = pb.HeartbeatRequest(worker_id=wid, view_id=1)
        if step is not None:
            request.committed_step, request.committed_lineage = step, lineage
        return await stub.Heartbeat(request, timeout=5)

    assert not (await beat(a, None)).HasField("mark_step")  # a fresh worker reports nothing
    await beat(a, 0)
    answer = await beat(b, 0)
    assert answer.HasField("mark_step") and answer.mark_step == 0  # step 0 is a mark too
    await beat(a, 7)
    await beat(b, 7)
    await beat(b, 6)  # an older report changes nothing
    await beat("stranger", 99)  # an unknown worker's report is not taken
    mark = await stub.CommitMark(pb.CommitMarkRequest(worker_id=a), timeout=5)
    assert (mark.known, mark.step, mark.lineage) == (True, 7, 0)
    assert sorted((h.worker_id, h.rank, h.view_id, h.address) for h in mark.holders) == sorted(
        [(a, 0, 1, "127.0.0.1:1001"), (b, 1, 1, "127.0.0.1:1002")]
    )
    answer = await beat(a, 3, lineage=1)  # a world resumed from a durable copy: a new lineage
    assert (answer.mark_step, answer.mark_lineage) == (3, 1)
    mark = await stub.CommitMark(pb.CommitMarkRequest(worker_id=a), timeout=5)
    assert [h.worker_id for h in mark.holders] == [a]


@pytest.mark.parametrize("coordinator", [{"min_workers": 3}], indirect=True, ids=["min_workers=3"])
async def test_a_commit_made_in_a_view_names_every_member_as_its_holder_and_says_who_is_present(
    watch: Callable[[], Views], stub: Stub
) -> None:
    # A commit-time allreduce finished: every member entered it after saving. One member's report
    # names them all, so a member stopped before its own heartbeat is still waited for.
    views = watch()
    a = await join(stub, "127.0.0.1:1001", rank_hint=0)
    b = await join(stub, "127.0.0.1:1002", rank_hint=1)
    c = await join(stub, "127.0.0.1:1003", rank_hint=2)
    await next_view(views)
    await stub.Heartbeat(pb.HeartbeatRequest(worker_id=a, view_id=1, committed_step=9, committed_view=1), timeout=5)
    mark = await stub.CommitMark(pb.CommitMarkRequest(worker_id=a), timeout=5)
    assert mark.step == 9 and [(h.worker_id, h.rank, h.present) for h in mark.holders] == [
        (a, 0, True), (b, 1, True), (c, 2, True)]
    await stub.Leave(pb.LeaveRequest(worker_id=c), timeout=5)
    await stub.Heartbeat(pb.HeartbeatRequest(worker_id=b, view_id=2, committed_step=9, committed_view=1), timeout=5)
    mark = await stub.CommitMark(pb.CommitMarkRequest(worker_id=a), timeout=5)
    assert {(h.worker_id, h.present) for h in mark.holders} == {(a, True), (b, True), (c, False)}
    # A view the reporter was not in names only the reporter.
    await stub.Heartbeat(pb.HeartbeatRequest(worker_id=a, view_id=2, committed_step=10, committed_view=77), timeout=5)
    mark = await stub.CommitMark(pb.CommitMarkRequest(worker_id=a), timeout=5)
    assert mark.step == 10 and [h.worker_id for h in mark.holders] == [a]
