"""Partial partitions between network namespaces the test makes: routes blackholed in one worker's
namespace (``ip route add blackhole``), so its packets to some hosts vanish and nothing says so.

Topology: the coordinator's namespace holds a bridge; three workers share a second namespace (one
address each), and the victim has a third. Each scenario runs twice: with the workers on one host
(one hostname, shared memory between them), and as four hosts (a hostname each, shared memory
off), where the TCP payload lane carries every payload and the cut breaks the lanes mid-collective
(issue 40: there the survivors died of a bare CancelledError and training never resumed). The
scenarios of issues 11 and 40:

- the victim loses its routes to its peers but keeps the coordinator: the others go on without it
  within a bound, and it rejoins at a commit once the routes are back;
- the mirror: it loses the coordinator but keeps its peers: it trains on until the coordinator
  declares it dead, then stops with ExcludedError, and never trains as a second world;
- one way: the peers' namespace blackholes its route to the victim, so nothing of theirs reaches
  it, while everything it sends still reaches them; it is dropped as in the first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import harness
import pytest

HAVE_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not HAVE_NETNS, reason="needs root and iproute2 (ip netns) to make the test's own network namespaces"),
]

NET = "10.213.9"
COORDINATOR = f"{NET}.1"
PEERS = [f"{NET}.2", f"{NET}.3", f"{NET}.4"]  # the three workers that share a namespace
VICTIM = f"{NET}.10"
HEARTBEAT_TIMEOUT_S = 2.0
# The issue's bound for a partition. A blackholed link is noticed by the peer channels' keepalive,
# which follows the heartbeat timeout (transport.keepalive_for: a ping after half of it, answered
# within the other half); the ring check then takes half of it (ringcheck.window: a link that is up
# says so at once); the rest is the reports, the bump, the restore and the next commit. (Before,
# keepalive took 10 s + 5 s and the lane's drop took 17 s: issue 40.)
DROP_BOUND_S = HEARTBEAT_TIMEOUT_S + 2


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Net:
    coordinator: str  # namespace names
    peers: str
    victim: str

    def blackhole(self, *addresses: str) -> None:
        for address in addresses:
            ip("-n", self.victim, "route", "add", "blackhole", f"{address}/32")

    def restore(self, *addresses: str) -> None:
        for address in addresses:
            ip("-n", self.victim, "route", "del", "blackhole", f"{address}/32")

    def drop_to_victim(self) -> None:
        """One way: nothing from the peers' namespace reaches the victim; what it sends arrives."""
        ip("-n", self.peers, "route", "add", "blackhole", f"{VICTIM}/32")

    def restore_to_victim(self) -> None:
        ip("-n", self.peers, "route", "del", "blackhole", f"{VICTIM}/32")


