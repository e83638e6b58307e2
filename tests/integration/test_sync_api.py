"""The synchronous API (ringserve.init / allreduce / ... / shutdown) in real worker processes.

The coordinator runs in the test process on a background loop thread; each worker is a fresh
``python -c`` process that finds it through RINGSERVE_COORDINATOR, as a training script would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from ringserve import Coordinator
from ringserve.loop import LoopThread

WORKER_SCRIPT = textwrap.dedent(
    """
    import json, threading
    import numpy as np
    import ringserve as rs

    def threads():
        # grpc's process-wide completion-queue poller outlives every channel by design.
        return sorted(t.name for t in threading.enumerate() if "_poll_wrapper" not in t.name)

    out = {"threads_before": threads()}
    rs.init()
    rs.init()  # a second init is a no-op
    r, n = rs.rank(), rs.size()
    out.update(rank=r, size=n, local=[rs.local_rank(), rs.local_size()])
    out["sum"] = rs.allreduce(np.arange(5, dtype=np.float32) * (r + 1), op="sum", name="s").tolist()
    out["avg"] = rs.allreduce(np.full(3, 2 * r, dtype=np.int64), op="average").tolist()
    out["max"] = rs.allreduce(np.array([r, -r], dtype=np.float16), op="max").tolist()
    out["bcast"] = rs.broadcast(np.full(4, r, dtype=np.int32), root=n - 1).tolist()
    out["gather"] = rs.allgather(np.full((r + 1,), r, dtype=np.int64)).tolist()
    out["scatter"] = rs.reduce_scatter(np.arange(2 * n, dtype=np.float64), op="sum").tolist()
    rs.barrier()
    out["obj"] = rs.broadcast_object({"seed": 42} if r == 0 else None)
    out["objs"] = rs.allgather_object("r%d" % r)
    out["threads_during"] = threads()
    rs.shutdown()
    out["initialized_after"] = rs.is_initialized()
    try:
        rs.allreduce(np.ones(1))
        out["after_shutdown"] = "returned"
    except rs.NotInitializedError:
        out["after_shutdown"] = "NotInitializedError"
    out["threads_after"] = threads()
    print("RESULT " + json.dumps(out), flush=True)
    """
)

REINIT_SCRIPT = textwrap.dedent(
    """
    import json, threading
    import numpy as np
    import ringserve as rs

    def threads():
        return sorted(t.name for t in threading.enumerate())

    out = {"sums": [], "threads": []}
    for cycle in range(3):
        rs.init()
        out["sums"].append(rs.allreduce(np.full(2, cycle + 1.0), op="sum").tolist())
        rs.shutdown()
        out["threads"].append(threads())
    print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.fixture
def background_coordinator(request: pytest.FixtureRequest, make_coordinator_config) -> Iterator[Coordinator]:
    """A coordinator on its own loop thread, for tests whose workers are other processes."""
    config = make_coordinator_config(**getattr(request, "param", {}))
    thread = LoopThread(use_uvloop=False, name="test-coordinator")

    async def start() -> Coordinator:
        return await Coordinator(config).start()

    coord = thread.run(start(), 10)
    try:
        yield coord
    finally:
        thread.run(coord.stop(), 10)
        thread.stop()


def run_workers(script: str, address: str, count: int, timeout_s: float = 90) -> list[dict]:
    env = {
        **os.environ,
        "RINGSERVE_COORDINATOR": address,
        "RINGSERVE_CONNECT_TIMEOUT_S": "20",
        "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60",
        "RINGSERVE_COLLECTIVE_TIMEOUT_S": "30",
    }
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            assert p.returncode == 0, f"a worker process exited with {p.returncode}:\n{stderr[-4000:]}"
            lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            assert lines, f"a worker printed no result:\n{stdout[-2000:]}\n{stderr[-4000:]}"
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return sorted(results, key=lambda out: out.get("rank", 0))


@pytest.mark.parametrize(
    ("background_coordinator", "n"),
    [({"min_workers": 2}, 2), ({"min_workers": 3}, 3)],
    indirect=["background_coordinator"],
    ids=["2 processes", "3 processes"],
)
def test_worker_processes_using_the_sync_api_get_numpys_answers_and_leak_no_threads(background_coordinator, n: int) -> None:
    results = run_workers(WORKER_SCRIPT, background_coordinator.address, n)
    assert [out["rank"] for out in results] == list(range(n))
    for r, out in enumerate(results):
        assert out["size"] == n
        assert out["local"] == [r, n]
        assert out["sum"] == [float(i * n * (n + 1) // 2) for i in range(5)]
        assert out["avg"] == [(n - 1)] * 3
        assert out["max"] == [float(n - 1), 0.0]
        assert out["bcast"] == [n - 1] * 4
        assert out["gather"] == [q for q in range(n) for _ in range(q + 1)]
        assert out["scatter"] == [float(i * n) for i in range(2 * n)][2 * r : 2 * r + 2]
        assert out["obj"] == {"seed": 42}
        assert out["objs"] == [f"r{q}" for q in range(n)]
        assert "ringserve-loop" in out["threads_during"]
        assert out["initialized_after"] is False
        assert out["after_shutdown"] == "NotInitializedError"
        assert out["threads_after"] == out["threads_before"] == ["MainThread"], f"rank {r} leaked threads"


@pytest.mark.parametrize("background_coordinator", [{"min_workers": 1}], indirect=True, ids=["min 1"])
def test_init_and_shutdown_can_be_repeated_without_threads_piling_up(background_coordinator) -> None:
    (out,) = run_workers(REINIT_SCRIPT, background_coordinator.address, 1)
    assert out["sums"] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert out["threads"][0] == out["threads"][1] == out["threads"][2]
    assert not any(name.startswith("ringserve") for name in out["threads"][-1])
