"""The chaos campaign's partition job: four workers, each a host of its own in a network namespace.

    Job("numpy-netns-lane", harness.WORKER, {}, ("partition", "partition-one-way"), start=partitions.start)

``start`` makes the job's own namespaces: one for the coordinator, holding a bridge, and one per
worker, each joined to the bridge by a veth pair, with an address of its own (``NET.11`` and
up). Every worker has a hostname of its own and shared memory off, so every payload crosses the
TCP payload lane, and a cut breaks the lanes mid-collective (the path of issue 40's partition).
The coordinator is started by the job (``ringserve coordinator`` in its namespace), and the
workers are tests/elastic's numpy worker, with their output in files (a pipe nobody reads fills).

Faults (``inject``), each held for ``HOLD_S`` (past the heartbeat timeout, so that the victim is
declared dead and the others go on without it), then healed:

- **partition**: the victim's namespace blackholes its routes to every peer (``ip route add
  blackhole``): nothing it sends reaches them, so no TCP exchange survives either way, while it
  still reaches the coordinator. The others go on without it; once healed, it rejoins at a commit.
- **partition-one-way**: each peer's namespace blackholes its route to the victim: nothing of
  theirs reaches it, while what it sends still arrives (its acknowledgements do not come back).

Both are measured as the campaign's other faults (the survivors' second step past the fault),
against the target for a partition: the heartbeat timeout plus 2 s. The victim's own records do
not count (it is in ``run.faults``): it commits in its old view until it learns it was dropped.

Needs root and iproute2; without them ``available()`` is False and the campaign leaves the job out.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "elastic"))

import harness  # noqa: E402  (the elastic tests' harness: a job's commit log and faults)

from ringserve.launch.elastic import FINISH_GRACE_S  # noqa: E402  (ringserve run's grace after training ends)

NET = "10.214.7"
COORDINATOR = f"{NET}.1"
WORKERS = 4
HEARTBEAT_TIMEOUT_S = 2.0  # as the campaign's other jobs
HOLD_S = HEARTBEAT_TIMEOUT_S + 2.0  # a cut lasts this long: past the heartbeat timeout
PORT = 29400
TOKEN = "chaos-partitions-job-token"  # the job's: its coordinator is off loopback


def available() -> bool:
    """Whether this machine lets the job make its namespaces (root, and the ``ip`` command)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def address(index: int) -> str:
    return f"{NET}.{11 + index}"


