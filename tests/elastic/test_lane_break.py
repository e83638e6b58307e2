"""Elastic training over the TCP payload lane, whose connection is killed mid-training: the ranks
fail that step as they would for a broken stream, restore their last commit, go on in the next
view (whose lanes attach anew), and end with equal replicas.

Two worker processes run elastic_worker.py with shared memory off (their payloads take the lane);
rank 0's payload port sits behind a relay in this process, which rank 1 dials, and which the test
resets (RST on both sides) once training is under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from worlds import coordinator_config, free_port

from ringserve import Coordinator
from ringserve.loop import LoopThread

WORKER = str(Path(__file__).with_name("elastic_worker.py"))
STEPS = 40

pytestmark = pytest.mark.timeout(150)


class Relay:
    """Passes TCP through to ``target``; ``kill`` resets every connection it carries."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.connections = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.connections += 1
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def kill(self) -> int:
        killed = len(self._writers)
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        return killed

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.kill()


def test_a_lane_killed_mid_training_costs_a_restore_and_training_ends_with_equal_replicas(tmp_path: Path) -> None:
    loop = LoopThread(use_uvloop=False)
    coord = loop.run(Coordinator(coordinator_config(min_workers=2, max_workers=2, heartbeat_timeout_s=3.0)).start(), 10)
    port = free_port()
    relay = Relay(port)
    relay_port = loop.run(relay.start(), 10)
    log = tmp_path / "commits.jsonl"
    common = {"RINGSERVE_COORDINATOR": coord.address, "RINGSERVE_SHARED_MEMORY": "0",
              "RINGSERVE_COLLECTIVE_TIMEOUT_S": "30", "PYTHONPATH": str(Path(__file__).parent)}
    envs = [{**common, "RINGSERVE_RANK_HINT": "0", "RINGSERVE_PAYLOAD_PORT": str(port),
             "RINGSERVE_PAYLOAD_ADVERTISE_PORT": str(relay_port)},
            {**common, "RINGSERVE_RANK_HINT": "1"}]
    procs = [subprocess.Popen([sys.executable, WORKER, str(log), str(STEPS), "0.05"], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for env in envs]
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and any(json.loads(line)["step"] >= 8 for line in log.read_text().splitlines())):
            assert time.monotonic() < deadline, "training did not reach step 8"
            assert all(p.poll() is None for p in procs), "a worker exited early"
            time.sleep(0.05)
        assert relay.connections >= 1, "rank 1 never dialled rank 0's lane"
        killed = loop.run(relay.kill(), 10)
        outputs = [p.communicate(timeout=100)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        loop.run(relay.close(), 10)
        loop.run(coord.stop(), 10)
        loop.stop()
    assert killed >= 2
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert f"finished at step {STEPS}" in out
    assert any("restoring the last commit" in out for out in outputs), outputs[0][-2000:] + outputs[1][-2000:]
    assert relay.connections >= 2, "the next view's lane did not attach through the relay again"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    by_step: dict[int, set[str]] = {}
    for r in records:
        by_step.setdefault(r["step"], set()).add(r["sha"])
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert all(len(shas) == 1 for shas in by_step.values()), by_step  # the replicas never differ
    assert len({r["view"] for r in records}) >= 2  # the break cost a view change, as a broken stream does
