"""ringserve's elastic training against torchft, with plain DDP over gloo as the line without fault tolerance.

    scripts/bench_torchft.sh                                   # installs the torchft extra, then runs this
    python benchmarks/vs_torchft.py --rounds 3 --json benchmarks/results/vs_torchft.json

Three workers, real processes on loopback, train an MLP 784-512-512-10 with AdamW, a batch of 64 a
worker (benchmarks/vs_torchft_worker.py says how each system's loop is written). Each round runs,
one after the other so that they see the same machine load (the order is reversed every other round):

- **plain DDP** over gloo: steady steps/s;
- **torchft** (its Lighthouse, a Manager a worker, DDP over ``ProcessGroupGloo``, a commit every
  step) and **ringserve** (``DistributedOptimizer``, ``hvd.elastic.run``, a commit every step), each
  in one job: steady steps/s over ``--steady-s`` once every worker has passed ``--warmup`` steps;
  then one worker is killed with SIGKILL: the time until both survivors have committed a step
  without it (the larger of the two), and the committed steps rolled back (a survivor's first step
  in the smaller world against the last it committed before); then, ``--rejoin-after-s`` later,
  the killed worker is started again: the survivors' stall, the longest gap between two of their
  committed steps from the restart until a second after the joiner's first step (one step's time
  is in it: compare the steady step time);
- **DiLoCo**, H = ``--sync-every``, on torchft (``torchft.local_sgd.DiLoCo``) and on ringserve
  (``hvd.DiLoCo``): the median time of a step that syncs (inner step, quorum or commit,
  allreduce of the pseudo-gradients, outer step), over every worker's syncs but the first. Both
  send float32; one more ringserve run uses its default codec, int8, for its own row. One more
  ringserve DiLoCo run kills a worker and starts it again: the survivors' longest gap between two
  steps around the join, and what it adds to their step with a sync (torchft's DiLoCo is measured
  steady only).

ringserve's workers also time their ``state.commit()``, the copy of the model and the optimizer
that every step pays for fault tolerance: its rows say how much of the step it is. One more
ringserve training job, the same but committing in place (``RINGSERVE_COMMIT_IN_PLACE=1``: a
commit copies none of the tensors that only the optimizer's step changes), gives the rows
"committing in place", with the kill and the rejoin; the throughput, recovery and join targets
are checked on both jobs.

The table gives each figure's median and range over the rounds, and the ratios ringserve / torchft
and ringserve / DDP paired within each round (median and range), and checks issue 45's targets on
the median of the paired ratios: recovery ≤ 0.2x torchft's, join stall ≤ torchft's, steady
throughput ≥ 1.3x torchft's and within 10% of plain DDP's (≥ 1/1.1 of it), DiLoCo's sync step
≤ 0.8x torchft's; and part 1's own bound on ringserve's figures alone: the join stall ≤ 0.1 s
(with one step in it), and DiLoCo's ≤ 0.1 s over its step with a sync. A run that fails or passes a deadline leaves its figures out, says why, and fails
its targets.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import PYTHON, free_port, table
from _results import save

WORKER = str(pathlib.Path(__file__).resolve().with_name("vs_torchft_worker.py"))
WORLD = 3
Record = dict[str, float]


class RunFailed(RuntimeError):
    """A run that failed or passed a deadline: its figures are left out of the table."""


# -- the figures, from the workers' step records (pure: tests/unit/test_vs_torchft.py) ------------

def steady_rate(records: Sequence[Record], start: float, end: float) -> float:
    """Committed steps a second between the first and the last record inside [start, end]."""
    times = [r["t"] for r in records if start <= r["t"] <= end]
    if len(times) < 2:
        raise RunFailed(f"fewer than 2 steps between {start:.2f} and {end:.2f}: no steady rate")
    return (len(times) - 1) / (times[-1] - times[0])


def recovery(survivors: Sequence[Sequence[Record]], killed_at: float, full: int = WORLD) -> tuple[float, int]:
    """(seconds from the kill until every survivor has committed a step in the smaller world,
    committed steps rolled back): a survivor's first step with fewer than ``full`` replicas against
    the last step it committed before that one (steps still completed with the dead peer count)."""
    seconds, rolled = 0.0, 0
    for records in survivors:
        index = next((i for i, r in enumerate(records) if r["t"] > killed_at and r["n"] < full), None)
        if index is None:
            raise RunFailed("a survivor never committed a step without the killed worker")
        before = [r["step"] for r in records[:index]]
        seconds = max(seconds, records[index]["t"] - killed_at)
        rolled = max(rolled, int(max(before, default=0) + 1 - records[index]["step"]))
    return seconds, max(rolled, 0)


def join_stall(survivors: Sequence[Sequence[Record]], restarted_at: float, joiner: Sequence[Record],
               after_s: float = 1.0) -> float:
    """The survivors' longest gap between two committed steps from the restart until ``after_s``
    past the joiner's first committed step."""
    if not joiner:
        raise RunFailed("the restarted worker never committed a step")
    end = joiner[0]["t"] + after_s
    gaps = [b["t"] - a["t"] for records in survivors for a, b in itertools.pairwise(records)
            if b["t"] > restarted_at and a["t"] <= end]
    if not gaps:
        raise RunFailed("the survivors committed no step around the join")
    return max(gaps)


