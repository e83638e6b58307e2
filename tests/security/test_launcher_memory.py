"""A flood at ``ringserve run``'s coordinator does not leave the launcher larger.

Messages past the coordinator's receive cap are assembled by gRPC's core before they are refused,
on its own threads' heaps; in a busy launcher twenty 100 MB messages left it 130-190 MiB larger for
good
(issue 42, item 10; ``benchmarks/hostile_memory.py`` measures every input). The launcher now gives
freed heap pages back to the system, as a coordinator of its own does.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringserve.coordinator.server import MAX_RECEIVE_BYTES

pytestmark = pytest.mark.timeout(150)

MiB = 1 << 20
JOB = ("import time, numpy as np, ringserve as rs\nrs.init()\nend = time.time() + 120\n"
       "while time.time() < end:\n"
       "    assert (rs.allreduce(np.ones(1 << 16), op='sum') == rs.size()).all()\n")


# Twenty 100 MB parameter chunks, each refused by name (RESOURCE_EXHAUSTED, the cap in its details).
FLOOD = """
import sys, grpc
from ringserve._proto import coordinator_pb2 as pb, coordinator_pb2_grpc as pb_grpc
address, cap = sys.argv[1], sys.argv[2]
blob = b"\\x01" * (100 * 1000 * 1000)
channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
stub = pb_grpc.CoordinatorStub(channel)
for i in range(20):
    try:
        stub.PutParams(iter([pb.ParamChunk(key=f"k{i}", total_bytes=len(blob), data=blob)]), timeout=30)
        print("stored")
    except grpc.RpcError as exc:
        ok = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"vs. {cap}" in (exc.details() or "")
        print("refused" if ok else f"{exc.code()}: {exc.details()}")
"""


def rss(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


async def test_oversized_messages_at_a_busy_launchers_coordinator_are_refused_and_its_memory_returns(
    tmp_path: Path,
) -> None:
    # Its output goes to a file: past its first line nobody reads it while it runs, and in a pipe
    # (64 KiB) a launcher logging the flood, or its workers' warnings, could block.
    output = tmp_path / "launcher.out"
    with output.open("wb") as sink:
        launcher = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "run", "-np", "2", sys.executable, "-c", JOB],
                                    stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        async with asyncio.timeout(60):
            while not (found := re.search(r"coordinator at (\S+?);", output.read_text(errors="replace"))):
                assert launcher.poll() is None, output.read_text(errors="replace")
                await asyncio.sleep(0.05)
        address = found.group(1)
        await asyncio.sleep(3)  # the workers are allreducing
        before = rss(launcher.pid)
        # The flood comes from a process of its own, gone once it is over: a connection that a
        # client keeps open holds gRPC's buffers in the launcher (up to some 30 MiB after this
        # flood), and a closed channel's connection can outlive its close in the client's process.
        flood = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", FLOOD, address, str(MAX_RECEIVE_BYTES)],
                                        capture_output=True, text=True, timeout=120)
        assert flood.returncode == 0 and flood.stdout.split() == ["refused"] * 20, flood.stdout + flood.stderr
        deadline = time.monotonic() + 20
        while (now := rss(launcher.pid)) > before + 32 * MiB and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert now <= before + 32 * MiB, f"the launcher stayed at {now / MiB:.0f} MiB, from {before / MiB:.0f} MiB"
        assert launcher.poll() is None, "the job ended under the flood:\n" + output.read_text(errors="replace")[-3000:]
    finally:
        launcher.terminate()
        try:
            launcher.wait(20)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
