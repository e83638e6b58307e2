"""The chaos campaign's parameter-server job: four workers train through two shards in ``ssp`` mode.

    Job("ps-ssp", ps.WORKER, {}, ("kill", "shard-kill"), steps=600, start=ps.start)

``start`` runs the job as a user would: ``ringserve run --ps 2 -np 4 --restart-failed`` with
``RINGSERVE_CHECKPOINT_DIR`` set, so that the launcher runs a coordinator, two shard processes
(its ``ParameterServer``, which starts a shard process that exits again with its index) and four
workers (``ps_worker.py``: ssp with staleness ``STALENESS``, SGD on the shards). Each shard writes
a checkpoint every ``CHECKPOINT_UPDATES`` updates; a restarted one resumes from its newest, and
the workers wait for it meanwhile (``shard_wait_s``), then tell it their clocks.

Faults:

- **kill** (the campaign's): SIGKILL of a worker. ssp never waits for it beyond the staleness
  bound; the coordinator's next view (within the heartbeat timeout) drops it from the gate, and
  ``--restart-failed`` starts it again: it joins at a push of rank 0's and starts at the slowest
  member's clock.
- **shard-kill** (this job's): SIGKILL of one shard process, recorded in ``run.faults``. The
  launcher's shard supervisor starts it again under the same shard id (a new incarnation); its
  updates since the last checkpoint are lost and counted, not hidden.

What the records mean (see ps_worker.py): under ssp the workers' values legitimately differ at a
step, so the per-step records (in the coordinator's view, at the worker's clock) mark progress and
hold no replica hash; the records that must agree are the final ones, one per worker that
finished, at (view 0, step ``steps``), holding the sha256 of the values pulled once every member
pushed every step.

The campaign's "steps lost" (the furthest step recorded before a fault, less the lowest recorded
after it) reads up to ``STALENESS`` here with nothing lost: ssp lets the slowest member's clock
trail the fastest by that much, and a worker's clock never goes back. What a shard's restart
loses is updates, which the shards count and log ("came back at version V, and workers had seen
version W ...: N updates lost"). ``PS_STALENESS=0`` in the job's env keeps the records in step.

``workers()`` tells the two kinds of the launcher's children apart by their command line (a
shard runs ``ringserve.cli ps --one-shard``), so the campaign's kills hit workers only.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "elastic"))

import harness  # noqa: E402  (the elastic tests' harness: a job's commit log and faults)

WORKER = str(Path(__file__).with_name("ps_worker.py"))
WORKERS = 4
SHARDS = 2
STALENESS = 2
CHECKPOINT_UPDATES = 20  # per shard: a killed shard loses at most this many updates
HEARTBEAT_TIMEOUT_S = 2.0  # as the campaign's other jobs: a killed worker leaves the gate within it
MAX_RESTARTS = 100  # workers; the launcher's shard supervisor allows its own 10
SHARD_WAIT_S = 10.0  # a shard-kill waits this long at most for a shard process to kill
STOP_GRACE_S = 15.0  # SIGTERM to the launcher stops workers and shards (they checkpoint) within it
ENV = {
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "RINGSERVE_CHECKPOINT_UPDATES": str(CHECKPOINT_UPDATES),
    "RINGSERVE_ELASTIC_TIMEOUT_S": "60",
    "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60",
    # A wait on a shard or on the slowest worker that outlasts these is a hang, not a recovery.
    "RINGSERVE_ROUND_TIMEOUT_S": "60",
    "RINGSERVE_SHARD_WAIT_S": "60",
    "PS_STALENESS": str(STALENESS),
}


def is_shard(pid: int) -> bool:
    """Whether ``pid`` is a shard process (``ringserve.cli ps --one-shard``)."""
    try:
        return b"--one-shard" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


class ParameterServerJob:
    """``ringserve run --ps`` with its shards and workers, as the campaign's ``LiveJob``."""

    def __init__(self, job: object, tmp: Path) -> None:
        steps, pause_s = getattr(job, "steps"), getattr(job, "pause_s")  # noqa: B009 (chaos.Job, not imported: a cycle)
        worker = getattr(job, "worker", "") or WORKER
        log = tmp / "commits.jsonl"
        env = {**os.environ, **ENV, **(getattr(job, "env", {}) or {}), "RINGSERVE_CHECKPOINT_DIR": str(tmp / "ckpt")}
        env.pop("RINGSERVE_COORDINATOR", None)  # the launcher's own coordinator, not an inherited one
        cmd = [sys.executable, "-m", "ringserve.cli", "run", "--ps", str(SHARDS), "-np", str(WORKERS),
               "--min-np", "1", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
               "--restart-failed", "--max-restarts", str(MAX_RESTARTS),
               "--", sys.executable, worker, str(log), str(steps), str(pause_s)]
        launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.run = harness.Run(log=log, launcher=launcher)
        self.run.follow()  # the launcher, its shards and workers share the pipe: read it as it comes

    def _children(self) -> list[int]:
        """The launcher's children, workers and shards. Every thread's: /proc's ``children`` lists
        a thread's own, and the shard supervisor's thread starts the restarted shards (harness.Run's
        ``workers()`` reads the main thread's only)."""
        pids: list[int] = []
        for task in Path(f"/proc/{self.run.launcher.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
        return sorted(set(pids))

    def workers(self) -> list[int]:
        """The training processes (the launcher's children that are not shards)."""
        return [pid for pid in self._children() if not is_shard(pid)]

    def shards(self) -> list[int]:
        """The shard processes running now."""
        return [pid for pid in self._children() if is_shard(pid)]

    def inject(self, kind: str, rng: random.Random) -> str | None:
        if kind != "shard-kill":
            return None
        deadline = time.time() + SHARD_WAIT_S
        while not (shards := self.shards()) and time.time() < deadline and self.run.launcher.poll() is None:
            time.sleep(0.05)  # between a shard's death and its restart, the supervisor's poll
        if not shards:
            return f"shard kill skipped: no shard process running within {SHARD_WAIT_S:g} s"
        victim = rng.choice(shards)
        self.run.signal("shard-kill", signal.SIGKILL, victim)
        return f"SIGKILL of shard process {victim}"

    def finish(self, timeout_s: float) -> tuple[int | None, str, bool]:
        """Waits for the job's end: (exit code, output, hung). A job that does not end within
        ``timeout_s`` is stopped (SIGTERM to the launcher first, so that its workers, in sessions
        of their own, are stopped too)."""
        try:
            self.run.launcher.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            _, out = self.run.finish(STOP_GRACE_S)
            return None, f"the run hung past {timeout_s:g} s; its output:\n{out}", True
        code, out = self.run.finish(STOP_GRACE_S)
        return code, out, False

    def stop(self) -> None:
        """SIGTERM to the launcher (it stops its workers and shards), then SIGKILL to what is left."""
        launcher = self.run.launcher
        if launcher.poll() is None:
            launcher.terminate()
            try:
                launcher.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
        # Workers run in sessions of their own, and a launcher killed outright leaves them behind:
        # this job's are the processes whose arguments name its log (unique to the job's folder).
        # Shards need nothing: each stops when its launcher is gone.
        log = str(self.run.log).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if log in (entry / "cmdline").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGCONT)
                    os.kill(int(entry.name), signal.SIGKILL)