def sync_step(workers: Sequence[Sequence[Record]]) -> tuple[float, float, float]:
    """(median seconds of a DiLoCo step that synced, of its commit, of a step that did not), over
    every worker's steps but each one's first sync."""
    synced = [r for records in workers for r in [r for r in records if r["sync"]][1:]]
    inner = [r["dt"] for records in workers for r in records if not r["sync"]]
    if not synced or not inner:
        raise RunFailed("no DiLoCo sync after the first")
    return (statistics.median(r["dt"] for r in synced), statistics.median(r.get("commit", 0.0) for r in synced),
            statistics.median(inner))


def spread(values: Sequence[float], digits: int = 2) -> str:
    """'median [min-max]' of the rounds' values, or '-' when every round failed."""
    if not values:
        return "-"
    v = sorted(values)
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{statistics.median(v):.{digits}f} [{v[0]:.{digits}f}-{v[-1]:.{digits}f}]"


def paired(ours: Sequence[float | None], theirs: Sequence[float | None]) -> list[float]:
    """ours / theirs within each round where both were measured."""
    return [a / b for a, b in zip(ours, theirs, strict=True) if a is not None and b is not None and b > 0]


@dataclass(frozen=True)
class Target:
    """An issue 45 target: the median paired ratio ringserve / ``against`` must be ``<=`` or ``>=``
    ``bound`` (``against`` empty: ringserve's own median figure)."""
    metric: str
    against: str
    op: str
    bound: float
    base: str = ""  # ``against``'s figure, where it is named otherwise than ``metric``

    def verdict(self, ratios: Sequence[float]) -> str:
        if not ratios:
            return "FAIL (not measured)"
        m = statistics.median(ratios)
        ok = m <= self.bound if self.op == "<=" else m >= self.bound
        return f"{'PASS' if ok else 'FAIL'} ({m:.2f} {self.op} {self.bound:.2f})"


TARGETS = [Target("recovery_s", "torchft", "<=", 0.2), Target("join_stall_s", "torchft", "<=", 1.0),
           Target("steps_per_s", "torchft", ">=", 1.3), Target("steps_per_s", "ddp", ">=", 1 / 1.1),
           # The same job committing in place (RINGSERVE_COMMIT_IN_PLACE=1): its commits copy nothing.
           Target("steps_per_s_in_place", "torchft", ">=", 1.3, "steps_per_s"),
           Target("steps_per_s_in_place", "ddp", ">=", 1 / 1.1, "steps_per_s"),
           Target("recovery_s_in_place", "torchft", "<=", 0.2, "recovery_s"),
           Target("join_stall_s_in_place", "torchft", "<=", 1.0, "join_stall_s"),
           Target("diloco_sync_s", "torchft", "<=", 0.8),
           # Part 1's own bound, in seconds (no sending time allowed for): the stall with one step in
           # it; DiLoCo's, over and above its step with a sync.
           Target("join_stall_s", "", "<=", 0.1), Target("diloco_join_extra_s", "", "<=", 0.1)]


# -- the runs -------------------------------------------------------------------------------------

