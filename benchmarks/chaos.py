"""The chaos campaign: a seeded, replayable schedule of faults against live elastic jobs.

    .venv/bin/python benchmarks/chaos.py --faults 300 --seed 1          # the full campaign
    .venv/bin/python benchmarks/chaos.py --faults 10 --seed 1 --quick   # the default suite's

Each job trains under ``ringserve run -np 4 --min-np 2 --restart-failed`` (or, for coordinator
restarts, with a coordinator of its own that the campaign kills and starts again on its port),
with the workers of tests/elastic: every commit appends ``{pid, time, view, step, sha}`` to the
job's log, sha being the sha256 of that replica's parameters. The jobs cover shared memory and the
TCP payload lane (a hostname per worker, shared memory off), ``ring`` and ``auto``, numpy, the
torch ``DistributedOptimizer`` (committing with copies, and in place) and DiLoCo (two fragments, so a kill lands mid-fragment), the
parameter server under ssp (chaos_jobs/ps.py), DDP under torchrun (chaos_jobs/ddp.py),
partitions between hosts in network namespaces (chaos_jobs/partitions.py), and fault-tolerant HSDP,
whole replica groups killed (chaos_jobs/hsdp.py). The
schedule is drawn from ``--seed`` alone: the same seed gives the same jobs, faults, victims (by
launch index) and gaps, and each fault is printed as it is injected.

A fault is injected once the one before has recovered (or its bound has passed: then it counts as
unrecovered) and the world is whole again (restarted workers are in), after a gap drawn from the
schedule. For each fault the campaign records:

- **recovery**: seconds from the fault until two workers (not its victims) have committed the
  second step beyond the furthest step committed before it (see ``recovered_at``);
- **steps lost**: committed steps that the job had to commit again (a resume from a durable copy);
- **hang**: no recovery within the fault's bound, or a job that did not end within its bound;
- **untyped**: tracebacks in the workers' output whose exception is not a ringserve error (a bare
  CancelledError, a KeyError, ...), or a worker that died of anything but the campaign's fault;
- **divergent**: a (view, step) committed with two different parameter hashes;
- and, per job, whether it finished with one final hash on every rank that reached the last step.

The bounds: a kill recovers within ``KILL_BOUND_S`` (the target, p99 <= 2 s); a stopped (SIGSTOP)
worker or a coordinator restart within the heartbeat timeout and the coordinator's grace plus 2 s,
as a partition. A fault
that recovers later than its target is counted as slow; one that never recovers within
``UNRECOVERED_S`` as unrecovered.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "elastic"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402  (the elastic tests' harness: the jobs and their records)
from _common import free_port, table  # noqa: E402
from chaos_jobs import ddp as chaos_ddp  # noqa: E402
from chaos_jobs import hsdp as chaos_hsdp  # noqa: E402
from chaos_jobs import partitions as chaos_partitions  # noqa: E402
from chaos_jobs import ps as chaos_ps  # noqa: E402

HEARTBEAT_TIMEOUT_S = 2.0
KILL_BOUND_S = 2.0  # the target for kills
# The coordinator's default grace (heartbeat_grace_s): a worker is declared dead for silence only
# past the timeout and the grace, whoever reports it, so that a stall (SIGSTOP for 3 s, a starved
# process) is not a death. A hung worker's recovery is bounded by both.
GRACE_S = 2.0
STALL_BOUND_S = HEARTBEAT_TIMEOUT_S + GRACE_S + 2.0  # the target for a hung worker, a partition, a coordinator restart
UNRECOVERED_S = 60.0  # past this a fault is unrecovered (and the job is taken as hung)
# torchrun's elastic agent answers any fault by restarting every worker: a recovery there is four
# fresh torch processes, whose imports alone (torch, and the ~800 modules DDP's constructor pulls
# in) take 10 to 30 s of a loaded 2-core machine, as they do under gloo. Its faults are counted
# in rows of their own, against these bounds, not the kill's 2 s.
GROUP_RESTART_BOUND_S = 60.0
GROUP_UNRECOVERED_S = 120.0
JOB_END_S = 180.0  # a job must end this long after its last fault recovered

DILOCO = str(ROOT / "tests" / "elastic" / "diloco_worker.py")


@dataclasses.dataclass(frozen=True)
class Job:
    """One kind of live job: its worker, its environment, and the faults that apply to it."""

    name: str
    worker: str
    env: dict[str, str]
    faults: tuple[str, ...]
    steps: int = 500
    workers: int = 4
    # How far apart the workers' steps may legitimately be (ssp's staleness): a commit this far
    # below the furthest step after a fault is not a lost one.
    spread: int = 0
    # Its launcher restarts every worker after any fault (torchrun): see GROUP_RESTART_BOUND_S.
    restarts_group: bool = False

    @property
    def unrecovered_s(self) -> float:
        return GROUP_UNRECOVERED_S if self.restarts_group else UNRECOVERED_S
    pause_s: float = 0.03
    lane: bool = False  # a hostname per worker, shared memory off: payloads cross the TCP lane
    standalone: bool = False  # a coordinator of its own, which the campaign restarts
    # A job that runs otherwise (torchrun, parameter-server shards): makes its live job, which
    # has Live's interface (run, workers, finish, stop) and injects its own kinds of fault.
    start: Callable[[Job, Path], LiveJob] | None = None


class LiveJob(Protocol):
    """What the campaign asks of a running job (``Live`` is one)."""

    run: harness.Run  # its commit log, its faults so far, and its launcher

    def workers(self) -> list[int]: ...

    def inject(self, kind: str, rng: random.Random) -> str | None:
        """Injects a fault of a kind the campaign does not know; returns what it did (None: not
        one of this job's kinds)."""
        ...

    def finish(self, timeout_s: float) -> tuple[int | None, str, bool]: ...

    def stop(self) -> None: ...


KILLS = ("kill", "kill-pair", "stop")
JOBS = [
    Job("numpy-shm-ring", harness.WORKER, {"RINGSERVE_ALGORITHM": "ring"}, KILLS),
    Job("numpy-lane-auto", harness.WORKER, {"RINGSERVE_ALGORITHM": "auto"}, (*KILLS, "lane-reset"), lane=True),
    Job("torch-shm-auto", harness.TORCH_WORKER, {"RINGSERVE_ALGORITHM": "auto"}, KILLS, steps=300),
    Job("torch-lane-ring", harness.TORCH_WORKER, {"RINGSERVE_ALGORITHM": "ring"}, (*KILLS, "lane-reset"),
        steps=300, lane=True),
    # Commits in place (no copy of the parameters and moments): the survivors' live tensors are the commit.
    Job("torch-shm-in-place", harness.TORCH_WORKER, {"RINGSERVE_COMMIT_IN_PLACE": "1"}, KILLS, steps=300),
    # Two fragments, each synced one step late, and a commit every step: a kill lands mid-fragment.
    Job("diloco-shm", DILOCO, {"DILOCO_FRAGMENTS": "2", "DILOCO_SYNC_EVERY": "4", "DILOCO_DELAY": "1",
                               "DILOCO_COMMIT": "step"}, ("kill", "kill-pair"), steps=300),
    Job("numpy-coordinator", harness.WORKER, {}, ("coordinator",), standalone=True),
    # ssp with staleness 2 through two shard processes under `ringserve run --ps 2`.
    Job("ps-ssp", chaos_ps.WORKER, {}, ("kill", "shard-kill"), steps=600, spread=2, start=chaos_ps.start),
    # DDP on the ringserve backend under torchrun's elastic agent, resuming from a checkpoint.
    Job("ddp-torchrun", chaos_ddp.WORKER, {}, KILLS, steps=300, start=chaos_ddp.start, restarts_group=True),
    # A host per worker in network namespaces of the job's own, payloads on the TCP lane: cuts.
    Job("numpy-netns-lane", harness.WORKER, {"RINGSERVE_ALGORITHM": "auto"}, ("partition", "partition-one-way"),
        start=chaos_partitions.start),
    # Fault-tolerant HSDP: three replica groups of two ranks (FSDP2 over gloo inside, ringserve across),
    # a group restarted whole when a rank of it dies; whole groups killed at once.
    Job("hsdp-groups", chaos_hsdp.WORKER, {}, ("kill", "group-kill"), steps=300, workers=6, start=chaos_hsdp.start),
]
# Jobs this machine cannot run (no root or no iproute2 for namespaces), left out with a line that says so.
UNAVAILABLE = {} if chaos_partitions.available() else {"numpy-netns-lane": "needs root and iproute2 (ip netns)"}
QUICK = ["numpy-shm-ring", "numpy-lane-auto"]


@dataclasses.dataclass
class Outcome:
    job: str
    run: int
    kind: str
    at: float
    recovery_s: float | None = None
    steps_lost: int = 0
    group: bool = False  # the job restarts every worker after a fault (Job.restarts_group)

    @property
    def label(self) -> str:
        return f"{self.kind} (group restart)" if self.group else self.kind

    @property
    def bound_s(self) -> float:
        if self.group:
            return GROUP_RESTART_BOUND_S
        return KILL_BOUND_S if self.kind.startswith("kill") or self.kind in ("lane-reset", "group-kill") else STALL_BOUND_S


@dataclasses.dataclass
class JobResult:
    job: str
    run: int
    code: int | None
    hung: bool
    untyped: list[str]
    divergent: int
    final_hashes: int
    faults: list[Outcome]
    seconds: float


class Live:
    """A running job: ``ringserve run``'s children, or workers of a coordinator of its own."""

    def __init__(self, job: Job, tmp: Path) -> None:
        self.job, self.tmp = job, tmp
        self.log = tmp / "commits.jsonl"
        env = {**job.env, "PYTHONUNBUFFERED": "1", "RINGSERVE_CHECKPOINT_DIR": str(tmp / "ckpt")}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.port = 0
        if job.standalone:
            self.port = free_port()
            # Every incarnation's log, one after another, kept with the job's.
            self._coordinator_log = (tmp / "coordinator.log").open("ab")
            # Files, not pipes: a pipe read only at the end fills up, and a worker whose log write
            # blocks on it stops its event loop (heartbeats included) and is declared dead.
            self.outputs = [tmp / f"worker-{i}.log" for i in range(job.workers)]
            self.coordinator = self._start_coordinator()
            self.procs = [harness.start_worker(f"127.0.0.1:{self.port}", self.log, job.steps, job.pause_s,
                                               worker=job.worker, env={**env, "RINGSERVE_RANK_HINT": str(i), "ELASTIC_LOG_TIMES": "1"},
                                               output=self.outputs[i])
                          for i in range(job.workers)]
            self.run = harness.Run(log=self.log, launcher=self.procs[0])
            return
        if job.lane:
            # A hostname per launch index and a payload port the campaign knows, to reset its sockets.
            env["RINGSERVE_SHARED_MEMORY"] = "0"
            env["CHAOS_LANE"] = "1"
        self.run = harness.start(tmp, workers=job.workers, steps=job.steps, pause_s=job.pause_s,
                                 worker=str(Path(__file__).with_name("chaos_worker.py")),
                                 heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, max_restarts=100,
                                 env={**env, "CHAOS_WORKER": job.worker, "CHAOS_PORTS": str(tmp / "ports")})

    def _start_coordinator(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringserve.cli", "coordinator", "--port", str(self.port), "--min-workers", "2",
             "--settle-seconds", "0.5", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)],
            stdout=self._coordinator_log, stderr=subprocess.STDOUT)
        return proc

    def inject(self, kind: str, rng: random.Random) -> str | None:
        return None

    def workers(self) -> list[int]:
        if self.job.standalone:
            return [p.pid for p in self.procs if p.poll() is None]
        return self.run.workers()

    def lane_port(self, pid: int) -> int | None:
        """The payload port of the worker ``pid`` (chaos_worker.py writes it on start)."""
        path = self.tmp / "ports"
        if not path.exists():
            return None
        for line in path.read_text().splitlines():
            p, port = line.split()
            if int(p) == pid:
                return int(port)
        return None

    def finish(self, timeout_s: float) -> tuple[int | None, str, bool]:
        """Waits for the job's end: (exit code, output, hung)."""
        if not self.job.standalone:
            try:
                code, out = self.run.finish(timeout_s)
                return code, out, False
            except AssertionError as exc:  # its message keeps the output's tail: the job's log keeps all of it
                return None, "".join(self.run.lines) + f"\n{str(exc).splitlines()[0]}\n", True
        outs, codes, hung = [], [], False
        deadline = time.time() + timeout_s
        for proc, output in zip(self.procs, self.outputs, strict=True):
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                hung = True
            outs.append(output.read_text(errors="replace"))
            codes.append(proc.returncode)
        self.stop()
        return max(codes, key=abs), "".join(outs), hung

    def stop(self) -> None:
        for proc in [*getattr(self, "procs", []), self.run.launcher, self.coordinator]:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()


