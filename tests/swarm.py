"""Thousands of simulated workers against a real coordinator, for scale tests and the benchmark.

A simulated worker does what a real one does on the control plane and nothing else: it joins,
holds a WatchView stream, and sends a heartbeat every heartbeat interval (from a random phase, as
workers started apart would), through the real worker's client (``HeartbeatStream``: on one
long-lived stream, unary calls while it is down). Each has its own channel and TCP connection (a local subchannel
pool: gRPC would otherwise multiplex every channel of a process onto one connection), so the
coordinator sees what it would see from as many processes.

Many simulated workers share one process (a *swarm*), many swarms share the machine::

    python tests/swarm.py 127.0.0.1:PORT --count 500 --first 0 --interval 1.0

A swarm prints one JSON line when it is ready, joins on the next line of stdin, prints one JSON
line when all its workers have joined, then obeys commands on stdin,
one per line, each answered with one JSON line: ``silence K`` (its first K workers stop
heartbeating and drop their streams, as a hung or unplugged host would), ``report`` (heartbeat
latencies and counts so far), ``unary`` and ``stream`` (every worker heartbeats with unary calls
only from its next beat on, or on its stream again: the benchmark compares the two on one
coordinator) and ``stop``. ``Scale`` below runs a coordinator process and swarms
and watches the views; the scale tests and benchmarks/coordinator_scale.py both use it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: import the ringserve of this checkout
    sys.path.insert(0, str(ROOT))

from ringserve._proto import coordinator_pb2 as pb  # noqa: E402
from ringserve._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from ringserve.errors import RingserveError  # noqa: E402
from ringserve.worker.control.client import HeartbeatStream  # noqa: E402

T = TypeVar("T")
WATCH = "/ringserve.v1.Coordinator/WatchView"
# A real worker's default rpc_timeout_s: a heartbeat not answered within it is missed.
BEAT_TIMEOUT_S = 5.0
# Each simulated channel gets its own connection, as a worker process would.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


def view_id_of(data: bytes) -> int:
    """The view_id of an encoded View without parsing its 2,000 members: it is field 1, a varint,
    and protobuf writes fields in number order (an empty view_id, 0, is not written at all)."""
    if not data or data[0] != 0x08:
        return 0
    value, shift = 0, 0
    for byte in data[1:11]:
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    return value


class SimWorker:
    """One simulated worker: Join, a WatchView stream, and heartbeats every ``interval`` s."""

    def __init__(self, address: str, index: int, interval: float, advertise: str = "") -> None:
        self.index = index
        self.advertise = advertise  # the address the coordinator probes ("": a made-up one, never answered)
        self.interval = interval
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.beats = HeartbeatStream(self.stub, address, BEAT_TIMEOUT_S)
        self.worker_id = ""
        self.view_id = 0
        self.first_view_at = 0.0
        self.latencies: list[tuple[float, float]] = []  # (sent at, seconds)
        self.unknown = 0  # heartbeats answered "known: false": this worker was declared dead
        self.errors = 0
        self.missed = 0  # heartbeats that failed (no answer in time, or refused)
        # The longest time between two heartbeats sent: past the timeout, the coordinator rightly
        # drops this worker, however fast its answers (a swarm starved of CPU sends late).
        self.longest_gap = 0.0
        self._tasks: list[asyncio.Task[None]] = []

    async def join(self) -> None:
        host = f"sim-{self.index // 8}"
        answer = await self.stub.Join(
            pb.JoinRequest(address=self.advertise or f"{host}:{7000 + self.index % 8}", hostname=host), timeout=30
        )
        self.worker_id = answer.worker_id

    async def join_and_start(self) -> None:
        """Joins, then heartbeats and watches at once, as a real worker does (not only once all
        of its swarm has joined: in a long join storm the first would go silent past the timeout)."""
        await self.join()
        self.start()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch()), loop.create_task(self._beat())]

    async def _watch(self) -> None:
        call = self.channel.unary_stream(WATCH, request_serializer=pb.WatchViewRequest.SerializeToString)(
            pb.WatchViewRequest(worker_id=self.worker_id)
        )
        try:
            async for data in call:
                self.view_id = view_id_of(data)
                if not self.first_view_at:
                    self.first_view_at = time.monotonic()
        except grpc.aio.AioRpcError:
            self.errors += 1
        finally:
            call.cancel()

    async def _beat(self) -> None:
        await asyncio.sleep(random.uniform(0, self.interval))
        previous = 0.0
        while True:
            sent = time.monotonic()
            if previous:
                self.longest_gap = max(self.longest_gap, sent - previous)
            previous = sent
            try:
                answer = await self.beats.beat(pb.HeartbeatRequest(worker_id=self.worker_id, view_id=self.view_id))
                self.latencies.append((sent, time.monotonic() - sent))
                self.unknown += not answer.known
                self.interval = answer.heartbeat_interval_s or self.interval
            except RingserveError:
                self.missed += 1
            await asyncio.sleep(max(0.0, sent + self.interval - time.monotonic()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self.beats.close()
        await self.channel.close()


async def _swarm(address: str, count: int, first: int, interval: float, health: bool = False) -> None:
    server = None
    advertise = ""
    if health:
        # One health service for the swarm's workers, as a worker's peer server has: the
        # coordinator's probe of a silent worker is then answered while the process runs, and not
        # while it is stopped; a killed swarm refuses it.
        from grpc_health.v1 import health, health_pb2_grpc

        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        advertise = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
    workers = [SimWorker(address, first + i, interval, advertise) for i in range(count)]
    loop = asyncio.get_running_loop()
    # Every swarm joins on the harness's word, so that all join within a short window, however
    # long each took to start.
    _say({"ready": count})
    await loop.run_in_executor(None, sys.stdin.readline)
    await asyncio.gather(*(w.join_and_start() for w in workers))
    _say({"joined": [w.worker_id for w in workers], "at": time.monotonic()})
    silenced: list[SimWorker] = []
    try:
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] == "stop":
                break
            if line[0] == "silence":
                at = time.monotonic()
                batch = [w for w in workers if w not in silenced][: int(line[1])]
                silenced += batch
                await asyncio.gather(*(w.stop() for w in batch))
                _say({"silenced": [w.worker_id for w in batch], "at": at})
            elif line[0] == "report":
                live = [w for w in workers if w not in silenced]
                _say({
                    "latencies": [lat for w in workers for lat in w.latencies],
                    "heartbeats": sum(len(w.latencies) for w in workers),
                    "unknown": sum(w.unknown for w in live),
                    "errors": sum(w.errors for w in live),
                    "missed": sum(w.missed for w in live),
                    "streaming": sum(w.beats.streaming for w in live),
                    "longest_gap": max((w.longest_gap for w in live), default=0.0),
                    "first_view_at": [w.first_view_at for w in workers],
                })
            elif line[0] in ("unary", "stream"):
                for w in workers:
                    w.beats.close()  # a beat in flight on it goes on as a unary call
                    w.beats = HeartbeatStream(w.stub, address, BEAT_TIMEOUT_S, use_stream=line[0] == "stream")
                _say({"mode": line[0]})
    finally:
        await asyncio.gather(*(w.stop() for w in workers if w not in silenced))
        if server is not None:
            await server.stop(None)


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def first_view(views: list[T], changed: asyncio.Event, predicate: Callable[[T], bool], timeout_s: float) -> T:
    """The first of ``views`` (a list that a watcher appends to, setting ``changed``) that
    satisfies ``predicate``, already there or arriving within ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while True:
            for seen in views:
                if predicate(seen):
                    return seen
            changed.clear()
            await changed.wait()


