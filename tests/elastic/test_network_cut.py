"""A worker's network cut: the worker runs in a network namespace of its own, joined to the
others' namespace by a veth pair, and the test sets that link down mid-training (no RST, no FIN:
packets just stop), then up again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import harness
import pytest

HAVE_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not HAVE_NETNS, reason="needs root and iproute2 (ip netns) to make the test's own network namespaces"),
]

# Addresses of the test's own hosts, inside namespaces the test makes and removes.
HOST_A, HOST_B = "10.213.7.1", "10.213.7.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:6]
    a, b = f"rs-a-{tag}", f"rs-b-{tag}"
    va, vb = f"rsa{tag}", f"rsb{tag}"
    ip("netns", "add", a)
    ip("netns", "add", b)
    try:
        ip("link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
        for ns, dev, addr in ((a, va, HOST_A), (b, vb, HOST_B)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def in_ns(ns: str, argv: list[str], env: dict[str, str], out: Path) -> subprocess.Popen[bytes]:
    """``argv`` in namespace ``ns``, its output in the file ``out``: a pipe that nobody reads until
    the end fills, and the process writing to it (a coordinator logging a cut) stops."""
    with out.open("wb") as f:
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env={**os.environ, **env},
                                stdout=f, stderr=subprocess.STDOUT)


def wait_for_line(process: subprocess.Popen[bytes], out: Path, text: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while text not in out.read_text(errors="replace"):
        assert process.poll() is None, f"it exited with {process.returncode}: {out.read_text(errors='replace')[-3000:]}"
        assert time.time() < deadline, f"no {text!r} within {timeout_s:g} s: {out.read_text(errors='replace')[-3000:]}"
        time.sleep(0.05)


def test_a_worker_whose_link_goes_down_is_dropped_the_others_go_on_and_it_rejoins_when_the_link_is_back(
    tmp_path: Path, namespaces: tuple[str, str]
) -> None:
    a, b = namespaces
    port = 29000 + os.getpid() % 1000
    token = {"RINGSERVE_TOKEN": "network-cut-job-token"}  # off loopback: secure by default
    coordinator = in_ns(a, [sys.executable, "-m", "ringserve.cli", "coordinator", "--host", HOST_A, "--port", str(port),
                            "--min-workers", "2", "--settle-seconds", "2", "--heartbeat-timeout", "2"], token,
                      tmp_path / "coordinator.log")
    wait_for_line(coordinator, tmp_path / "coordinator.log", "listening on", 60)
    log = tmp_path / "commits.jsonl"
    steps = 250
    common = {**token, "RINGSERVE_COORDINATOR": f"{HOST_A}:{port}", "RINGSERVE_ELASTIC_TIMEOUT_S": "60",
              "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, harness.WORKER, str(log), str(steps), "0.03"]
    workers = [in_ns(a, argv, {**common, "RINGSERVE_BIND_HOST": HOST_A, "RINGSERVE_RANK_HINT": str(i)},
                     tmp_path / f"worker-{i}.log") for i in range(3)]
    victim = in_ns(b, argv, {**common, "RINGSERVE_BIND_HOST": HOST_B, "RINGSERVE_RANK_HINT": "3"},
                   tmp_path / "worker-3.log")
    run = harness.Run(log=log, launcher=workers[0])
    try:
        run.wait_for_step(20, 90)
        deadline = time.time() + 60
        while len({r["pid"] for r in run.records() if r["step"] > 0}) < 4:
            assert time.time() < deadline, "the four workers never trained together"
            time.sleep(0.1)
        cut_view = max(r["view"] for r in run.records())
        run.faults.append((time.time(), "link down", victim.pid))
        ip("-n", b, "link", "set", f"rsb{b.rsplit('-', 1)[1]}", "down")
        deadline = time.time() + 30
        while not any(r["view"] > cut_view for r in run.records()):
            assert time.time() < deadline, "the others never went on without the cut-off worker"
            time.sleep(0.1)
        time.sleep(1.0)
        ip("-n", b, "link", "set", f"rsb{b.rsplit('-', 1)[1]}", "up")
        outs = []
        for i, w in enumerate([*workers, victim]):
            w.wait(timeout=150)
            outs.append((tmp_path / f"worker-{i}.log").read_text(errors="replace"))
    finally:
        for p in [*workers, victim, coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(w.returncode == 0 for w in workers), outs[-1][-3000:]
    records = run.records()
    harness.check_invariants(records, steps)
    times = harness.recovery_times(run, records)
    assert times and times[0] < 2 + 2 + 2, f"recovery took {times}"
    victim_after = [r for r in records if r["pid"] == victim.pid and r["view"] > cut_view]
    # Once its link was back, the cut-off worker rejoined and trained again (or training had ended).
    assert victim_after or victim.returncode == 0, outs[-1][-3000:]
    print(f"\nlink down: recovery s {[round(t, 2) for t in times]}, victim exit {victim.returncode}")
