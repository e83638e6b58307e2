"""A worker under a flood of streams that never say HELLO and of connections that never do
anything keeps its ring: the flood is ended by the HELLO deadline, the unverified-stream cap and
the connection timeouts, the ring re-forms through a view change meanwhile, and the worker's memory
comes back to where it was.

The flooded worker runs as a process of its own (tests/security/_looping_worker.py), so that the
memory measured is its own and not the flood's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from worlds import FAST_WORKER

from ringserve import Coordinator, RecoverableError, Worker
from ringserve._proto import peer_pb2

pytestmark = pytest.mark.timeout(60)

STREAM = "/ringserve.v1.Peer/Stream"
LOOPING_WORKER = str(pathlib.Path(__file__).with_name("_looping_worker.py"))
HELLO_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 1.0
CAP = 16


def rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class LoopingWorker:
    """_looping_worker.py as a process; ``done`` holds its (view, size, sum) lines as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.address = ""
        self.done: list[tuple[int, int, float]] = []
        self.trims = 0
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, env: dict[str, str]) -> LoopingWorker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, LOOPING_WORKER, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        worker = cls(proc)
        assert proc.stdout is not None
        worker._reader = asyncio.create_task(worker._read(proc.stdout))
        return worker

    async def _read(self, stdout: asyncio.StreamReader) -> None:
        async for raw in stdout:
            word, *rest = raw.decode().split()
            if word == "address":
                self.address = rest[0]
            elif word == "done":
                self.done.append((int(rest[0]), int(rest[1]), float(rest[2])))
            elif word == "trimmed":
                self.trims += 1

    async def rss_after_trim(self) -> int:
        """The process's RSS once glibc has given back the free memory it keeps for reuse."""
        trims = self.trims
        self.proc.send_signal(signal.SIGUSR1)
        await self.wait_for("a trim", lambda: self.trims > trims, 5)
        return rss_bytes(self.proc.pid)

    async def wait_for(self, what: str, predicate: Any, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                assert self.proc.returncode is None, f"the worker exited with {self.proc.returncode} waiting for {what}"
                await asyncio.sleep(0.02)

    async def stop(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            async with asyncio.timeout(15):
                code = await self.proc.wait()
        finally:
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
            if self._reader is not None:
                await self._reader
        return code


@contextlib.asynccontextmanager
async def allreduce_loop(worker: Worker) -> AsyncIterator[list[tuple[int, int, float]]]:
    """Runs the same loop as _looping_worker.py on an in-process worker while the block runs."""
    done: list[tuple[int, int, float]] = []

    async def run() -> None:
        while True:
            view = worker.running_view
            try:
                out = await worker.allreduce(np.ones(256, dtype=np.float32), op="sum", name="tick")
            except RecoverableError:
                await worker.wait_for_view(newer_than=view, timeout_s=20)
                continue
            done.append((view, worker.size, float(out[0])))
            await asyncio.sleep(0.02)

    task = asyncio.create_task(run())
    try:
        yield done
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Flood:
    """HELLO-less streams, bare TCP connections and idle HTTP/2 connections at one address."""

    def __init__(self, address: str) -> None:
        self.address = address
        host, port = address.rsplit(":", 1)
        self._target = (host, int(port))
        self.sockets: list[socket.socket] = []
        self.channels: list[grpc.aio.Channel] = []
        self.idle: list[grpc.aio.Channel] = []
        self.calls: list[Any] = []

    async def open(self, *, sockets: int, channels: int, streams_per_channel: int, idle_channels: int) -> None:
        for i in range(sockets):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(self._target)
            self.sockets.append(s)
            if i % 100 == 99:
                await asyncio.sleep(0)  # let the others run
        for _ in range(channels):
            channel = grpc.aio.insecure_channel(self.address)
            self.channels.append(channel)
            method = channel.stream_unary(STREAM, response_deserializer=peer_pb2.StreamSummary.FromString)
            self.calls += [method() for _ in range(streams_per_channel)]
        for _ in range(idle_channels):
            channel = grpc.aio.insecure_channel(self.address)
            self.idle.append(channel)
            await channel.channel_ready()

    async def churn(self, *, streams_per_s: float) -> None:
        """Opens new HELLO-less streams without pause, ten at a time, until cancelled."""
        channel = grpc.aio.insecure_channel(self.address)
        self.channels.append(channel)
        method = channel.stream_unary(STREAM, response_deserializer=peer_pb2.StreamSummary.FromString)
        while True:
            self.calls += [method() for _ in range(10)]
            await asyncio.sleep(10 / streams_per_s)

    def sockets_closed_by_the_server(self) -> int:
        closed = 0
        for s in self.sockets:
            try:
                while s.recv(65536):  # the server's HTTP/2 settings, then the end
                    pass
                closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return closed

    async def shed(self, timeout_s: float) -> dict[grpc.StatusCode, int]:
        """Waits until the server has ended every stream and closed every connection of the
        flood; returns how many streams ended with each status."""
        async with asyncio.timeout(timeout_s):
            codes: dict[grpc.StatusCode, int] = {}
            for call in self.calls:
                code = await call.code()
                codes[code] = codes.get(code, 0) + 1
            while self.sockets_closed_by_the_server() < len(self.sockets):
                await asyncio.sleep(0.05)
            while any(c.get_state() == grpc.ChannelConnectivity.READY for c in self.idle):
                await asyncio.sleep(0.05)
        return codes

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for channel in [*self.channels, *self.idle]:
            await channel.close()
        for s in self.sockets:
            s.close()
        self.calls, self.channels, self.idle, self.sockets = [], [], [], []


FLOOD = dict(sockets=2000, channels=20, streams_per_channel=10, idle_channels=50)


async def test_a_flood_of_hello_less_streams_and_idle_connections_is_shed_while_the_ring_reforms_and_memory_returns(
    make_coordinator_config, make_worker_config
) -> None:
    async with Coordinator(make_coordinator_config(min_workers=2)) as coord:
        env = {
            **os.environ,
            **{f"RINGSERVE_{k.upper()}": str(v) for k, v in FAST_WORKER.items()},
            "RINGSERVE_COORDINATOR": coord.address,
            "RINGSERVE_PEER_HELLO_TIMEOUT_S": str(HELLO_TIMEOUT_S),
            "RINGSERVE_PEER_IDLE_TIMEOUT_S": str(IDLE_TIMEOUT_S),
            "RINGSERVE_MAX_UNVERIFIED_STREAMS": str(CAP),
            "RINGSERVE_ALGORITHM": "ring",
        }
        target = await LoopingWorker.start(env)
        stays = Worker(config=make_worker_config(coord.address))
        joiner = Worker(config=make_worker_config(coord.address))
        flood: Flood | None = None
        try:
            await stays.start()
            async with contextlib.AsyncExitStack() as loops:
                stays_done = await loops.enter_async_context(allreduce_loop(stays))
                await target.wait_for("a warm ring", lambda: len(target.done) >= 20, 15)
                assert {size for _, size, _ in target.done} == {2}
                before = await target.rss_after_trim()
                flood = Flood(target.address)
                await flood.open(**FLOOD)
                churn = asyncio.create_task(flood.churn(streams_per_s=400))
                try:
                    # A view change in the middle of the flood: a worker joins, and the target's
                    # new predecessor opens a stream that must get past the squatters.
                    first_view = target.done[-1][0]
                    joining = asyncio.create_task(joiner.start())
                    async with asyncio.timeout(10):
                        while coord.service.view.view_id == first_view or not joining.done():
                            await stays.admit_waiting()
                            await asyncio.sleep(0.05)
                    await joining
                    await loops.enter_async_context(allreduce_loop(joiner))
                    await target.wait_for("allreduces in the view of three", lambda: sum(
                        view > first_view and size == 3 and total == 3.0 for view, size, total in target.done
                    ) >= 10, 15)
                    peak = rss_bytes(target.proc.pid)
                    assert any(view > first_view and total == 3.0 for view, _, total in stays_done)
                finally:
                    churn.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await churn
                # Every stream ends within the HELLO deadline, by it or by the cap, and every bare
                # or idle connection is closed by the server.
                codes = await flood.shed(HELLO_TIMEOUT_S + IDLE_TIMEOUT_S + 3)
                assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
                assert codes.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0) >= sum(codes.values()) - CAP, codes
                await flood.close()
                after = await target.rss_after_trim()
                # A second flood of the same size: what the first left behind is the allocator's
                # (its arenas grew), not a leak, if the second adds about nothing.
                await flood.open(**FLOOD)
                await flood.shed(HELLO_TIMEOUT_S + IDLE_TIMEOUT_S + 3)
                await flood.close()
                again = await target.rss_after_trim()
                ticks = len(target.done)
                await target.wait_for("more allreduces after the floods", lambda: len(target.done) >= ticks + 5, 10)
            mib = 1 << 20
            print(f"\nflooded worker RSS (after malloc_trim): before {before / mib:.1f} MiB, peak (untrimmed) "
                  f"{peak / mib:.1f} MiB, after the first flood {after / mib:.1f} MiB, after the second "
                  f"{again / mib:.1f} MiB; stream endings {codes}")
            assert after - before < 32 * mib, (before, peak, after)
            assert again - after < 8 * mib, (after, again)
        finally:
            if flood is not None:
                await flood.close()
            await joiner.close()
            await stays.close()
            assert await target.stop() == 0


async def test_a_quiet_ring_stream_outlives_the_idle_connection_timeout(world_factory) -> None:
    world = await world_factory(2, peer_idle_timeout_s=0.2, peer_hello_timeout_s=0.2)
    view = world.workers[0].view_id
    first = await world.each(lambda w: w.allreduce(np.ones(3), op="sum", name="before-quiet"))
    await asyncio.sleep(1.5)  # no frame on the ring's streams for many idle timeouts
    second = await world.each(lambda w: w.allreduce(np.ones(3), op="sum", name="after-quiet"))
    assert [o.tolist() for o in first + second] == [[2.0] * 3] * 4
    assert [w.view_id for w in world.workers] == [view] * 2
    assert [w.counters.view_changes for w in world.workers] == [0, 0]
