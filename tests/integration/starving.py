"""A coordinator and real workers, each in a process of its own, for starving them on purpose.

Starvation is forced, never hoped for: a worker's process is stopped (SIGSTOP, as a GC pause or
a noisy neighbour would stop it, all threads at once), a worker's event loop is blocked (a
``time.sleep`` in a callback on it, as a long numpy call or a held GIL would: its other threads
still run), the coordinator's process is stopped, and a worker is killed (SIGKILL, really dead).
The harness watches the views from the test's own WatchView stream and records when each formed,
so that a test can say who was dropped and how long detection took.

Kept apart from the tests so that the slow campaign and the fast cases share one harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from swarm import first_view

from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent.parent

# A real worker, alone in its process with its event loop on the main thread. SIGUSR1 blocks
# that loop for BLOCK_S seconds (a callback that sleeps): the gRPC threads still run, the loop
# does nothing, which is what a long call on the loop does to the heartbeats.
WORKER = """
import asyncio, os, signal, sys, time
from ringserve import Worker, WorkerConfig
async def main():
    worker = Worker(config=WorkerConfig(coordinator=sys.argv[1], rpc_timeout_s=5.0, connect_timeout_s=5.0,
                                        use_uvloop=False, link_latency_s=1e-4, link_mbps=1000.0))
    loop = asyncio.get_running_loop()
    block_s = float(os.environ.get("BLOCK_S", "3"))
    loop.add_signal_handler(signal.SIGUSR1, lambda: time.sleep(block_s))
    await worker.start()
    print("joined", worker.worker_id, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@dataclass
class Seen:
    """A view as the harness received it: when, its number, its members (and in rank order), and
    those that failed."""

    at: float
    view_id: int
    members: frozenset[str]
    failed: frozenset[str]
    ranks: tuple[str, ...] = ()


@dataclass
class Starving:
    """A coordinator process and ``n`` worker processes, and the views they formed.

    Used as ``async with Starving(3) as world:``. ``coordinator_args`` are added to
    ``ringserve coordinator``'s command line. ``min_workers`` (default n) below n keeps the
    world running after failures; the first view then waits ``settle_s`` after the last join,
    which must cover the workers' start.
    """

    n: int
    coordinator_args: list[str] = field(default_factory=list)
    min_workers: int = 0
    settle_s: float = 0.5
    block_s: float = 3.0
    coordinator: subprocess.Popen[str] | None = None
    address: str = ""
    workers: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    views: list[Seen] = field(default_factory=list)
    _channel: grpc.aio.Channel | None = None
    _watcher: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __aenter__(self) -> Starving:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()  # a worker's readline ends once its process is killed
            raise
        return self

    async def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.coordinator = subprocess.Popen(
            # The first view waits for all n (a running world admits a joiner only when a member
            # asks); a view that loses one falls below that minimum and is empty, which the
            # views' failed lists still show.
            [sys.executable, "-m", "ringserve.cli", "coordinator", "--port", "0",
             "--min-workers", str(self.min_workers or self.n), "--settle-seconds", str(self.settle_s),
             *self.coordinator_args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        assert self.coordinator.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.coordinator.stdout.readline), 30)
        found = re.search(r"listening on (\S+)", line)
        assert found, f"unexpected first line of the coordinator: {line!r}"
        self.address = found.group(1)
        self._channel = grpc.aio.insecure_channel(self.address)
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, self.address], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env={**env, "BLOCK_S": str(self.block_s)})
                 for _ in range(self.n)]
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert line.startswith("joined "), f"unexpected first line of a worker: {line!r}"
            self.workers[line.split()[1]] = proc
        await self.wait_view(lambda v: v.members == frozenset(self.workers), 60)

    async def _watch(self) -> None:
        assert self._channel is not None
        stub = pb_grpc.CoordinatorStub(self._channel)
        while True:  # the watch breaks while the coordinator is stopped past gRPC's keepalive
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for view in stub.WatchView(pb.WatchViewRequest(worker_id="starving-harness")):
                    ranks = tuple(m.worker_id for m in view.members)
                    seen = Seen(time.monotonic(), view.view_id, frozenset(ranks), frozenset(view.failed_worker_ids),
                                ranks)
                    if not self.views or self.views[-1].view_id != seen.view_id:
                        self.views.append(seen)
                        self._changed.set()
            await asyncio.sleep(0.1)

    async def wait_view(self, predicate: object, timeout_s: float) -> Seen:
        """The first view received (already or within ``timeout_s``) that satisfies ``predicate``."""
        assert callable(predicate)
        return await first_view(self.views, self._changed, predicate, timeout_s)

    def dropped_since(self, at: float) -> set[str]:
        """The workers some view formed after ``at`` (monotonic) declared failed."""
        return {w for v in self.views if v.at > at for w in v.failed}

    def signal(self, worker_id: str, sig: signal.Signals) -> None:
        self.workers[worker_id].send_signal(sig)

    async def stop_for(self, proc: subprocess.Popen[str], seconds: float) -> None:
        """Stops ``proc`` (SIGSTOP) for ``seconds``, then lets it go on."""
        proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            proc.send_signal(signal.SIGCONT)

    async def __aexit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._channel is not None:
            await self._channel.close()
        for proc in [*self.workers.values(), self.coordinator]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
        for proc in [*self.workers.values(), self.coordinator]:
            if proc is not None:
                proc.wait(15)