def inject(live: LiveJob, kind: str, rng: random.Random) -> str:
    """Injects one fault of ``kind``; returns what it did, for the printed schedule."""
    own = live.inject(kind, rng)
    if own is not None:
        return own
    pids = sorted(live.workers())
    if kind == "coordinator":
        assert isinstance(live, Live) and live.coordinator is not None
        live.coordinator.kill()
        live.coordinator.wait()
        live.run.faults.append((time.time(), kind, live.coordinator.pid))
        time.sleep(rng.uniform(0.2, 1.0))
        live.coordinator = live._start_coordinator()
        return "coordinator killed and started again on its port"
    if kind == "kill-pair" and len(pids) >= 2:
        pair = rng.sample(pids, 2)
        harness.kill_together(live.run, pair)
        return f"SIGKILL of {pair[0]} and {pair[1]} in the same millisecond"
    victim = rng.choice(pids)
    if kind in ("kill", "kill-pair"):
        live.run.signal("kill -9", signal.SIGKILL, victim)
        return f"SIGKILL of {victim}"
    if kind == "stop":
        live.run.signal("SIGSTOP", signal.SIGSTOP, victim)
        time.sleep(HEARTBEAT_TIMEOUT_S + rng.uniform(0.2, 1.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
        return f"SIGSTOP of {victim}, SIGCONT after the heartbeat timeout"
    if kind == "lane-reset":
        assert isinstance(live, Live)
        port = live.lane_port(victim)
        if port is None:
            return "lane reset skipped: no payload port known"
        live.run.faults.append((time.time(), kind, victim))
        # ss -K resets every TCP socket of that port, both ways (the kernel sends RSTs): the lanes
        # into that worker break mid-collective, as a middlebox that resets a connection would.
        subprocess.run(["ss", "-K", "-t", f"( sport = :{port} or dport = :{port} )"], capture_output=True, timeout=10)
        return f"TCP reset of the payload lanes into {victim} (port {port})"
    raise ValueError(f"unknown fault {kind!r}")


def dump_stacks(live: LiveJob) -> None:
    """Makes every worker of a hung job print its threads' stacks into the job's output (the
    workers register SIGUSR1 with faulthandler: tests/elastic/commit_log.py)."""
    for pid in live.workers():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)


def furthest_step(records: list[dict], before: float) -> int:
    steps = [r["step"] for r in records if r["time"] <= before]
    return max(steps) if steps else 0


def await_recovery(live: LiveJob, outcome: Outcome, job: Job) -> None:
    """Waits (up to the job's unrecovered_s) for the job to commit past the fault: see ``recovered_at``."""
    records = live.run.records()
    before = furthest_step(records, outcome.at)
    deadline = outcome.at + job.unrecovered_s
    while time.time() < deadline:
        records = live.run.records()
        # A stopped worker writes the commit it was in when it runs again: its records do not count.
        victims = {pid for at, _, pid in live.run.faults if at >= outcome.at - 0.01}
        after = [r for r in records if r["time"] > outcome.at and r["pid"] not in victims]
        at = recovered_at(after, before)
        if at is not None:
            outcome.recovery_s = at - outcome.at
            # The survivors may commit again the furthest step (one rank committed it alone before
            # the view broke: harness.check_no_silent_regression); below it, commits were lost.
            outcome.steps_lost = max(0, before - job.spread - min(r["step"] for r in after))
            return
        if before >= job.steps or live.run.launcher.poll() is not None:
            return
        time.sleep(0.05)


def recovered_at(after: list[dict], before: int) -> float | None:
    """When two workers (not the fault's victims) had both committed a step two beyond ``before``,
    the furthest step committed at the fault. A commit's record is written as it is saved, before
    the commit's own collective: the record of step ``before + 1`` may come before that collective
    fails, and only the record of the step after it proves that the world carried a collective
    through after the fault (an overestimate of at most one step). Two, because one rank can
    finish a collective alone before the view breaks."""
    first: dict[int, dict[int, float]] = defaultdict(dict)  # step -> pid -> first record's time
    for r in after:
        if r["step"] > before + 1:
            first[r["step"]].setdefault(r["pid"], r["time"])
    times = [sorted(pids.values())[1] for pids in first.values() if len(pids) >= 2]
    return min(times) if times else None


def await_whole(live: LiveJob, workers: int, timeout_s: float, steps: int) -> bool:
    """Waits until ``workers`` processes commit in the newest view (the killed ones' replacements
    are in): a fault then never takes the world below --min-np, where recovery would wait for a
    new process to start rather than measure ringserve. False at once when training is over (a
    rank committed the job's last step, ``steps``): a victim still waiting to join then never
    will, and the job's ``finish`` gives it its grace and stops it, as ``ringserve run`` does."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        records = live.run.records()
        if records:
            newest = max(r["view"] for r in records)
            if len({r["pid"] for r in records if r["view"] == newest}) >= workers:
                return True
            if max(r["step"] for r in records) >= steps:
                return False
        if live.run.launcher.poll() is not None:
            return False
        time.sleep(0.05)
    return False


# A line may carry ringserve run's "[rank] " or torch.distributed's "[rankN]: " before it.
TRACEBACK_END = re.compile(r"^(?:\[\d+\]\s*|\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)|[\w.]*CancelledError)(?::|$)")
TYPED = re.compile(r"^(ringserve\.errors\.)?(RingserveError|RecoverableError|PeerUnavailableError|RingChangedError|"
                   r"CollectiveTimeoutError|CorruptFrameError|ShardUnavailableError|HostsUpdatedInterrupt|"
                   r"StateLostError|CoordinatorUnreachableError|ExcludedError|RendezvousTimeoutError|"
                   r"GroupMemberFailedError|ReplicaGroupLostError)$")


# torch.distributed's own error for a backend's failure, as gloo's and NCCL's are raised to a DDP
# script, and what torchrun restarts the group on: typed when ringserve's error is its message
# ("ringserve: all_gather failed: RingChangedError: ...", torch/distributed/group.py).
WRAPPED = re.compile(r"ringserve: \w+ failed: (\w+):")


def _wrapped(name: str, line: str) -> bool:
    """Whether a traceback's last line is torch's DistBackendError carrying a typed ringserve error."""
    found = WRAPPED.search(line)
    return name.endswith("DistBackendError") and found is not None and TYPED.match(found.group(1)) is not None


# What Python prints between two tracebacks of one chain: the first is a cause, not what was raised.
CHAINED = ("The above exception was the direct cause of the following exception",
           "During handling of the above exception, another exception occurred")


def _chained_after(lines: list[str]) -> bool:
    """Whether the lines after a traceback's last one carry on its chain (another traceback follows)."""
    for line in lines[:6]:
        text = re.sub(r"^\[(?:rank)?\d+\]:?\s*", "", line.strip())
        if any(text.startswith(c) for c in CHAINED):
            return True
    return False


def untyped_errors(out: str) -> list[str]:
    """The final lines of the output's tracebacks whose exception is not a ringserve error. Of a
    chain (``raise ... from``, or an error while handling another), only the last traceback's
    exception counts: it is what the process raised (an HSDP rank's ReplicaGroupLostError from
    its gloo backend's RuntimeError is typed)."""
    found = []
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line:
            continue
        for j in range(i + 1, min(i + 400, len(lines))):
            end = lines[j]
            m = TRACEBACK_END.match(end.strip())
            if m and not end.strip().startswith("File "):
                if not TYPED.match(m.group(1)) and not _wrapped(m.group(1), end) and not _chained_after(lines[j + 1:]):
                    found.append(end.strip()[:200])
                break
    return found


def run_job(job: Job, index: int, faults: int, rng: random.Random, work: Path, say: Callable[[str], None]) -> JobResult:
    tmp = work / f"{index:03d}-{job.name}"
    tmp.mkdir(parents=True)
    started = time.time()
    live: LiveJob = job.start(job, tmp) if job.start is not None else Live(job, tmp)
    outcomes: list[Outcome] = []
    hung = False
    try:
        try:
            live.run.wait_for_step(5, 120)
        except AssertionError:
            faults = 0  # it never trained: reported by its exit and its (missing) final hash
        for n in range(faults):
            gap = rng.uniform(0.2, 1.0)
            if not await_whole(live, job.workers, job.unrecovered_s, job.steps):
                break
            time.sleep(gap)
            records = live.run.records()
            if furthest_step(records, time.time()) > job.steps * 0.85:
                break
            kind = rng.choice(job.faults)
            outcome = Outcome(job.name, index, kind, time.time(), group=job.restarts_group)
            injected = len(live.run.faults)
            what = inject(live, kind, rng)
            if len(live.run.faults) == injected:  # nothing to inject it into: not a fault
                say(f"  [{job.name} #{index}] fault {n + 1}: {what}")
                continue
            outcome.at = live.run.faults[injected][0]
            await_recovery(live, outcome, job)
            outcomes.append(outcome)
            took = "not recovered" if outcome.recovery_s is None else f"recovered in {outcome.recovery_s:.2f} s"
            say(f"  [{job.name} #{index}] fault {n + 1}: {what}: {took}, steps lost {outcome.steps_lost}")
            if outcome.recovery_s is None and furthest_step(live.run.records(), time.time()) < job.steps:
                hung = True
                dump_stacks(live)
                break
        code, out, job_hung = live.finish(JOB_END_S)
        (tmp / "output.log").write_text(out)
        (tmp / "faults.json").write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1) + "\n")
    finally:
        live.stop()
    records = live.run.records()
    by_view_step: dict[tuple[int, int], set[str]] = defaultdict(set)
    for r in records:
        by_view_step[(r["view"], r["step"])].add(r["sha"])
    final = {r["sha"] for r in records if r["step"] == max((r["step"] for r in records), default=0)}
    untyped = untyped_errors(out)
    for line in out.splitlines():  # a worker that died of something but a campaign's signal
        # 137 (a worker) and -9 (a parameter-server shard): the campaign's SIGKILL.
        if "exited with code" in line and "with code 137;" not in line and "with code -9: starting it again" not in line:
            untyped.append(line.strip()[:200])
    return JobResult(job.name, index, code, hung or job_hung, untyped,
                     sum(1 for v in by_view_step.values() if len(v) > 1), len(final), outcomes, time.time() - started)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def summarize(results: list[JobResult]) -> tuple[list[dict[str, object]], dict[str, int]]:
    rows = []
    kinds = sorted({o.label for r in results for o in r.faults})
    for kind in kinds:
        outs = [o for r in results for o in r.faults if o.label == kind]
        times = [o.recovery_s for o in outs if o.recovery_s is not None]
        rows.append({"kind": kind, "faults": len(outs), "p50": f"{percentile(times, 0.5):.2f}",
                     "p99": f"{percentile(times, 0.99):.2f}", "max": f"{max(times, default=float('nan')):.2f}",
                     "target": f"{outs[0].bound_s:g}", "over": sum(1 for o in outs if o.recovery_s is not None and o.recovery_s > o.bound_s),
                     "unrecovered": sum(1 for o in outs if o.recovery_s is None), "lost": sum(o.steps_lost for o in outs)})
    totals = {
        "faults": sum(len(r.faults) for r in results),
        "hangs": sum(1 for r in results if r.hung),
        "untyped": sum(len(r.untyped) for r in results),
        "divergent": sum(r.divergent for r in results),
        "lost_commits": sum(o.steps_lost for r in results for o in r.faults),
        "unrecovered": sum(1 for r in results for o in r.faults if o.recovery_s is None),
        "jobs": len(results),
        "unfinished_jobs": sum(1 for r in results if r.code != 0 or r.final_hashes != 1),
    }
    return rows, totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=300, help="faults in all (default 300)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--per-job", type=int, default=10, help="faults per job at most")
    parser.add_argument("--jobs", default="", help="comma-separated job names (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, of --steps 250")
    parser.add_argument("--steps", type=int, default=0, help="every job's steps (default: each job's own)")
    parser.add_argument("--kinds", default="", help="comma-separated fault kinds to inject (default: each job's own)")
    parser.add_argument("--json", type=Path, help="write every fault and job here")
    parser.add_argument("--workdir", type=Path, help="keep the jobs' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    names = QUICK if args.quick else [n for n in args.jobs.split(",") if n] or [j.name for j in JOBS]
    jobs = [j for j in JOBS if j.name in names and j.name not in UNAVAILABLE]
    steps = args.steps or (250 if args.quick else 0)
    if steps:
        jobs = [dataclasses.replace(j, steps=steps) for j in jobs]
    if args.kinds:  # a replay of one kind of fault: the jobs that have it, with it alone
        kinds = set(args.kinds.split(","))
        jobs = [dataclasses.replace(j, faults=tuple(k for k in j.faults if k in kinds)) for j in jobs
                if kinds & set(j.faults)]
    rng = random.Random(args.seed)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ringserve-chaos-"))

    def say(line: str) -> None:
        print(line, flush=True)

    for name in names:
        if name in UNAVAILABLE:
            say(f"left out: {name} ({UNAVAILABLE[name]})")
    say(f"chaos campaign: seed {args.seed}, {args.faults} faults over {', '.join(j.name for j in jobs)}; logs in {work}")
    results: list[JobResult] = []
    index = 0
    while sum(len(r.faults) for r in results) < args.faults:
        job = jobs[index % len(jobs)]
        left = args.faults - sum(len(r.faults) for r in results)
        say(f"job {index}: {job.name}")
        result = run_job(job, index, min(args.per_job, left), rng, work, say)
        results.append(result)
        say(f"  [{job.name} #{index}] ended: exit {result.code}, hung {result.hung}, untyped {len(result.untyped)}, "
            f"divergent {result.divergent}, final hashes {result.final_hashes}, {result.seconds:.0f} s")
        for line in result.untyped:
            say(f"    untyped: {line}")
        index += 1
        if not result.faults and index > 2 * len(jobs):
            break  # jobs that end before any fault can be injected would loop forever
    rows, totals = summarize(results)
    say("")
    say(table(rows, [("kind", "fault"), ("faults", "n"), ("p50", "recovery p50 s"), ("p99", "p99 s"), ("max", "max s"),
                     ("target", "target s"), ("over", "over target"), ("unrecovered", "unrecovered"), ("lost", "steps lost")]))
    say("")
    say(" ".join(f"{k}={v}" for k, v in totals.items()))
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "totals": totals, "rows": rows,
                                         "jobs": [dataclasses.asdict(r) for r in results]}, indent=1) + "\n")
    bad = sum(totals[k] for k in ("hangs", "untyped", "divergent", "lost_commits", "unrecovered", "unfinished_jobs"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