@dataclass
class Job:
    """The processes of one run, each writing its step records to a file of its own."""
    system: str
    mode: str
    where: pathlib.Path
    args: argparse.Namespace
    env: dict[str, str]
    extra: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    server: subprocess.Popen[bytes] | None = None

    def start(self, name: str, rank: int) -> None:
        log = self.where / f"{name}.jsonl"
        out = (self.where / f"{name}.out").open("wb")
        argv = [PYTHON, WORKER, "--system", self.system, "--mode", self.mode, "--rank", str(rank), "--log", str(log),
                "--stop", str(self.where / "stop"), "--sync-every", str(self.args.sync_every), *self.extra]
        self.procs[name] = subprocess.Popen(argv, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT)
        out.close()

    def records(self, name: str) -> list[Record]:
        path = self.where / f"{name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def wait(self, what: str, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            dead = [n for n, p in self.procs.items() if p.poll() not in (None, 0) and p.returncode != -signal.SIGKILL]
            if dead:
                raise RunFailed(f"{self.system}: worker {dead[0]} exited with {self.procs[dead[0]].returncode} "
                                f"while waiting for {what}:\n{self.tail(dead[0])}")
            if time.monotonic() > deadline:
                raise RunFailed(f"{self.system}: no {what} within {timeout_s:.0f} s:\n{self.tail(next(iter(self.procs)))}")
            time.sleep(0.05)

    def tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.where / f"{name}.out").read_text(errors="replace")[-3000:]
        return ""

    def stop(self, at_step: int, timeout_s: float) -> None:
        """Tells every worker to stop at ``at_step`` and waits; kills whatever is left at the deadline."""
        (self.where / "stop.tmp").write_text(str(at_step))
        (self.where / "stop.tmp").rename(self.where / "stop")
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        self.close()

    def close(self) -> None:
        for p in [*self.procs.values(), *([self.server] if self.server else [])]:
            if p.poll() is None:
                p.kill()
            p.wait()


def _listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RunFailed(f"nothing listened on port {port} within {timeout_s:.0f} s")


