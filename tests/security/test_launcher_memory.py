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

import grpc
import pytest

from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.coordinator.server import MAX_RECEIVE_BYTES

pytestmark = pytest.mark.timeout(150)

MiB = 1 << 20
JOB = ("import time, numpy as np, ringserve as rs\nrs.init()\nend = time.time() + 120\n"
       "while time.time() < end:\n"
       "    assert (rs.allreduce(np.ones(1 << 16), op='sum') == rs.size()).all()\n")


def rss(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


async def test_oversized_messages_at_a_busy_launchers_coordinator_are_refused_and_its_memory_returns() -> None:
    launcher = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "run", "-np", "2", sys.executable, "-c", JOB],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert launcher.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(launcher.stdout.readline), 60)
        address = re.search(r"coordinator at (\S+?);", line).group(1)  # type: ignore[union-attr]
        await asyncio.sleep(3)  # the workers are allreducing
        before = rss(launcher.pid)
        blob = b"\x01" * (100 * 1000 * 1000)
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            for i in range(20):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.PutParams(iter([pb.ParamChunk(key=f"k{i}", total_bytes=len(blob), data=blob)]), timeout=30)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"vs. {MAX_RECEIVE_BYTES}" in (refused.value.details() or "")
        deadline = time.monotonic() + 20
        while (now := rss(launcher.pid)) > before + 32 * MiB and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert now <= before + 32 * MiB, f"the launcher stayed at {now / MiB:.0f} MiB, from {before / MiB:.0f} MiB"
        assert launcher.poll() is None, "the job ended under the flood"
    finally:
        launcher.terminate()
        try:
            launcher.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.communicate()
