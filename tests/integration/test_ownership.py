"""Who owns what in a running worker: a crashed background task fails the worker loudly, close()
keeps its deadline across every plane it holds, and nothing is left behind (tasks, shared rings).

Faults come from wrappers and fake peers: a control client that breaks, a peer server that takes a
stream and never reads it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from ringserve import Coordinator, RingChangedError, Worker, WorkerFailedError
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.worker.dataplane.links import shared

pytestmark = pytest.mark.timeout(90)


class BrokenHeartbeats:
    """A control client whose heartbeats raise what no code path expects (a bug's stand-in)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def heartbeat(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise KeyError("a heartbeat field nobody expected")


def other_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


async def test_a_crashed_heartbeat_fails_waiting_collectives_and_later_calls_with_the_cause_and_the_worker_leaves(
    world_factory,
) -> None:
    world = await world_factory(2, coordinator={"min_workers": 1})
    crashing, other = world.workers
    assert crashing.node.lifeline is not None
    waiting = asyncio.ensure_future(crashing.allreduce(np.ones(3), op="sum", name="never-met"))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # the peer never calls it: it waits
    started = time.monotonic()
    crashing.node.lifeline.control = BrokenHeartbeats(crashing.node.lifeline.control)  # type: ignore[assignment]
    with pytest.raises(WorkerFailedError) as caught:
        async with asyncio.timeout(5):
            await waiting
    # Within a heartbeat interval (0.2 s here), not at the collective's deadline or at close().
    assert time.monotonic() - started < 2.0
    assert "The heartbeat task of the worker at" in str(caught.value) and "KeyError" in str(caught.value)
    assert isinstance(caught.value.__cause__, KeyError)
    with pytest.raises(WorkerFailedError) as again:
        await crashing.allreduce(np.ones(3), op="sum", name="after")
    assert isinstance(again.value.__cause__, KeyError) and again.value is not caught.value
    with pytest.raises(WorkerFailedError):
        _ = crashing.view_id  # (rank and size still say where it was, as after a peer's shutdown)
    # It left the world: the other worker goes on alone in a new view, at once.
    async with asyncio.timeout(5):
        while other.size != 1:
            await asyncio.sleep(0.02)
    assert (await other.allreduce(np.ones(2), op="sum", name="alone")).tolist() == [1.0, 1.0]


async def test_close_after_a_crash_releases_everything(make_coordinator_config, make_worker_config) -> None:
    before = other_tasks()
    async with Coordinator(make_coordinator_config(min_workers=1)) as coord:
        w = await Worker(config=make_worker_config(coord.address)).start()
        address = w.address
        assert w.node.lifeline is not None
        w.node.lifeline.control = BrokenHeartbeats(w.node.lifeline.control)  # type: ignore[assignment]
        async with asyncio.timeout(5):
            while w.node.failure is None:
                await asyncio.sleep(0.02)
        await w.close()  # never raises the crash: it was reported already
        assert w.node.tasks.running == [] and w.node.planes.all == [] and w.node.channels.addresses == set()
        with pytest.raises(grpc.aio.AioRpcError):  # the peer server is gone
            async with grpc.aio.insecure_channel(address) as channel:
                await channel.unary_unary("/ringserve.v1.Peer/Latest")(b"", timeout=1)
    await asyncio.sleep(0)
    assert other_tasks() - before == set()


# -- close() keeps one deadline over every plane ------------------------------------------------------


class StuckPeers:
    """A peer server whose streams are taken and never read, and fake members that point at it:
    every link to one of them stops in its first writes past gRPC's flow-control window."""

    def __init__(self, coordinator: str) -> None:
        self.coordinator = coordinator
        # No BDP probing: on a quiet machine it grew the window past the whole segment, and the
        # link never filled (the stream's window then stays at gRPC's initial 64 KiB).
        self.server = grpc.aio.server(options=[("grpc.http2.bdp_probe", 0)])
        self.streams = 0
        self._channel = grpc.aio.insecure_channel(coordinator)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._beats: dict[str, asyncio.Task[None]] = {}

        async def stream(request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            self.streams += 1
            await anext(aiter(request_iterator))
            await asyncio.Event().wait()  # reads nothing more, answers never
            return b""

        handler = grpc.stream_unary_rpc_method_handler(stream, response_serializer=lambda b: b)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("ringserve.v1.Peer", {"Stream": handler})])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def start(self) -> StuckPeers:
        await self.server.start()
        return self

    async def join(self) -> str:
        joined = await self._stub.Join(pb.JoinRequest(address=self.address, hostname="stuck"), timeout=5)
        worker_id = joined.worker_id

        async def beat() -> None:
            while True:
                await self._stub.Heartbeat(pb.HeartbeatRequest(worker_id=worker_id), timeout=5)
                await asyncio.sleep(0.1)

        self._beats[worker_id] = asyncio.ensure_future(beat())
        return worker_id

    async def leave(self, worker_id: str) -> None:
        self._beats.pop(worker_id).cancel()
        await self._stub.Leave(pb.LeaveRequest(worker_id=worker_id), timeout=5)

    async def close(self) -> None:
        for task in self._beats.values():
            task.cancel()
        await asyncio.gather(*self._beats.values(), return_exceptions=True)
        await self._channel.close()
        await self.server.stop(0)