def job(system: str, mode: str, where: pathlib.Path, args: argparse.Namespace,
        env: dict[str, str] | None = None) -> Job:
    """A job with its server (ringserve's coordinator, torchft's Lighthouse; DDP has none) running;
    ``env``: more of its workers' environment."""
    where.mkdir(parents=True)
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    port, extra, server = free_port(), [], None
    if system == "ringserve":
        server = subprocess.Popen([PYTHON, "-m", "ringserve.cli", "coordinator", "--port", str(port), "--min-workers", "2",
                                   "--max-workers", str(WORLD), "--settle-seconds", "60"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env["RINGSERVE_COORDINATOR"] = f"127.0.0.1:{port}"
    elif system == "torchft":
        lighthouse = shutil.which("torchft_lighthouse", path=str(pathlib.Path(PYTHON).parent)) or "torchft_lighthouse"
        server = subprocess.Popen([lighthouse, "--bind", f"127.0.0.1:{port}", "--min_replicas", "2",
                                   "--heartbeat_timeout_ms", str(args.torchft_heartbeat_ms)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        extra = ["--lighthouse", f"http://127.0.0.1:{port}"]
    else:
        extra = ["--port", str(port), "--world", str(WORLD)]
    j = Job(system, mode, where, args, env, extra, server=server)
    try:
        if server is not None:
            _listening(port, 60)
    except BaseException:
        j.close()
        raise
    return j


def _all_past(j: Job, names: Sequence[str], step: int, n: int = WORLD) -> Callable[[], bool]:
    return lambda: all(any(r["step"] >= step and r["n"] >= n for r in j.records(name)) for name in names)


def train_run(system: str, where: pathlib.Path, args: argparse.Namespace,
              env: dict[str, str] | None = None) -> dict[str, float]:
    """Steady steps/s, and for a fault-tolerant system a SIGKILL and a rejoin (see the module docstring)."""
    j = job(system, "train", where, args, env)
    names = [f"w{i}" for i in range(WORLD)]
    try:
        for i, name in enumerate(names):
            j.start(name, i)
        j.wait(f"{args.warmup} steps on all workers", _all_past(j, names, args.warmup), args.deadline_s)
        processes = [p.pid for p in j.procs.values()] + ([j.server.pid] if j.server is not None else [])
        cpu = cpu_s(processes)
        start = time.time()
        time.sleep(args.steady_s)
        end = time.time()
        cpu = cpu_s(processes) - cpu
        out = {"steps_per_s": min(steady_rate(j.records(n), start, end) for n in names)}
        stepped = statistics.mean(sum(1 for r in j.records(n) if start <= r["t"] <= end) for n in names)
        out["cpu_step_s"] = cpu / stepped if stepped else math.nan
        window = [r for r in j.records(names[0]) if start <= r["t"] <= end]
        out["step_s"] = statistics.median(r["dt"] for r in window)
        if system == "ringserve":
            out["commit_s"] = statistics.median(r["commit"] for r in window)
        if system != "ddp":
            survivors, victim = names[:-1], names[-1]
            j.procs[victim].send_signal(signal.SIGKILL)
            killed_at = time.time()
            j.procs[victim].wait(10)
            j.wait("step without the killed worker", lambda: all(
                any(r["t"] > killed_at and r["n"] < WORLD for r in j.records(n)) for n in survivors), args.deadline_s)
            out["recovery_s"], out["rolled_back"] = recovery([j.records(n) for n in survivors], killed_at)
            time.sleep(args.rejoin_after_s)
            j.start("rejoined", WORLD - 1)
            restarted_at = time.time()
            j.wait("step of the restarted worker", lambda: bool(j.records("rejoined")), args.deadline_s)
            joined = j.records("rejoined")[0]["t"]
            j.wait("survivors' steps after the join",
                   lambda: all(any(r["t"] > joined + 1.0 for r in j.records(n)) for n in survivors), args.deadline_s)
            out["join_stall_s"] = join_stall([j.records(n) for n in survivors], restarted_at, j.records("rejoined"))
            names = [*survivors, "rejoined"]
        j.stop(int(max(r["step"] for n in names for r in j.records(n))) + 10, args.deadline_s)
        return out
    finally:
        j.close()


def cpu_s(pids: Sequence[int]) -> float:
    """The CPU seconds (user and system, every thread) that the processes ``pids`` used so far,
    from /proc: on two cores shared by three workers, a step's time follows its CPU, and the CPU
    is the figure that the machine's other load moves least."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: the 14th and 15th fields
    return total / tick


def train_in_place(system: str, where: pathlib.Path, args: argparse.Namespace) -> dict[str, float]:
    """``train_run`` of a ringserve job that commits in place (RINGSERVE_COMMIT_IN_PLACE=1): its
    figures, named with ``_in_place``."""
    out = train_run(system, where, args, {"RINGSERVE_COMMIT_IN_PLACE": "1"})
    return {f"{k}_in_place": v for k, v in out.items()}


def diloco_run(system: str, where: pathlib.Path, args: argparse.Namespace, compression: str = "") -> dict[str, float]:
    """DiLoCo's step with its sync, its commit (ringserve's), and its plain inner step; ``compression``:
    ringserve's codec (none: float32, as torchft's)."""
    j = job(system, "diloco", where, args)
    tag = f"_{compression}" if compression else ""
    if compression:
        j.extra += ["--compression", compression]
    names = [f"w{i}" for i in range(WORLD)]
    h = args.sync_every
    try:
        for i, name in enumerate(names):
            j.start(name, i)
        j.wait(f"{args.diloco_syncs + 1} syncs on all workers", lambda: all(
            sum(r["sync"] for r in j.records(n)) > args.diloco_syncs for n in names), args.deadline_s)
        last = max(r["step"] for n in names for r in j.records(n))
        j.stop((int(last) // h + 2) * h, args.deadline_s)  # at a sync boundary that nobody has passed
        synced, commit, inner = sync_step([j.records(n) for n in names])
        out = {f"diloco{tag}_sync_s": synced, f"diloco{tag}_inner_s": inner}
        if system == "ringserve":
            out[f"diloco{tag}_commit_s"] = commit
        return out
    finally:
        j.close()


def diloco_int8(system: str, where: pathlib.Path, args: argparse.Namespace) -> dict[str, float]:
    return diloco_run(system, where, args, "int8")


def diloco_join_run(system: str, where: pathlib.Path, args: argparse.Namespace) -> dict[str, float]:
    """DiLoCo with a SIGKILL and a rejoin (ringserve's; torchft's DiLoCo is measured steady only):
    the survivors' longest gap between two steps around the join, as ``join_stall`` reads it, and
    what it adds to their median step with a sync (the join is admitted at the commit that follows
    a sync, so that step is in the gap)."""
    j = job(system, "diloco", where, args)
    names = [f"w{i}" for i in range(WORLD)]
    survivors, victim = names[:-1], names[-1]
    try:
        for i, name in enumerate(names):
            j.start(name, i)
        j.wait("2 syncs on all workers", lambda: all(sum(r["sync"] for r in j.records(n)) >= 2 for n in names),
               args.deadline_s)
        j.procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.time()
        j.procs[victim].wait(10)
        j.wait("a sync without the killed worker", lambda: all(
            any(r["t"] > killed_at and 0 < r["n"] < WORLD for r in j.records(n)) for n in survivors), args.deadline_s)
        time.sleep(args.rejoin_after_s)
        j.start("rejoined", WORLD - 1)
        restarted_at = time.time()
        j.wait("a sync of the restarted worker", lambda: any(r["sync"] for r in j.records("rejoined")), args.deadline_s)
        joined = j.records("rejoined")[0]["t"]
        j.wait("survivors' steps after the join",
               lambda: all(any(r["t"] > joined + 1.0 for r in j.records(n)) for n in survivors), args.deadline_s)
        stall = join_stall([j.records(n) for n in survivors], restarted_at, j.records("rejoined"))
        synced, _, _ = sync_step([[r for r in j.records(n) if r["t"] < killed_at] for n in survivors])
        names = [*survivors, "rejoined"]
        last = max(r["step"] for n in names for r in j.records(n))
        j.stop((int(last) // args.sync_every + 2) * args.sync_every, args.deadline_s)
        return {"diloco_join_stall_s": stall, "diloco_join_extra_s": stall - synced}
    finally:
        j.close()


def measure(what: Callable[[], dict[str, float]], label: str) -> dict[str, float]:
    print(f"  {label} ...", file=sys.stderr, flush=True)
    try:
        return what()
    except RunFailed as exc:
        print(f"  {label} FAILED: {exc}", file=sys.stderr, flush=True)
        return {"failed": 1.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20, help="steps before the steady window")
    p.add_argument("--steady-s", type=float, default=6.0)
    p.add_argument("--rejoin-after-s", type=float, default=2.0, help="from the survivors' recovery to the restart")
    p.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H")
    p.add_argument("--diloco-syncs", type=int, default=4, help="syncs measured a run (after a first one)")
    p.add_argument("--torchft-heartbeat-ms", type=int, default=5000, help="the Lighthouse's heartbeat timeout (its default)")
    p.add_argument("--deadline-s", type=float, default=120.0, help="the longest wait for anything in a run")
    p.add_argument("--json", default="", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--runs", default="", metavar="SYSTEM-MODE,...",
                   help="only these runs (e.g. ddp-train,ringserve-train,ringserve-train-in-place): a longer look at "
                        "a few figures; the targets of the runs left out fail as not measured")
    args = p.parse_args()
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        sys.exit(f"torchft is not installed ({exc}): scripts/bench_torchft.sh installs the torchft extra and runs this.")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that every job's finally kills its workers
    runs: list[tuple[str, str, Callable[[str, pathlib.Path, argparse.Namespace], dict[str, float]]]] = [
        ("ddp", "train", train_run), ("torchft", "train", train_run), ("ringserve", "train", train_run),
        ("ringserve", "train-in-place", train_in_place),
        ("torchft", "diloco", diloco_run), ("ringserve", "diloco", diloco_run),
        ("ringserve", "diloco-int8", diloco_int8), ("ringserve", "diloco-join", diloco_join_run)]
    if args.runs:
        wanted = set(args.runs.split(","))
        unknown = wanted - {f"{system}-{mode}" for system, mode, _ in runs}
        if unknown:
            sys.exit(f"--runs: no such run: {', '.join(sorted(unknown))}")
        runs = [r for r in runs if f"{r[0]}-{r[1]}" in wanted]
    results: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="vs_torchft.") as tmp:
        for r in range(args.rounds):
            order = runs if r % 2 == 0 else runs[::-1]
            print(f"round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
            got: dict[str, dict[str, float]] = {s: {} for s in ("ddp", "torchft", "ringserve")}
            for system, mode, fn in order:
                where = pathlib.Path(tmp) / f"r{r}-{system}-{mode}"
                got[system].update(measure(functools.partial(fn, system, where, args), f"{system} {mode}"))
            results.append(got)
    rows, targets = report(results, args)
    if args.json:
        save(args.json, "vs_torchft", rows, targets=targets, rounds=results, world=WORLD, sync_every=args.sync_every,
             torchft_heartbeat_ms=args.torchft_heartbeat_ms)


# (the figure, its title, its digits, the figure of torchft's and DDP's it is set against)
TRAIN_METRICS = [("steps_per_s", "steps/s, steady", 1, "steps_per_s"),
                 ("step_s", "step time, steady (s)", 3, "step_s"),
                 ("commit_s", "of which ringserve's commit (s)", 4, ""),
                 ("cpu_step_s", "CPU a step, every process of the job (s)", 4, "cpu_step_s"),
                 ("recovery_s", "a SIGKILL until the survivors' next step (s)", 2, "recovery_s"),
                 ("rolled_back", "committed steps rolled back", 0, ""),
                 ("join_stall_s", "survivors' stall when the killed worker rejoins (s)", 2, "join_stall_s")]
METRICS = [*TRAIN_METRICS,
           # The job committing in place (train_in_place), each figure against the same of the others.
           *[(f"{metric}_in_place", f"committing in place: {title}", digits, base)
             for metric, title, digits, base in TRAIN_METRICS],
           ("diloco_sync_s", "DiLoCo, a step with its sync (s)", 3, "diloco_sync_s"),
           ("diloco_commit_s", "of which ringserve's commit (s)", 4, ""),
           ("diloco_inner_s", "DiLoCo, an inner step (s)", 3, "diloco_inner_s"),
           ("diloco_int8_sync_s", "DiLoCo, a step with its sync, ringserve int8 (s)", 3, "diloco_sync_s"),
           ("diloco_join_stall_s", "DiLoCo, survivors' stall when the killed worker rejoins (s)", 3, ""),
           ("diloco_join_extra_s", "of which more than a step with its sync (s)", 3, "")]


def report(results: list[dict[str, dict[str, float]]],
           args: argparse.Namespace) -> tuple[list[dict[str, object]], dict[str, str]]:
    """Prints the table and the targets; returns the table's rows and each target's verdict."""
    def values(system: str, metric: str) -> list[float | None]:
        return [rnd[system].get(metric) for rnd in results]

    rows: list[dict[str, object]] = []
    for metric, title, digits, base in METRICS:
        cells = {s: spread([v for v in values(s, metric) if v is not None], digits) for s in ("torchft", "ringserve", "ddp")}
        rows.append({"metric": title, **cells,
                     "vs_torchft": spread(paired(values("ringserve", metric), values("torchft", base))) if base else "-",
                     "vs_ddp": spread(paired(values("ringserve", metric), values("ddp", base))) if base else "-"})
    load = os.getloadavg()
    print(f"3 workers on loopback, MLP 784-512-512-10, AdamW, batch 64 a worker, 1 torch thread each; {os.cpu_count()} "
          f"cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end; median [range] over {len(results)} "
          f"interleaved rounds; ratios paired within a round; DiLoCo H = {args.sync_every}, float32 on both; "
          f"torchft's Lighthouse heartbeat timeout {args.torchft_heartbeat_ms} ms")
    print(table(rows, [("metric", "metric"), ("torchft", "torchft"), ("ringserve", "ringserve"),
                       ("ddp", "DDP over gloo"), ("vs_torchft", "ringserve / torchft"), ("vs_ddp", "ringserve / DDP")]))
    print()
    targets = {}
    for t in TARGETS:
        if t.against:
            name = f"{t.metric}: ringserve / {t.against} {t.op} {t.bound:.2f}"
            targets[name] = t.verdict(paired(values("ringserve", t.metric), values(t.against, t.base or t.metric)))
        else:
            name = f"{t.metric}: ringserve's, in seconds, {t.op} {t.bound:.2f}"
            targets[name] = t.verdict([v for v in values("ringserve", t.metric) if v is not None])
        print(f"target {name}: {targets[name]}")
    return rows, targets


if __name__ == "__main__":
    main()