@pytest.fixture
def net() -> Iterator[Net]:
    tag = uuid.uuid4().hex[:6]
    c, p, v = f"rs-c-{tag}", f"rs-p-{tag}", f"rs-v-{tag}"
    for ns in (c, p, v):
        ip("netns", "add", ns)
    try:
        ip("-n", c, "link", "add", "br0", "type", "bridge")
        ip("-n", c, "addr", "add", f"{COORDINATOR}/24", "dev", "br0")
        ip("-n", c, "link", "set", "br0", "up")
        for ns, addresses in ((p, PEERS), (v, [VICTIM])):
            outer, inner = f"rs{ns[3]}{tag}", f"rs{ns[3]}i{tag}"
            ip("link", "add", outer, "netns", c, "type", "veth", "peer", "name", inner, "netns", ns)
            ip("-n", c, "link", "set", outer, "master", "br0")
            ip("-n", c, "link", "set", outer, "up")
            for address in addresses:
                ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
        for ns in (c, p, v):
            ip("-n", ns, "link", "set", "lo", "up")
        yield Net(c, p, v)
    finally:
        for ns in (c, p, v):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def in_ns(ns: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Its output goes to the file ``log``: nobody reads it while it runs, and in a pipe (64 KiB)
    a process logging the faults could block."""
    with log.open("wb") as out:
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env={**os.environ, **env},
                                stdout=out, stderr=subprocess.STDOUT)


@dataclass
class Job:
    run: harness.Run
    coordinator: subprocess.Popen[bytes]
    peers: list[subprocess.Popen[bytes]]
    victim: subprocess.Popen[bytes]
    steps: int
    logs: list[Path]  # the workers' output: the peers', then the victim's

    def all(self) -> list[subprocess.Popen[bytes]]:
        return [*self.peers, self.victim, self.coordinator]

    def outputs(self) -> list[str]:
        return [log.read_text(errors="replace") for log in self.logs]

    def training_together(self, timeout_s: float) -> int:
        """Waits until all four workers have committed; returns the newest view so far."""
        self.run.wait_for_step(10, 90)
        deadline = time.time() + timeout_s
        while len({r["pid"] for r in self.run.records() if r["step"] > 0}) < 4:
            assert time.time() < deadline, "the four workers never trained together"
            time.sleep(0.1)
        return max(r["view"] for r in self.run.records())

    def first_commit_after(self, view: int, timeout_s: float, pid: int | None = None) -> float:
        deadline = time.time() + timeout_s
        while True:
            times = [r["time"] for r in self.run.records() if r["view"] > view and (pid is None or r["pid"] == pid)]
            if times:
                return min(times)
            assert time.time() < deadline, f"no commit in a view after {view} within {timeout_s} s"
            time.sleep(0.1)


LANES = ["one-host", "lane"]


def lane_env(lane: str, address: str) -> dict[str, str]:
    """``one-host``: every worker on one host (one hostname), payloads in shared memory; ``lane``:
    a host per worker, shared memory off, so payloads cross the TCP payload lane."""
    if lane == "one-host":
        return {}
    return {"RINGSERVE_HOSTNAME": f"host-{address}", "RINGSERVE_SHARED_MEMORY": "0"}


def start_job(tmp_path: Path, net: Net, steps: int, lane: str = "one-host") -> Job:
    port = 29500 + os.getpid() % 400
    coordinator_log = tmp_path / "coordinator.log"
    token = {"RINGSERVE_TOKEN": "partial-partition-job-token"}  # off loopback: secure by default
    coordinator = in_ns(net.coordinator, [
        sys.executable, "-m", "ringserve.cli", "--log-level", "info", "coordinator", "--host", COORDINATOR, "--port", str(port),
        "--min-workers", "2", "--settle-seconds", "2", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)], token, coordinator_log)
    deadline = time.time() + 30
    while "listening on" not in coordinator_log.read_text():
        assert time.time() < deadline and coordinator.poll() is None, coordinator_log.read_text()
        time.sleep(0.05)
    log = tmp_path / "commits.jsonl"
    common = {**token, "RINGSERVE_COORDINATOR": f"{COORDINATOR}:{port}", "RINGSERVE_ELASTIC_TIMEOUT_S": "90",
              "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60", "RINGSERVE_RPC_TIMEOUT_S": "1", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, harness.WORKER, str(log), str(steps), "0.03"]
    # The victim takes rank 1, so that the tie-break (the latest rank goes) cannot be what drops it.
    peer_logs, victim_log = [tmp_path / f"peer-{a}.out" for a in PEERS], tmp_path / "victim.out"
    peers = [in_ns(net.peers, argv, {**common, **lane_env(lane, a), "RINGSERVE_BIND_HOST": a, "RINGSERVE_RANK_HINT": str(r)}, out)
             for a, r, out in zip(PEERS, (0, 2, 3), peer_logs, strict=True)]
    victim = in_ns(net.victim, argv, {**common, **lane_env(lane, VICTIM), "RINGSERVE_BIND_HOST": VICTIM,
                                      "RINGSERVE_RANK_HINT": "1"}, victim_log)
    return Job(harness.Run(log=log, launcher=peers[0]), coordinator, peers, victim, steps, [*peer_logs, victim_log])


def finish(job: Job, timeout_s: float) -> list[str]:
    """Waits for every worker to exit; returns their outputs."""
    for p in [*job.peers, job.victim]:
        p.wait(timeout_s)
    return job.outputs()


def kill(job: Job) -> None:
    for p in job.all():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("way", ["both", "one"])
def test_a_worker_cut_off_from_its_peers_but_not_the_coordinator_is_dropped_within_a_bound_and_rejoins_after_the_heal(
    tmp_path: Path, net: Net, lane: str, way: str
) -> None:
    job = start_job(tmp_path, net, steps=400, lane=lane)
    try:
        cut_view = job.training_together(60)
        cut = time.time()
        job.run.faults.append((cut, f"peer routes cut ({way} way)", job.victim.pid))
        if way == "both":
            net.blackhole(*PEERS)
        else:
            net.drop_to_victim()
        dropped = job.first_commit_after(cut_view, DROP_BOUND_S + 10)
        time.sleep(2.0)
        healed = time.time()
        if way == "both":
            net.restore(*PEERS)
        else:
            net.restore_to_victim()
        back = job.first_commit_after(cut_view, 60, pid=job.victim.pid)
        outs = finish(job, 150)
    finally:
        kill(job)
    assert all(p.returncode == 0 for p in [*job.peers, job.victim]), "\n".join(o[-2000:] for o in outs)
    records = job.run.records()
    harness.check_invariants(records, job.steps)
    assert dropped - cut < DROP_BOUND_S, f"the others went on {dropped - cut:.1f} s after the cut"
    events = [line for line in (tmp_path / "coordinator.log").read_text().splitlines()
              if "reports" in line or "answers the coordinator" in line or "removed" in line or "formed" in line]
    print("\n" + "\n".join(line[:200] for line in events))
    print(f"\n[{lane}, {way} way] peer routes cut at {time.strftime('%H:%M:%S', time.localtime(cut))}: first commit without the victim {dropped - cut:.2f} s after the cut; "
          f"victim committed again {back - healed:.2f} s after the heal")


@pytest.mark.parametrize("lane", LANES)
def test_a_worker_cut_off_from_the_coordinator_trains_until_declared_dead_then_stops_with_excluded_error(
    tmp_path: Path, net: Net, lane: str
) -> None:
    job = start_job(tmp_path, net, steps=300, lane=lane)
    try:
        cut_view = job.training_together(60)
        cut = time.time()
        net.blackhole(COORDINATOR)
        dropped = job.first_commit_after(cut_view, 30)
        try:
            job.victim.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the victim did not stop: {job.outputs()[-1][-4000:]}") from None
        stopped = time.time()
        outs = finish(job, 150)
    finally:
        kill(job)
    assert all(p.returncode == 0 for p in job.peers), "\n".join(o[-2000:] for o in outs)
    victim_text = job.outputs()[-1]
    assert job.victim.returncode != 0 and "ExcludedError" in victim_text, victim_text[-3000:]
    assert "so it stops rather than train as a second world" in victim_text
    records = job.run.records()
    harness.check_invariants(records, job.steps)
    # No second world: every step the victim committed after the cut, another worker committed too
    # with the same weights, in the same view (one lone commit at the very end is allowed: a
    # collective can finish on one rank while the others fail), and it committed in no newer view.
    others = {(r["view"], r["step"], r["sha"]) for r in records if r["pid"] != job.victim.pid}
    mine = [r for r in records if r["pid"] == job.victim.pid and r["time"] > cut]
    alone = [r for r in mine if (r["view"], r["step"], r["sha"]) not in others]
    assert len(alone) <= 1 and all(r["view"] <= cut_view for r in mine), alone
    per_step: dict[int, int] = defaultdict(int)
    for r in mine:
        per_step[r["step"]] += 1
    assert all(n == 1 for n in per_step.values())
    assert mine, "the victim stopped training as soon as it lost the coordinator"
    print(f"\ncoordinator route cut: first commit without the victim {dropped - cut:.2f} s after the cut; "
          f"victim trained {max(r['time'] for r in mine) - cut:.2f} s on, stopped {stopped - cut:.2f} s after the cut")
