"""The chaos campaign's torchrun job: DDP on the ringserve backend under torchrun's elastic agent.

    Job("ddp-torchrun", ddp.WORKER, {}, KILLS, steps=300, start=ddp.start)

``start`` launches ``python -m torch.distributed.run`` with four workers on one node, a c10d
rendezvous on a free loopback port and ``--max-restarts`` of ``MAX_RESTARTS``; each worker runs
``ddp_worker.py`` (DistributedDataParallel over ``init_process_group("ringserve")``, where rank 0
starts the job's coordinator). The workers are the agent's children; the job injects no faults of
its own, and every one of the campaign's ends in a restart of the whole group:

- **kill**, **kill-pair**: the agent sees a worker exit within its monitor interval (0.1 s),
  stops the others and starts all four again; they resume from rank 0's checkpoint, in a new view
  (the restart count).
- **stop**: past the heartbeat timeout the coordinator drops the stopped worker, the others'
  collectives fail (``RingChangedError`` inside ``DistBackendError``), they exit and the agent
  restarts the group. A stopped rank 0 stops the coordinator too: on SIGCONT it finds every worker
  silent past the timeout and drops them all at once, with the same end.

So recovery is the start of four torch processes (imports, DDP's first construction, ringserve's
rendezvous), not ringserve's failover: seconds to tens of seconds on a loaded 2-core machine.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "elastic"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402  (the elastic tests' harness: a job's commit log and faults)
from _common import free_port  # noqa: E402

if TYPE_CHECKING:
    from chaos import Job  # chaos.py imports this module: for the annotations only

WORKER = str(Path(__file__).with_name("ddp_worker.py"))
NPROC = 4
MAX_RESTARTS = 100
# The workers' environment. The heartbeat timeout of the coordinator rank 0 starts is the
# campaign's (chaos.HEARTBEAT_TIMEOUT_S), so a worker stopped past it is dropped, its peers'
# collectives fail and the agent restarts the group; the collective timeout bounds an op that
# nothing else ends.
WORKER_ENV = {
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "RINGSERVE_HEARTBEAT_TIMEOUT_S": "2",
    "RINGSERVE_COLLECTIVE_TIMEOUT_S": "30",
    "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60",
}


class TorchrunJob:
    """A torchrun agent and its workers, as the campaign's ``LiveJob``."""

    def __init__(self, job: Job, tmp: Path, *, checkpoint_every: int = 1) -> None:
        script = job.worker or WORKER
        self.script, self.log = Path(script).name, tmp / "commits.jsonl"
        checkpoints = tmp / "ckpt"
        checkpoints.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **WORKER_ENV, **job.env,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        # Rank 0 starts the coordinator under torchrun; one inherited from a ringserve launcher
        # would make every rank join that one instead.
        env.pop("RINGSERVE_COORDINATOR", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", f"--nproc-per-node={NPROC}",
               f"--max-restarts={MAX_RESTARTS}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               # MASTER_ADDR for the workers: loopback, so ringserve binds loopback too (a host
               # that is not loopback makes it bind every interface).
               "--local-addr=127.0.0.1", "--monitor-interval=0.1",
               script, str(self.log), str(job.steps), str(job.pause_s), str(checkpoints), str(checkpoint_every)]
        launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.run = harness.Run(log=self.log, launcher=launcher)
        self.run.follow()  # torchrun and four workers share the pipe: read it as it comes

    def workers(self) -> list[int]:
        """The training processes: the agent's children that run the worker script."""
        return [pid for pid in self.run.workers() if self._ours(pid)]

    def _ours(self, pid: int) -> bool:
        """Whether ``pid`` is one of this job's workers (by its command line: pids are reused)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        return self.script in cmdline and str(self.log) in cmdline

    def inject(self, kind: str, rng: random.Random) -> str | None:
        return None  # only the campaign's kills and stops

    def finish(self, timeout_s: float) -> tuple[int | None, str, bool]:
        """Waits for the agent's end: (exit code, output, hung). A job that runs past
        ``timeout_s`` is stopped, its workers with it (harness.Run.finish would kill the agent alone)."""
        hung = False
        try:
            self.run.launcher.wait(timeout_s)
        except subprocess.TimeoutExpired:
            hung = True
            self.stop()
        if self.run.reader is not None:
            self.run.reader.join(10)
        return (None if hung else self.run.launcher.returncode), "".join(self.run.lines), hung

    def stop(self) -> None:
        """Kills the agent and every worker left. torchrun starts each worker in a session of its
        own, so they outlive a killed agent: the agent is stopped first (it starts no more), then
        its workers and any the log names that still run are killed, then the agent."""
        launcher = self.run.launcher
        if launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(launcher.pid, signal.SIGSTOP)
        pids = set(self.run.workers()) | {r["pid"] for r in self.run.records()}
        for pid in pids:
            if self._ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            with contextlib.suppress(ProcessLookupError):
                os.kill(launcher.pid, signal.SIGCONT)
        launcher.wait()


def start(job: Job, tmp: Path) -> TorchrunJob:
    """The campaign's hook (``Job(..., start=start)``): a running torchrun job in ``tmp``."""
    return TorchrunJob(job, tmp)
