"""Partial partitions over loopback, with a relay standing in for the routes that fail.

- A worker its ring predecessor cannot reach, though the coordinator's probe still can (the relay in
  front of its peer server blackholes the peer streams only): the others go on without it within a
  bound, and it is taken back at the next admit once the routes are back.
- The mirror: a worker that reaches its peers but not the coordinator (a relay in front of the
  coordinator, for that worker only) keeps training until the coordinator declares it dead, then
  stops with ExcludedError instead of waiting for a view it can never hear of.
- A worker whose route to the coordinator comes back after the others went on without it, while
  its old connection stays stuck (as TCP's retransmission backoff leaves one): it dials again,
  finds the coordinator, and rejoins, instead of stopping with ExcludedError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from relay import Relay
from worlds import coordinator_config, free_port, worker_config

from ringserve import Coordinator, ExcludedError, Worker

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 2.0  # the coordinator's heartbeat timeout
PEER_STREAM = b"/ringserve.v1.Peer/Stream"
HTTP2_PREFACE = b"PRI * HTTP/2.0"  # the first bytes of every gRPC connection


class Cluster:
    """A coordinator and three workers (rank hints 0, 1, 2); worker 2 reaches one side through a relay."""

    def __init__(self) -> None:
        self.coordinator: Coordinator | None = None
        self.workers: list[Worker] = []
        self.relay: Relay | None = None

    async def start(self, *, relay_peer_server: bool) -> None:
        self.coordinator = await Coordinator(coordinator_config(
            min_workers=2, max_workers=3, settle_s=0.5, heartbeat_timeout_s=TIMEOUT_S)).start()
        address = self.coordinator.address
        configs = [worker_config(address, rank_hint=i, rpc_timeout_s=1.0, shared_memory=False) for i in range(3)]
        if relay_peer_server:
            port = free_port()
            self.relay = Relay(port, blackhole=PEER_STREAM)
            configs[2] = worker_config(address, rank_hint=2, rpc_timeout_s=1.0, shared_memory=False,
                                       bind_port=port, advertise_port=await self.relay.start())
        else:
            self.relay = Relay(int(address.rsplit(":", 1)[1]), blackhole=HTTP2_PREFACE)
            configs[2] = worker_config(f"127.0.0.1:{await self.relay.start()}", rank_hint=2, rpc_timeout_s=1.0,
                                       shared_memory=False)
        self.workers = [Worker(config=c) for c in configs]
        await asyncio.gather(*(w.start() for w in self.workers))
        async with asyncio.timeout(10):
            while {w.size for w in self.workers} != {3}:
                await asyncio.sleep(0.02)

    async def allreduce(self, workers: list[Worker], name: str) -> list[list[float]]:
        async with asyncio.timeout(20):
            outs = await asyncio.gather(*(w.allreduce(np.full(1000, 1.0 + w.rank), op="sum", name=name) for w in workers))
        return [sorted(set(o.tolist())) for o in outs]

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)
        if self.relay is not None:
            await self.relay.close()
        if self.coordinator is not None:
            await self.coordinator.stop()


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


async def cut_from_the_coordinator(cluster: Cluster) -> float:
    """Starts the cluster with worker 2 behind a relay to the coordinator, cuts that route, and
    returns when."""
    await cluster.start(relay_peer_server=False)
    assert cluster.relay is not None
    cut = time.monotonic()
    cluster.relay.cut()
    return cut


async def in_view_of(workers: list[Worker], size: int, timeout_s: float, view_id: int = 0) -> float:
    """Waits until every one of ``workers`` is in a view of ``size`` (the view ``view_id``, if
    given: a worker dropped meanwhile may still hold an older view of that size); returns when
    that was."""
    async with asyncio.timeout(timeout_s):
        while not all(w.node.planes.current is not None and w.size == size and w.view_id >= view_id for w in workers):
            await asyncio.sleep(0.02)
    return time.monotonic()


async def test_a_worker_cut_off_from_its_ring_but_not_from_the_coordinator_is_dropped_within_a_timeout_and_taken_back_when_healed(
    cluster: Cluster,
) -> None:
    await cluster.start(relay_peer_server=True)
    w0, w1, w2 = cluster.workers
    assert await cluster.allreduce(cluster.workers, "before") == [[6.0]] * 3
    assert cluster.relay is not None and cluster.coordinator is not None
    first = w0.view_id

    cut = time.monotonic()
    cluster.relay.cut()
    dropped = await in_view_of([w0, w1], 2, timeout_s=TIMEOUT_S + 6)
    # The report and the probe are near instant; then the bump view's links get one timeout to come up.
    assert dropped - cut < TIMEOUT_S + 3, f"dropped after {dropped - cut:.1f} s"
    assert w0.view_id >= first + 2, "no new ring was tried before the drop"
    assert w2.worker_id not in [m.worker_id for m in cluster.coordinator.service.view.members]
    assert await cluster.allreduce([w0, w1], "without") == [[3.0]] * 2

    healed = time.monotonic()
    cluster.relay.heal()
    async with asyncio.timeout(15):
        while not w0.pending_workers:  # held out for a timeout after its cut, then waiting
            await asyncio.sleep(0.05)
        await w0.admit_waiting()
    back = await in_view_of(cluster.workers, 3, timeout_s=10)
    assert await cluster.allreduce(cluster.workers, "again") == [[6.0]] * 3
    print(f"\npartition: dropped {dropped - cut:.2f} s after the cut; back {back - healed:.2f} s after the heal")


async def test_a_worker_cut_off_from_the_coordinator_trains_on_until_declared_dead_then_stops_with_excluded_error(
    cluster: Cluster,
) -> None:
    cut = await cut_from_the_coordinator(cluster)
    w0, w1, w2 = cluster.workers
    # Within the heartbeat timeout nobody has declared it dead: the ring of three goes on.
    assert await cluster.allreduce(cluster.workers, "cut-off") == [[6.0]] * 3
    assert time.monotonic() - cut < TIMEOUT_S
    dropped = await in_view_of([w0, w1], 2, timeout_s=TIMEOUT_S + 5)
    async with asyncio.timeout(TIMEOUT_S + 5):
        with pytest.raises(ExcludedError, match=r"went on to view .* so it stops rather than train as a second world"):
            await w2.wait_for_view(w2.latest_view, timeout_s=60)
    stopped = time.monotonic()
    with pytest.raises(ExcludedError):
        await w2.allreduce(np.ones(3), name="alone")
    assert await cluster.allreduce([w0, w1], "after") == [[3.0]] * 2
    assert stopped - cut < 2 * TIMEOUT_S + 3, f"stopped {stopped - cut:.1f} s after the cut"
    print(f"\nmirror: dropped {dropped - cut:.2f} s, worker stopped {stopped - cut:.2f} s after the cut")


async def test_a_worker_whose_route_to_the_coordinator_is_back_after_it_was_dropped_rejoins_instead_of_stopping(
    cluster: Cluster,
) -> None:
    cut = await cut_from_the_coordinator(cluster)
    w0, w1, w2 = cluster.workers
    await asyncio.sleep(0.5)
    # The route is back for new connections; the ones that carried its heartbeats stay stuck.
    assert cluster.relay is not None
    cluster.relay.heal(reset=False)
    dropped = await in_view_of([w0, w1], 2, timeout_s=TIMEOUT_S + 5)
    async with asyncio.timeout(TIMEOUT_S + 10):
        while not w0.pending_workers:
            assert w2.node.failure is None, f"it stopped: {w2.node.failure}"
            await asyncio.sleep(0.05)
        without = w0.view_id
        await w0.admit_waiting()
    back = await in_view_of(cluster.workers, 3, timeout_s=10, view_id=without + 1)
    assert await cluster.allreduce(cluster.workers, "again") == [[6.0]] * 3
    print(f"\nroute back: dropped {dropped - cut:.2f} s, back in the ring {back - cut:.2f} s after the cut")


HEALTH_CHECK = b"/grpc.health.v1.Health/Check"


@pytest.mark.parametrize("dropped", [HTTP2_PREFACE, HEALTH_CHECK], ids=["every-byte", "requests"])
async def test_a_redial_through_a_route_that_takes_connections_but_drops_their_bytes_finds_the_coordinator_still_away(
    dropped: bytes,
) -> None:
    """A new connection that comes up (the coordinator's HTTP/2 SETTINGS come back, so gRPC calls
    it READY) while what the worker sends goes nowhere is not the coordinator back. Taken for it,
    a worker cut off rejoined into the void and stopped later than its bound (CI: 7.7 s against
    7). Dropping every byte, READY comes or not by a race; dropping the requests, it always comes."""
    from ringserve.worker.control.client import ControlClient

    coordinator = await Coordinator(coordinator_config(heartbeat_timeout_s=TIMEOUT_S)).start()
    relay = Relay(int(coordinator.address.rsplit(":", 1)[1]), blackhole=dropped)
    client = None
    try:
        client = ControlClient(worker_config(f"127.0.0.1:{await relay.start()}", rpc_timeout_s=1.0))
        relay.cut()
        for _ in range(3):
            began = time.monotonic()
            assert not await client.redial(1.0), "a connection whose requests go nowhere was taken for the coordinator"
            assert time.monotonic() - began < 1.5
        relay.heal()
        assert await client.redial(1.0)
    finally:
        if client is not None:
            await client.close()
        await relay.close()
        await coordinator.stop()
