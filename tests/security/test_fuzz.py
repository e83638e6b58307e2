"""The coordinator's RPCs fuzzed with hypothesis, over a real channel to a real coordinator.

Every call must end with a status a client can act on (OK, INVALID_ARGUMENT, NOT_FOUND, or a
watch's deadline), never UNKNOWN (a handler that raised) or INTERNAL, and after every example the
coordinator must answer Status with a view that is consistent with its membership. At the end the
fuzzed workers are timed out, and a real worker still forms a view and reduces through it.

The default run tries a few hundred cases; ``-m slow`` runs the 10^4-case version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve import Coordinator, Worker
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.coordinator import membership
from ringserve.coordinator.views import view_to_proto
from ringserve.loop import LoopThread

UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
# Ids and keys from a small pool collide across examples, so that replays, leaves, heartbeats and
# reports of known workers are exercised, not only of strangers.
IDS = st.one_of(st.sampled_from(["", "w0", "w1", "w2", "w3"]), st.text(max_size=40))
ADDRESSES = st.one_of(st.sampled_from(["127.0.0.1:1", "127.0.0.1:2", "[::1]:3", "localhost:4", ""]), st.text(max_size=40))
TEXT = st.text(max_size=60)
VIEWS = st.one_of(st.integers(0, 4), UINT64)
KEYS = st.sampled_from(["p", "q", ""])

JOIN = st.builds(pb.JoinRequest, address=ADDRESSES, hostname=TEXT, rank_hint=INT32, worker_id=IDS,
                 view_id=VIEWS, rank=st.one_of(st.integers(0, 4), UINT32), view_size=st.one_of(st.integers(0, 4), UINT32))
CALLS = st.one_of(
    st.tuples(st.just("Join"), JOIN),
    st.tuples(st.just("Leave"), st.builds(pb.LeaveRequest, worker_id=IDS)),
    st.tuples(st.just("Heartbeat"), st.builds(
        pb.HeartbeatRequest, worker_id=IDS, view_id=VIEWS,
        counters=st.builds(pb.WorkerCounters, collectives_done=UINT64, bytes_sent=UINT64, bytes_received=UINT64),
        stalled=st.lists(TEXT, max_size=5))),
    st.tuples(st.just("WatchView"), st.builds(pb.WatchViewRequest, worker_id=IDS)),
    st.tuples(st.just("ReportFailure"), st.builds(
        pb.ReportFailureRequest, reporter_id=IDS, view_id=VIEWS, suspect_rank=st.one_of(st.integers(0, 4), UINT32), reason=TEXT)),
    st.tuples(st.just("Admit"), st.builds(pb.AdmitRequest, worker_id=IDS, view_id=VIEWS)),
    st.tuples(st.just("PutParams"), st.lists(st.builds(
        pb.ParamChunk, key=KEYS, offset=st.one_of(st.integers(0, 8), UINT64),
        total_bytes=st.one_of(st.integers(0, 8), UINT64), data=st.binary(max_size=8)), max_size=4)),
    st.tuples(st.just("GetParams"), st.builds(pb.GetParamsRequest, key=st.one_of(KEYS, TEXT))),
    st.tuples(st.just("Status"), st.just(pb.StatusRequest())),
    st.tuples(st.just("RegisterShard"), st.builds(
        pb.RegisterShardRequest, shard_id=IDS, address=ADDRESSES, shards=st.one_of(st.integers(0, 3), UINT32),
        index=st.one_of(st.integers(-2, 3), INT32), first=st.booleans())),
    st.tuples(st.just("ListShards"), st.just(pb.ListShardsRequest())),
)
# RESOURCE_EXHAUSTED: a put past the coordinator's cap on parameter bytes. ALREADY_EXISTS: a shard
# index held by another live shard (RegisterShard).
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.ALREADY_EXISTS}


class Fuzzed:
    """A coordinator on a loop thread of its own, and a blocking stub to fuzz it with."""

    def __init__(self) -> None:
        self.thread = LoopThread(use_uvloop=False, name="ringserve-fuzz")
        config = dict(min_workers=1, max_workers=4, settle_s=0.0, tick_s=0.01, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
        from ringserve import CoordinatorConfig

        self.coordinator = Coordinator(CoordinatorConfig(**config))
        self.thread.run(self.coordinator.start(), 10)
        self.channel = grpc.insecure_channel(self.coordinator.address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    def call(self, method: str, request: Any) -> grpc.StatusCode:
        try:
            if method == "WatchView":
                stream = self.stub.WatchView(request, timeout=0.05)
                next(iter(stream), None)
                stream.cancel()
            elif method == "GetParams":
                list(self.stub.GetParams(request, timeout=5))
            elif method == "PutParams":
                self.stub.PutParams(iter(request), timeout=5)
            else:
                getattr(self.stub, method)(request, timeout=5)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if method == "WatchView" and code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return grpc.StatusCode.OK
            return code
        return grpc.StatusCode.OK

    def check_consistent(self) -> None:
        assert self.stub.Status(pb.StatusRequest(), timeout=5).min_workers == 1
        service = self.coordinator.service

        async def snapshot() -> tuple[pb.StatusResponse, membership.State]:
            # On the coordinator's loop, with no await between: the ticker cannot move in between.
            return await service.Status(pb.StatusRequest(), None), service._state

        status, state = self.thread.run(snapshot(), 5)
        assert status.view == view_to_proto(state.view)
        ids = [m.worker_id for m in state.view.members]
        assert len(ids) == len(set(ids)) <= 4
        assert [m.member.rank for m in status.members] == list(range(len(ids)))
        assert status.pending_workers == membership.waiting(state)

    def close(self) -> None:
        self.channel.close()
        self.thread.run(self.coordinator.stop(0.1), 10)
        self.thread.stop()


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    target = Fuzzed()
    yield target
    target.close()


def run_fuzz(fuzzed: Fuzzed, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(calls=st.lists(CALLS, min_size=1, max_size=4))
    def fuzz(calls: list[tuple[str, Any]]) -> None:
        for method, request in calls:
            code = fuzzed.call(method, request)
            assert code in ACCEPTABLE, f"{method}({request}) ended with {code}"
        fuzzed.check_consistent()

    fuzz()
    still_works(fuzzed)


def still_works(fuzzed: Fuzzed) -> None:
    """Once every fuzzed worker has timed out, a real worker forms a view and reduces through it."""
    coordinator = fuzzed.coordinator

    async def real_worker() -> list[float]:
        async with asyncio.timeout(30):
            while coordinator.service._state.workers:
                await asyncio.sleep(0.05)
        async with Worker(coordinator.address) as w:
            return (await w.allreduce(np.arange(3.0), op="sum")).tolist()

    assert fuzzed.thread.run(real_worker(), 40) == [0.0, 1.0, 2.0]


@pytest.mark.timeout(120)
def test_fuzzed_coordinator_rpcs_end_with_a_clear_status_and_leave_a_consistent_coordinator(fuzzed: Fuzzed) -> None:
    run_fuzz(fuzzed, 300)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ten_thousand_fuzzed_coordinator_rpcs_end_with_a_clear_status_and_leave_a_consistent_coordinator(fuzzed: Fuzzed) -> None:
    run_fuzz(fuzzed, 10_000)