@dataclass
class Seen:
    """A view as the harness's own watcher received it."""

    at: float
    view_id: int
    members: list[str]
    failed: list[str]


@dataclass
class Scale:
    """A coordinator process, swarms of simulated workers, and a watcher of the views.

    Used as ``async with Scale(n, procs=2, interval=0.2, timeout=1.0) as scale:``; the coordinator
    runs with ``max_workers = n`` and ``min_workers`` 80% of it, so that the world outlives the
    failures a test makes.
    """

    n: int
    procs: int = 1
    interval: float = 1.0
    timeout: float = 5.0
    settle: float = 0.5
    extra_args: list[str] = field(default_factory=list)
    health: bool = False  # each swarm serves a health service its workers advertise (see _swarm)
    log: str = ""  # the coordinator logs at INFO to this file ("": its warnings to stderr)
    coordinator: asyncio.subprocess.Process | None = None
    address: str = ""
    swarms: list[asyncio.subprocess.Process] = field(default_factory=list)
    views: list[Seen] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    joined_at: float = 0.0
    _channel: grpc.aio.Channel | None = None
    _watcher: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __aenter__(self) -> Scale:
        args = ["--port", "0", "--min-workers", str(self.n - self.n // 5), "--max-workers", str(self.n),
                "--settle-seconds", str(self.settle), "--heartbeat-interval", str(self.interval),
                "--heartbeat-timeout", str(self.timeout), *self.extra_args]
        logging = ["--log-level", "INFO"] if self.log else []
        with contextlib.ExitStack() as files:
            stderr = files.enter_context(open(self.log, "w")) if self.log else None  # noqa: ASYNC230
            self.coordinator = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ringserve.cli", *logging, "coordinator", *args,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        assert self.coordinator.stdout is not None
        line = (await asyncio.wait_for(self.coordinator.stdout.readline(), 30)).decode()
        found = re.search(r"listening on (\S+)", line)
        assert found, f"unexpected first line of the coordinator: {line!r}"
        self.address = found.group(1)
        self._channel = grpc.aio.insecure_channel(self.address)
        self.stub = pb_grpc.CoordinatorStub(self._channel)
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def start_swarms(self) -> None:
        """Starts the swarms and waits until every simulated worker has joined."""
        shares = [self.n // self.procs + (i < self.n % self.procs) for i in range(self.procs)]
        for i, count in enumerate(shares):
            self.swarms.append(await asyncio.create_subprocess_exec(
                sys.executable, __file__, self.address, "--count", str(count), "--first", str(sum(shares[:i])),
                "--interval", str(self.interval), *(["--health"] if self.health else []),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 26,
            ))
        for swarm in self.swarms:
            await self._read(swarm, timeout_s=120)
        for swarm in self.swarms:
            assert swarm.stdin is not None
            swarm.stdin.write(b"join\n")
            await swarm.stdin.drain()
        for swarm in self.swarms:
            answer = await self._read(swarm, timeout_s=120)
            self.ids += answer["joined"]
            self.joined_at = max(self.joined_at, answer["at"])

    async def _watch(self) -> None:
        async for view in self.stub.WatchView(pb.WatchViewRequest(worker_id="scale-harness")):
            self.views.append(Seen(time.monotonic(), view.view_id, [m.worker_id for m in view.members],
                                   list(view.failed_worker_ids)))
            self._changed.set()

    async def wait_view(self, predicate: Any, timeout_s: float) -> Seen:
        """The first view received (already or within ``timeout_s``) that satisfies ``predicate``."""
        return await first_view(self.views, self._changed, predicate, timeout_s)

    async def command(self, swarm: asyncio.subprocess.Process, line: str) -> dict[str, Any]:
        assert swarm.stdin is not None
        swarm.stdin.write(line.encode() + b"\n")
        await swarm.stdin.drain()
        return await self._read(swarm, timeout_s=60)

    async def silence(self, fraction: float) -> tuple[list[str], float]:
        """Silences ``fraction`` of each swarm's workers, all swarms at once; returns their ids
        and when it began."""
        share = round(fraction * self.n / len(self.swarms))
        for swarm in self.swarms:
            assert swarm.stdin is not None
            swarm.stdin.write(f"silence {share}\n".encode())
        await asyncio.gather(*(swarm.stdin.drain() for swarm in self.swarms if swarm.stdin is not None))
        answers = [await self._read(swarm, timeout_s=60) for swarm in self.swarms]
        return [w for a in answers for w in a["silenced"]], min(a["at"] for a in answers)

    async def broadcast(self, line: str) -> list[dict[str, Any]]:
        """Sends one command to every swarm at once (``unary``, ``stream``); returns their answers."""
        for swarm in self.swarms:
            assert swarm.stdin is not None
            swarm.stdin.write(line.encode() + b"\n")
        await asyncio.gather(*(swarm.stdin.drain() for swarm in self.swarms if swarm.stdin is not None))
        return [await self._read(swarm, timeout_s=60) for swarm in self.swarms]

    async def report(self) -> dict[str, Any]:
        """The swarms' reports, merged: latencies, heartbeat count, unknown and errors."""
        merged: dict[str, Any] = {"latencies": [], "heartbeats": 0, "unknown": 0, "errors": 0, "missed": 0,
                                  "streaming": 0, "first_view_at": []}
        gaps = []
        for swarm in self.swarms:
            answer = await self.command(swarm, "report")
            for key in merged:
                merged[key] += answer[key]
            gaps.append(answer["longest_gap"])
        merged["longest_gap"] = max(gaps, default=0.0)
        return merged

    def coordinator_cpu_s(self) -> float:
        """The coordinator process's user and system CPU time so far."""
        assert self.coordinator is not None
        fields = pathlib.Path(f"/proc/{self.coordinator.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def coordinator_rss_bytes(self) -> int:
        assert self.coordinator is not None
        for line in pathlib.Path(f"/proc/{self.coordinator.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    async def _read(self, swarm: asyncio.subprocess.Process, timeout_s: float) -> dict[str, Any]:
        assert swarm.stdout is not None
        line = await asyncio.wait_for(swarm.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError(f"swarm {swarm.pid} exited with code {await swarm.wait()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def __aexit__(self, *exc: object) -> None:
        for swarm in self.swarms:
            if swarm.returncode is None and swarm.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    swarm.stdin.write(b"stop\n")
                    await swarm.stdin.drain()
        for swarm in self.swarms:
            try:
                await asyncio.wait_for(swarm.wait(), 30)
            except TimeoutError:
                swarm.kill()
                await swarm.wait()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._watcher
        if self._channel is not None:
            await self._channel.close()
        if self.coordinator is not None:
            self.coordinator.terminate()
            try:
                assert await asyncio.wait_for(self.coordinator.wait(), 30) == 0
            finally:
                if self.coordinator.returncode is None:
                    self.coordinator.kill()
                    await self.coordinator.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a swarm of simulated workers (see the module docstring)")
    parser.add_argument("address")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--health", action="store_true", help="serve a health service the workers advertise")
    ns = parser.parse_args()
    try:
        import uvloop

        uvloop.run(_swarm(ns.address, ns.count, ns.first, ns.interval, ns.health))
    except ImportError:
        asyncio.run(_swarm(ns.address, ns.count, ns.first, ns.interval, ns.health))