def start(job: object, tmp: Path) -> ParameterServerJob:
    """The campaign's hook (``Job(..., start=start)``): a running parameter-server job in ``tmp``."""
    return ParameterServerJob(job, tmp)


if __name__ == "__main__":
    # By hand: one job, FAULTS shard kills (0: none) a second or two apart, and what it recorded.
    import json
    import tempfile
    from types import SimpleNamespace

    faults = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    tmp = Path(tempfile.mkdtemp(prefix="ringserve-chaos-ps-"))
    live = start(SimpleNamespace(worker=WORKER, env={}, steps=steps, pause_s=0.03), tmp)
    began = time.time()
    try:
        live.run.wait_for_step(5, 120)
        for n in range(faults):
            time.sleep(random.uniform(1.0, 2.0))
            print(f"fault {n + 1}: {live.inject('shard-kill', random.Random(n))}", flush=True)
        code, out, hung = live.finish(180)
    finally:
        live.stop()
    (tmp / "output.log").write_text(out)
    records = live.run.records()
    final = [r for r in records if r["view"] == 0]
    print(json.dumps({"exit": code, "hung": hung, "seconds": round(time.time() - began, 1), "records": len(records),
                      "final": len(final), "final hashes": len({r["sha"] for r in final}), "logs": str(tmp)}))
