"""Which hostile input grows a job's launcher and coordinator, and which named cap bounds it.

    .venv/bin/python benchmarks/hostile_memory.py                      # every input, in turn
    .venv/bin/python benchmarks/hostile_memory.py --inputs watch params # some of them

A 2-worker numpy job runs under ``ringserve run -np 2`` on loopback (its launcher holds the
coordinator) and checks every allreduce's sum. Each input is then sent at the coordinator in turn,
and the launcher's resident memory (VmRSS) is read before, at its peak during, and ``--settle``
seconds after it ends. The job must still be making progress, with exact sums, after each.

=========== =================================================================================
input       what is sent
=========== =================================================================================
garbage     500 connections, 64 KiB of random bytes each
http1       500 HTTP/1.1 requests
tls         500 TLS ClientHellos (the coordinator speaks plaintext here)
oversized   20 PutParams messages of 100 MB (past max_message_bytes)
held        2,000 TCP connections that finish HTTP/2's preface and hold, then close
watch       4,100 WatchView streams under distinct worker ids, held, then cancelled
params      PutParams blobs of 1 MiB under 1,200 keys (past max_param_bytes)
=========== =================================================================================
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

WORKER = textwrap.dedent("""
    import os, pathlib, sys
    import numpy as np
    import ringserve as rs
    rs.init()
    progress = pathlib.Path(sys.argv[1]) / f"progress-{rs.rank()}.txt"
    stop = pathlib.Path(sys.argv[1]) / "stop"
    step = 0
    while not stop.exists():
        got = rs.allreduce(np.full(1 << 16, float(rs.rank() + step), dtype=np.float64), op="sum")
        want = float(sum(r + step for r in range(rs.size())))
        if not (got == want).all():
            print(f"WRONG at step {step}", flush=True)
            sys.exit(3)
        step += 1
        progress.with_suffix(".tmp").write_text(str(step))
        os.replace(progress.with_suffix(".tmp"), progress)
    rs.shutdown()
""")


def rss(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def steps(directory: Path) -> int:
    return min(int((directory / f"progress-{r}.txt").read_text()) for r in range(2))


def raw(address: str, payloads: list[bytes], hold_s: float = 0.0) -> None:
    host, port = address.rsplit(":", 1)
    socks = []
    for payload in payloads:
        s = socket.create_connection((host, int(port)), timeout=5)
        with contextlib.suppress(OSError):
            s.sendall(payload)
        socks.append(s)
    time.sleep(hold_s or 0.5)
    for s in socks:
        s.close()


def client_hello(rng: random.Random) -> bytes:
    body = b"\x03\x03" + rng.randbytes(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00" + b"\x00\x00"
    hand = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + len(hand).to_bytes(2, "big") + hand


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def oversized(address: str) -> None:
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        blob = b"\x01" * (100 * 1000 * 1000)
        for i in range(20):
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.PutParams(iter([pb.ParamChunk(key=f"big{i}", offset=0, total_bytes=len(blob), data=blob)]),
                                     timeout=30)


async def watch(address: str, count: int = 4100, hold_s: float = 10.0) -> None:
    channels = [grpc.aio.insecure_channel(address) for _ in range(count // 50 + 1)]
    calls = []
    for i in range(count):
        stub = pb_grpc.CoordinatorStub(channels[i % len(channels)])
        calls.append(stub.WatchView(pb.WatchViewRequest(worker_id=f"watcher-{i}")))

    async def drain(call: Any) -> None:
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError:
            pass

    tasks = [asyncio.create_task(drain(c)) for c in calls]
    await asyncio.sleep(hold_s)
    for c in calls:
        c.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in channels:
        await ch.close()


async def params(address: str, keys: int = 1200) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        blob = random.Random(1).randbytes(MiB)
        for i in range(keys):
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.PutParams(iter([pb.ParamChunk(key=f"key-{i}", offset=0, total_bytes=MiB, data=blob)]),
                                     timeout=30)


def inputs_table(address: str) -> dict[str, Callable[[], Awaitable[None] | None]]:
    rng = random.Random(7)
    return {
        "garbage": lambda: raw(address, [rng.randbytes(64 << 10) for _ in range(500)]),
        "http1": lambda: raw(address, [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"] * 500),
        "tls": lambda: raw(address, [client_hello(rng) for _ in range(500)]),
        "oversized": lambda: oversized(address),
        "held": lambda: raw(address, [H2_PREFACE] * 2000, hold_s=10.0),
        "watch": lambda: watch(address),
        "params": lambda: params(address),
    }


async def measured(send: Callable[[], Awaitable[None] | None], pid: int, before: int, settle_s: float) -> tuple[float, int]:
    """Sends one input, then waits ``settle_s``; returns the time it took and the peak RSS meanwhile."""
    peak = before
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss(pid))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    began = time.monotonic()
    result = await asyncio.to_thread(send)  # a raw input runs there; a gRPC one is awaited here
    if asyncio.iscoroutine(result):
        await result
    took = time.monotonic() - began
    await asyncio.sleep(settle_s)
    stop.set()
    await sampler
    return took, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", nargs="*", default=None)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after each input before RSS is read")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="ringserve-hostile-"))
    script = directory / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "run", "-np", "2", sys.executable, str(script),
                                 str(directory)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rows: list[dict[str, Any]] = []
    try:
        address = ""
        assert launcher.stdout is not None
        while not address:
            line = launcher.stdout.readline()
            if not line:
                raise SystemExit("the launcher exited before it printed its coordinator")
            if m := re.search(r"coordinator at (\S+?);", line):
                address = m.group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                if steps(directory) > 5:
                    break
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the job made no progress in 60 s")
            time.sleep(0.2)
        time.sleep(2)
        start = rss(launcher.pid)
        print(f"launcher at start: {start / MiB:.0f} MiB", flush=True)
        table = inputs_table(address)
        for name in args.inputs or list(table):
            before, done_before = rss(launcher.pid), steps(directory)
            took, peak = asyncio.run(measured(table[name], launcher.pid, before, args.settle))
            after = rss(launcher.pid)
            row = {"input": name, "before_mib": round(before / MiB, 1), "peak_mib": round(peak / MiB, 1),
                   "after_mib": round(after / MiB, 1), "seconds": round(took, 1),
                   "job_steps": steps(directory) - done_before, "job_alive": launcher.poll() is None}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if launcher.poll() is not None:
                break
    finally:
        (directory / "stop").write_text("")
        try:
            out, _ = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            out, _ = launcher.communicate()
        if "WRONG" in (out or ""):
            print(out[-3000:])
            rows.append({"wrong": True})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    ok = all(r.get("job_alive") and r.get("job_steps", 0) > 0 for r in rows if "input" in r) and \
        not any(r.get("wrong") for r in rows)
    print("the job went on, exact, through every input" if ok else "THE JOB DID NOT GO ON through every input")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