class PartitionJob:
    """The job's namespaces, coordinator and workers, as the campaign's ``LiveJob``."""

    def __init__(self, job: object, tmp: Path) -> None:
        steps, pause_s = getattr(job, "steps"), getattr(job, "pause_s")  # noqa: B009 (chaos.Job, not imported: a cycle)
        self.tmp = tmp
        tag = uuid.uuid4().hex[:6]
        self.coordinator_ns = f"rs-cc-{tag}"
        self.worker_ns = [f"rs-cw{i}-{tag}" for i in range(WORKERS)]
        self.cut: list[tuple[str, str]] = []  # (namespace, address) blackholed now
        self.procs: list[subprocess.Popen[bytes]] = []
        self.coordinator: subprocess.Popen[bytes] | None = None
        self._first_finish: float | None = None
        self._make_net(tag)
        try:
            self._start(steps, pause_s, {**(getattr(job, "env", {}) or {})})
        except BaseException:
            self.stop()
            raise

    def _make_net(self, tag: str) -> None:
        c = self.coordinator_ns
        ip("netns", "add", c)
        ip("-n", c, "link", "add", "br0", "type", "bridge")
        ip("-n", c, "addr", "add", f"{COORDINATOR}/24", "dev", "br0")
        ip("-n", c, "link", "set", "br0", "up")
        ip("-n", c, "link", "set", "lo", "up")
        for i, ns in enumerate(self.worker_ns):
            ip("netns", "add", ns)
            outer, inner = f"rsco{i}{tag}", f"rsci{i}{tag}"
            ip("link", "add", outer, "netns", c, "type", "veth", "peer", "name", inner, "netns", ns)
            ip("-n", c, "link", "set", outer, "master", "br0")
            ip("-n", c, "link", "set", outer, "up")
            ip("-n", ns, "addr", "add", f"{address(i)}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def _start(self, steps: int, pause_s: float, env: dict[str, str]) -> None:
        log = self.tmp / "commits.jsonl"
        coordinator_log = self.tmp / "coordinator.log"
        secured = {**os.environ, "RINGSERVE_TOKEN": TOKEN}  # off loopback: the job's token (secure by default)
        with coordinator_log.open("wb") as out:
            self.coordinator = subprocess.Popen(
                ["ip", "netns", "exec", self.coordinator_ns, sys.executable, "-m", "ringserve.cli", "coordinator",
                 "--host", COORDINATOR, "--port", str(PORT), "--min-workers", "2", "--settle-seconds", "0.5",
                 "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)], stdout=out, stderr=subprocess.STDOUT, env=secured)
        deadline = time.time() + 30
        while "listening on" not in coordinator_log.read_text():
            if time.time() > deadline or self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator did not start: {coordinator_log.read_text()[-2000:]}")
            time.sleep(0.05)
        common = {**secured, "RINGSERVE_COORDINATOR": f"{COORDINATOR}:{PORT}", "RINGSERVE_ELASTIC_TIMEOUT_S": "60",
                  "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60", "RINGSERVE_RPC_TIMEOUT_S": "1", "PYTHONUNBUFFERED": "1",
                  "RINGSERVE_SHARED_MEMORY": "0", "ELASTIC_LOG_TIMES": "1", **env}
        common.pop("RINGSERVE_HOSTNAME", None)
        for i, ns in enumerate(self.worker_ns):
            with (self.tmp / f"worker-{i}.log").open("wb") as out:
                # `ip netns exec` execs the command: the process's pid is the worker's.
                self.procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, harness.WORKER, str(log), str(steps), str(pause_s)],
                    env={**common, "RINGSERVE_BIND_HOST": address(i), "RINGSERVE_HOSTNAME": f"host-{i}",
                         "RINGSERVE_RANK_HINT": str(i)},
                    stdout=out, stderr=subprocess.STDOUT))
        self.run = harness.Run(log=log, launcher=self.procs[0])

    def workers(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def inject(self, kind: str, rng: random.Random) -> str | None:
        if kind not in ("partition", "partition-one-way"):
            return None
        alive = [i for i, p in enumerate(self.procs) if p.poll() is None]
        victim = rng.choice(alive)
        peers = [i for i in range(WORKERS) if i != victim]
        if kind == "partition":
            self.cut = [(self.worker_ns[victim], address(i)) for i in peers]
            what = f"routes from worker {self.procs[victim].pid} to its {len(peers)} peers blackholed"
        else:
            self.cut = [(self.worker_ns[i], address(victim)) for i in peers]
            what = f"routes from its {len(peers)} peers to worker {self.procs[victim].pid} blackholed (one way)"
        self.run.faults.append((time.time(), kind, self.procs[victim].pid))
        for ns, to in self.cut:
            ip("-n", ns, "route", "add", "blackhole", f"{to}/32")
        time.sleep(HOLD_S + rng.uniform(0.0, 1.0))
        self.heal()
        return f"{what} for {HOLD_S:g} s or more, then healed"

    def heal(self) -> None:
        for ns, to in self.cut:
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                ip("-n", ns, "route", "del", "blackhole", f"{to}/32")
        self.cut = []

    def finish(self, timeout_s: float) -> tuple[int | None, str, bool]:
        """Waits for every worker to end: (the exit code furthest from 0, their output, hung).

        As ``ringserve run`` does (launch/elastic.py, FINISH_GRACE_S): once a worker finished with
        0, training is over, and a worker still waiting to join then (a victim held out of
        admission after its cuts, ringcheck.hold_s, while the others trained to the end) gets the
        grace, then SIGTERM, which it answers by leaving; that is no failure of the job."""
        hung = False
        deadline = time.time() + timeout_s
        stopped: set[int] = set()
        while any(p.poll() is None for p in self.procs) and time.time() < deadline:
            finished = [p for p in self.procs if p.returncode == 0]
            if finished and time.time() - self._finished_at(finished) > FINISH_GRACE_S:
                for proc in self.procs:
                    if proc.poll() is None:
                        proc.terminate()
                        stopped.add(proc.pid)
            time.sleep(0.1)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                hung = True
        outs = [(self.tmp / f"worker-{i}.log").read_text(errors="replace") for i in range(len(self.procs))]
        codes = [p.returncode for p in self.procs if p.pid not in stopped]
        outs += [f"worker {pid}: still waiting to join {FINISH_GRACE_S:g} s after training finished; stopped, "
                 "as ringserve run stops it\n" for pid in sorted(stopped)]
        self.stop()
        return max(codes, key=abs), "".join(outs), hung

    def _finished_at(self, finished: list[subprocess.Popen[bytes]]) -> float:
        """When this wait first saw a worker that had finished (the grace counts from then)."""
        if self._first_finish is None:
            self._first_finish = time.time()
        return self._first_finish

    def stop(self) -> None:
        self.heal()
        for proc in [*self.procs, self.coordinator]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for ns in [self.coordinator_ns, *self.worker_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def start(job: object, tmp: Path) -> PartitionJob:
    """The campaign's hook (``Job(..., start=start)``): a running partition job in ``tmp``."""
    return PartitionJob(job, tmp)
