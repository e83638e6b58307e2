"""`ringserve coordinator` and `ringserve status` as separate processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

RINGSERVE = [sys.executable, "-m", "ringserve.cli"]

WORKER = """
import sys, numpy as np, ringserve as rs
rs.init()
rs.allreduce(np.ones(1000, np.float32), op="sum", name="x")
rs.barrier()
print("done", flush=True)
sys.stdin.readline()   # stay in the view until the test lets go
rs.shutdown()
"""


@pytest.fixture
def coordinator(coordinator_process: Callable[..., AbstractContextManager[str]]) -> Iterator[str]:
    with coordinator_process(["--port", "0", "--min-workers", "3", "--settle-seconds", "0.2"]) as address:
        yield address


@pytest.mark.timeout(90)
def test_status_shows_the_view_and_each_workers_counters(coordinator: str) -> None:
    env = {**os.environ, "RINGSERVE_COORDINATOR": coordinator}
    workers = [
        subprocess.Popen([sys.executable, "-c", WORKER], env={**env, "RINGSERVE_RANK_HINT": str(i)},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for i in range(3)
    ]
    try:
        for w in workers:
            assert w.stdout is not None
            assert w.stdout.readline().strip() == "done"
        # Counters travel with heartbeats (1 s apart by default).
        deadline_lines: list[str] = []
        for _ in range(40):
            result = subprocess.run([*RINGSERVE, "status", "--coordinator", coordinator, "--json"],
                                    capture_output=True, text=True, timeout=30)
            assert result.returncode == 0, result.stderr
            status = json.loads(result.stdout)
            members = status["members"]
            if len(members) == 3 and all(int(m["counters"]["collectivesDone"]) >= 2 for m in members):
                break
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.25)"], check=True)
        else:
            raise AssertionError(f"counters never arrived: {status}")
        assert [int(m["member"]["rank"]) for m in members] == [0, 1, 2]
        assert all(int(m["counters"]["bytesSent"]) > 0 for m in members)
        assert int(status["viewsFormed"]) >= 1
        table = subprocess.run([*RINGSERVE, "status", "--coordinator", coordinator],
                               capture_output=True, text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        deadline_lines = table.stdout.splitlines()
        assert deadline_lines[0].startswith(f"view {status['view']['viewId']}, 3 workers")
        assert len([line for line in deadline_lines if re.match(r"\s+\d+\s+127\.0\.0\.1:\d+", line)]) == 3
    finally:
        for w in workers:
            if w.poll() is None:
                assert w.stdin is not None
                w.stdin.write("\n")
                w.stdin.flush()
        for w in workers:
            try:
                w.wait(30)
            finally:
                if w.poll() is None:
                    w.kill()


@pytest.mark.timeout(30)
def test_status_of_an_unreachable_coordinator_names_the_address() -> None:
    result = subprocess.run([*RINGSERVE, "status", "--coordinator", "127.0.0.1:1", "--timeout", "1"],
                            capture_output=True, text=True, timeout=25)
    assert result.returncode == 2
    assert "127.0.0.1:1" in result.stderr