async def stuck_collective(w: Worker, name: str) -> asyncio.Future[Any]:
    """An allreduce whose sends to the stuck peer fill the link (a segment of 128 chunks, past the
    link's window of 32 and gRPC's flow-control window): it never ends by itself."""
    plane = w.node.planes.current
    assert plane is not None
    task = asyncio.ensure_future(w.allreduce(np.zeros(4 << 20, dtype=np.float32), op="sum", name=name))
    link = plane._links[plane.ring.next]
    async with asyncio.timeout(20):
        while link.has_room:  # its queue is full: the pump is stuck in a write
            if task.done():
                raise AssertionError(f"the collective ended before its link filled: {task.exception()!r}")
            await asyncio.sleep(0.02)
    return task


async def test_close_honours_its_drain_deadline_across_every_plane_whose_peer_hangs(
    make_coordinator_config, make_worker_config
) -> None:
    async with Coordinator(make_coordinator_config(min_workers=2)) as coord:
        peers = await StuckPeers(coord.address).start()
        # The ring's link to the stuck peer fills (no measure of the links first: it would never end).
        # On the stuck peer's host, so the ring keeps 64 KiB frames (between hosts this allreduce would
        # run in frames of four chunks, selection.ring_chunk: too few to fill the link).
        w = Worker(config=make_worker_config(coord.address, drain_timeout_s=2.0, shared_memory=False,
                                              chunk_bytes=64 << 10, algorithm="ring", hostname="stuck"))
        try:
            fake = (await asyncio.gather(w.start(), peers.join()))[1]
            tasks = []
            for i in range(3):
                tasks.append(await stuck_collective(w, f"stuck-{i}"))
                if i == 2:
                    break
                view = w.latest_view
                # A graceful leave: the plane retires, its collective may finish (it cannot: the
                # peer is alive but never reads), and its link drains for ever.
                await peers.leave(fake)
                fake = await peers.join()
                await w.wait_for_view(view + 1, 10)
            planes = w.node.planes.all
            assert len(planes) == 3 and not any(p.drained for p in planes)
            started = time.monotonic()
            await w.close()
            elapsed = time.monotonic() - started
            # One drain deadline (2 s) for all three (not one each, 6 s), then the leave and the
            # server's stop (0.5 s).
            assert elapsed < 2.0 + 1.5, f"close() took {elapsed:.2f} s"
            assert w.node.planes.all == [] and w.node.tasks.running == []
            await asyncio.sleep(0)
            # Every collective ended: starved by its peer's leave, or cut off by the close.
            assert all(task.done() for task in tasks)
            for task in tasks:
                with pytest.raises(RingChangedError):
                    task.result()
        finally:
            await w.close()
            await peers.close()


# -- nothing left mapped ------------------------------------------------------------------------------


def ring_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if shared.NAME in line)


@pytest.mark.skipif(not shared.supported(), reason="shared rings need Linux memfds on x86-64")
async def test_closed_workers_leave_no_shared_ring_mapped(world_factory) -> None:
    before = ring_mappings()
    world = await world_factory(3, chunk_bytes=64 << 10)
    await world.each(lambda w: w.collectives.allreduce_among((0, 2), np.ones(50_000), op="sum", name="sub")
                     if w.rank in (0, 2) else asyncio.sleep(0))
    await world.map("allreduce", [np.ones(100_000)] * 3, op="sum", name="mapped")
    assert sum(w.counters.shared_bytes_sent for w in world.workers) > 0
    assert ring_mappings() > before
    await world.close()
    world.workers.clear()
    await asyncio.sleep(0)
    assert ring_mappings() == before
