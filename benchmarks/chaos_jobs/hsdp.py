"""The chaos campaign's HSDP job: three replica groups of two ranks, FSDP2 inside each over gloo,
ringserve's fault-tolerant replication across them (ringserve.torch.hsdp).

    Job("hsdp-groups", hsdp.WORKER, {}, ("kill", "group-kill"), steps=300, workers=6, start=hsdp.start)

``start`` runs one coordinator and each group's two ranks as a torchrun of the group would start
them (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, a fresh gloo port each start), and acts as
the groups' launcher, as the docs of ringserve.torch.hsdp ask of one: **when a rank of a group
exits with an error, the rest of the group is stopped and the whole group started again**, under
a new gang, until training is over (a rank finished with 0).

Faults:

- **kill** (the campaign's): SIGKILL of one rank. Its partner's gloo backend fails under it: the
  partner raises ``ReplicaGroupLostError`` and exits, the other groups go on at the next view, and
  the group comes back whole and takes each shard from its counterpart in a healthy group.
- **group-kill** (this job's): SIGKILL of both ranks of one group in the same millisecond, the
  fault that HSDP's replication is for.

Every rank records each commit with the sha256 of its group's full parameters (hsdp_rank.py),
so the campaign's checks hold across groups: one hash per (view, step), none lost, one at the end.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "elastic"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402  (the elastic tests' harness: a job's commit log and faults)
from _common import free_port  # noqa: E402

from ringserve.launch.elastic import FINISH_GRACE_S  # noqa: E402  (ringserve run's grace after training ends)

WORKER = str(Path(__file__).with_name("hsdp_rank.py"))
GROUPS = 3
GROUP_SIZE = 2
HEARTBEAT_TIMEOUT_S = 2.0  # as the campaign's other jobs
RESTART_AFTER_S = 0.5  # a launcher's pause before it starts a failed group again
# Two groups at least, as the other jobs' --min-np 2 of 4: the faults take one group at a time, and
# a group restarted just as the others finish training must not form a world of its own, which
# would find every holder of the last commit gone (StateLostError) instead of waiting to be stopped.
MIN_WORKERS = 2 * GROUP_SIZE
POLL_S = 0.05
ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RINGSERVE_ELASTIC_TIMEOUT_S": "60",
       "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60"}


class HSDPJob:
    """A coordinator and ``GROUPS`` replica groups, restarted whole, as the campaign's ``LiveJob``."""

    def __init__(self, job: object, tmp: Path) -> None:
        self.steps, self.pause_s = getattr(job, "steps"), getattr(job, "pause_s")  # noqa: B009 (chaos.Job: a cycle)
        self.tmp = tmp
        self.env = {**os.environ, **ENV, **(getattr(job, "env", {}) or {})}
        self.env.pop("RINGSERVE_COORDINATOR", None)
        out = tmp / "coordinator.log"
        with out.open("wb") as sink:
            self.coordinator = subprocess.Popen(
                [sys.executable, "-m", "ringserve.cli", "coordinator", "--port", "0", "--min-workers", str(MIN_WORKERS),
                 "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)], stdout=sink, stderr=subprocess.STDOUT, env=self.env)
        self.address = self._listening(out, 60.0)
        self.run = harness.Run(log=tmp / "commits.jsonl", launcher=self.coordinator)
        self.groups: dict[str, list[subprocess.Popen[bytes]]] = {}
        self.starts: dict[str, int] = {}
        self.logs: list[Path] = [out]
        self.finished_at: float | None = None  # when a rank first finished training (exit 0)
        self.stopped: set[int] = set()  # pids stopped after training ended (waiting to join): no failure
        self._lock = threading.Lock()
        self._ended = threading.Event()
        for g in range(GROUPS):
            self._start_group(f"g{g}")
        self._supervisor = threading.Thread(target=self._supervise, name="hsdp-job-launcher", daemon=True)
        self._supervisor.start()

    def _listening(self, out: Path, timeout_s: float) -> str:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            text = out.read_text(errors="replace")
            if "listening on " in text:
                return text.split("listening on ", 1)[1].split()[0]
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited with {self.coordinator.returncode}: {text[-2000:]}")
            time.sleep(POLL_S)
        raise RuntimeError(f"the coordinator did not listen within {timeout_s:g} s")

    def _start_group(self, name: str) -> None:
        start = self.starts[name] = self.starts.get(name, -1) + 1
        port, procs = free_port(), []
        for rank in range(GROUP_SIZE):
            env = {**self.env, "RANK": str(rank), "WORLD_SIZE": str(GROUP_SIZE), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "RINGSERVE_HSDP_GROUP": name, "RINGSERVE_COORDINATOR": self.address}
            path = self.tmp / f"{name}.{start}-{rank}.log"
            self.logs.append(path)
            with path.open("wb") as sink:
                procs.append(subprocess.Popen([sys.executable, WORKER, str(self.run.log), str(self.steps),
                                               str(self.pause_s)], env=env, stdout=sink, stderr=subprocess.STDOUT))
        self.groups[name] = procs

    def _supervise(self) -> None:
        """The groups' launcher: a group with a rank that failed is stopped and started again whole,
        until training is over; then those still running get FINISH_GRACE_S, then SIGTERM."""
        while not self._ended.is_set():
            failed = []
            with self._lock:
                for name, procs in self.groups.items():
                    codes = [p.poll() for p in procs]
                    if 0 in codes and self.finished_at is None:
                        self.finished_at = time.time()
                    if any(c not in (None, 0) for c in codes) and self.finished_at is None:
                        for p in procs:
                            if p.poll() is None:
                                p.kill()
                                p.wait()
                        failed.append(name)
            if failed:  # the pause before a restart holds no lock: faults and polls go on meanwhile
                time.sleep(RESTART_AFTER_S)
            with self._lock:
                for name in failed:
                    if self.finished_at is None:
                        self._start_group(name)
                if self.finished_at is not None and time.time() - self.finished_at > FINISH_GRACE_S:
                    for p in self.live():
                        self.stopped.add(p.pid)
                        p.terminate()
            time.sleep(POLL_S)

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for procs in self.groups.values() for p in procs if p.poll() is None]

    def workers(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self.live()]

    def inject(self, kind: str, rng: random.Random) -> str | None:
        if kind != "group-kill":
            return None
        with self._lock:
            whole = [name for name, procs in self.groups.items() if all(p.poll() is None for p in procs)]
            if not whole:
                return "group kill skipped: no group has every rank running"
            name = rng.choice(whole)
            pids = [p.pid for p in self.groups[name]]
            harness.kill_together(self.run, pids)
        return f"SIGKILL of group {name}'s {len(pids)} ranks ({', '.join(map(str, pids))}) in the same millisecond"

    def finish(self, timeout_s: float) -> tuple[int | None, str, bool]:
        """Waits for every group's last start to end: (the exit code furthest from 0 among them,
        every process's output, hung). Ranks stopped after training ended (waiting to join) and
        the earlier starts of a group (killed, or ended by its partner's death) do not count."""
        deadline = time.time() + timeout_s
        hung = False
        while time.time() < deadline:
            with self._lock:
                if not self.live() and (self.finished_at is not None or not self.groups):
                    break
            time.sleep(0.1)
        else:
            hung = True
        self._ended.set()
        self._supervisor.join(10)
        with self._lock:
            last = [p for procs in self.groups.values() for p in procs]
        for p in last:
            if p.poll() is None:
                p.kill()
                p.wait()
                hung = True
        codes = [p.returncode for p in last if p.pid not in self.stopped]
        outs = [path.read_text(errors="replace") for path in self.logs if path.exists()]
        outs += [f"rank {pid}: still waiting to join {FINISH_GRACE_S:g} s after training finished; stopped, as a "
                 "launcher stops it\n" for pid in sorted(self.stopped)]
        return max(codes, key=abs, default=None), "".join(outs), hung

    def stop(self) -> None:
        self._ended.set()
        with self._lock:
            procs = [p for procs in self.groups.values() for p in procs]
        for p in [*procs, self.coordinator]:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()


def start(job: object, tmp: Path) -> HSDPJob:
    """The campaign's hook (``Job(..., start=start)``): a running HSDP job in ``tmp``."""
    return HSDPJob(job, tmp)
