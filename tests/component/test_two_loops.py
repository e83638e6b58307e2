"""A process with two loop threads, each using gRPC (a torchrun rank 0: its worker's loop and its
coordinator's): a loop that stops with calls in flight must not leave their late completions to
the other loop, which would hand them to a closed loop and log "Event loop is closed" (the chaos
campaign saw it once in 300 faults). ringserve.loop drains them before it closes (GRPC_DRAIN_S)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
import asyncio, sys
import grpc
from ringserve.loop import LoopThread

async def serve():
    server = grpc.aio.server()
    async def slow(request, context):
        await asyncio.sleep(30)
        return request
    handler = grpc.method_handlers_generic_handler("t.T", {"S": grpc.unary_unary_rpc_method_handler(slow)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port

other = LoopThread(use_uvloop=True, name="the other loop")
server, port = other.run(serve(), 10)
kept = []
for _ in range(10):
    first = LoopThread(use_uvloop=True, name="a loop that stops")
    async def calls():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        tasks = [asyncio.ensure_future(channel.unary_unary("/t.T/S")(b"x", timeout=20)) for _ in range(20)]
        await asyncio.sleep(0.05)
        return channel, tasks
    kept.append(first.run(calls(), 10))
    first.stop()  # with the 20 calls in flight: their tasks are cancelled, the loop closed
other.run(asyncio.sleep(0.5), 5)
print("done", flush=True)
"""


def test_a_loop_stopped_with_grpc_calls_in_flight_leaves_no_completion_to_a_closed_loop() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=90, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-3000:]
    assert "Event loop is closed" not in run.stderr, run.stderr[-3000:]
