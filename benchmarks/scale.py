"""Hundreds of real workers in one job: N worker processes on H emulated hosts, one coordinator.

    sudo .venv/bin/python benchmarks/scale.py --workers 16 --hosts 4                  # a minute
    sudo .venv/bin/python benchmarks/scale.py --workers 256 --hosts 32 --steady-s 600 --churn \\
        --json benchmarks/results/scale-256.json                                      # the full run

Each host is a network namespace on one bridge (_veth.py), and sees a boot id of its own (a file
bind-mounted over /proc/sys/kernel/random/boot_id in each worker's mount namespace), so that its
workers pass payloads to each other through shared memory, as on one machine, and to other hosts
over the TCP payload lane, as between machines (shared memory needs the same boot id: see
ringserve/worker/dataplane/links/shared.py). Each host's workers have its hostname, so ``auto``
plans by host. The coordinator has a namespace of its own, and a job token (``--make-token``).

Every worker (scale_worker.py) runs an elastic numpy loop: per step one allreduce of each of
``--sizes`` under ``auto``, every element checked exactly against the sum computed locally, and a
commit. The harness reports:

- the time to the first full view: from the launch, and from the moment the last worker had
  loaded what ``rs.init()`` needs (gRPC, protobuf, the worker's modules): what joining, the view
  and the links take once every process is ready. Before that, N processes start Python and
  import on the machine's cores, which no framework can shorten;
- per size, the time of an allreduce in the steady phase (the median over steps of the slowest
  rank's time), and what ``auto`` ran; with ``--versus ring``, each allreduce also runs by the
  flat ring in the same step, in alternating order, and the report gives auto / ring paired by step;
- the coordinator's CPU (a fraction of one core) over the steady phase;
- each worker's peak RSS and PSS (shared pages divided among the processes that map them),
  threads and file descriptors, sampled every few seconds (median and largest);
- wrong results, and false failures: views formed in the steady phase, where nothing was killed;
- with ``--churn``: 10% of the workers SIGKILLed at once, then as many started at once, then one
  host's namespace cut off the bridge; for each, the time from the fault to the new view and to
  the first step completed in it, and whether every sum stayed exact.

Needs root and iproute2 (``ip netns``). The namespaces are deleted at the end; a run killed with
SIGKILL leaves them (``ip netns list | grep rsl-``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from _common import PYTHON, table
from _veth import DEVICE, Host, Lan, free_port

WORKER = str(pathlib.Path(__file__).resolve().parent / "scale_worker.py")
BOOT_ID = "/proc/sys/kernel/random/boot_id"
SAMPLE_S = 5.0  # how often the workers' memory, threads and descriptors are read
SIZES = (4 << 10, 1 << 20, 16 << 20)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@dataclass
class Proc:
    """One worker process: its host and its event file."""

    index: int
    host: Host
    out: pathlib.Path
    popen: subprocess.Popen[bytes]


@dataclass
class Peaks:
    """The largest figures sampled from one process."""

    rss: int = 0
    pss: int = 0
    threads: int = 0
    fds: int = 0


def read_proc(pid: int) -> Peaks | None:
    """A process's RSS, PSS (bytes), threads and open descriptors now; None once it is gone."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        rollup = pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = {line.split(":")[0]: line.split(":")[1].split() for line in status.splitlines() if ":" in line}
    pss = next((int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    return Peaks(int(fields["VmRSS"][0]) << 10, pss << 10, int(fields["Threads"][0]), fds)


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU so far."""
    parts = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def machine_seconds() -> float:
    """The CPU seconds every core of the machine has been busy so far (all but idle and iowait)."""
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def workers_seconds(job: Job) -> float:
    """The CPU seconds the live workers have used so far."""
    total = 0.0
    for p in job.live():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += cpu_seconds(p.popen.pid)
    return total


@dataclass
class Job:
    """The job's namespaces, coordinator and workers."""

    lan: Lan
    workers: int
    sizes: list[int]
    tmp: pathlib.Path
    heartbeat_timeout_s: float
    min_workers: int
    priority: list[str] = field(default_factory=list)  # a prefix for the coordinator's command: nice
    versus: str | None = None  # an algorithm every allreduce also runs by, flat (--versus)
    extra_env: dict[str, str] = field(default_factory=dict)  # more of the workers' environment (--env)
    procs: list[Proc] = field(default_factory=list)
    peaks: dict[int, Peaks] = field(default_factory=dict)
    coordinator: subprocess.Popen[bytes] | None = None
    address: str = ""

    @property
    def hosts(self) -> list[Host]:
        return self.lan.hosts[:-1]

    @property
    def stop(self) -> pathlib.Path:
        return self.tmp / "stop"

    def start_coordinator(self) -> None:
        host, port = self.lan.hosts[-1], free_port()
        self.address = f"{host.address}:{port}"
        token = self.tmp / "token"
        log = open(self.tmp / "coordinator.log", "wb")  # noqa: SIM115 (closed with the process)
        self.coordinator = subprocess.Popen(
            self.lan.command(host, [*self.priority, PYTHON, "-m", "ringserve.cli", "coordinator", "--host", host.address, "--port", str(port),
                                    "--min-workers", str(self.min_workers), "--max-workers", str(self.workers),
                                    "--settle-seconds", "1", "--heartbeat-timeout", str(self.heartbeat_timeout_s),
                                    "--make-token", str(token)]),
            stdout=log, stderr=subprocess.STDOUT)
        self.lan.wait_listening(host, port, timeout_s=120)

    def start_worker(self, host: Host) -> Proc:
        index = len(self.procs)
        boot = self.tmp / f"boot-{host.index}"
        if not boot.exists():
            boot.write_text(f"{host.index:08d}-5ca1-4e00-8000-{os.urandom(6).hex()}\n")
        out = self.tmp / f"worker-{index}.jsonl"
        log = open(self.tmp / f"worker-{index}.log", "wb")  # noqa: SIM115 (closed with the process)
        env = {"RINGSERVE_COORDINATOR": self.address, "RINGSERVE_TOKEN_FILE": str(self.tmp / "token"),
               "RINGSERVE_BIND_HOST": host.address, "RINGSERVE_HOSTNAME": f"h{host.index}",
               "RINGSERVE_HEARTBEAT_TIMEOUT_S": str(self.heartbeat_timeout_s),
               "RINGSERVE_RANK_HINT": str(index), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        if self.versus:
            env["SCALE_VERSUS"] = self.versus
        env.update(self.extra_env)
        # The bind mount lives in the mount namespace `ip netns exec` makes for this process alone.
        script = f'mount --bind {boot} {BOOT_ID} && exec "$@"'
        argv = ["sh", "-c", script, "sh", PYTHON, WORKER, str(out), str(self.stop), *map(str, self.sizes)]
        popen = subprocess.Popen(self.lan.command(host, argv, env), stdout=log, stderr=subprocess.STDOUT)
        proc = Proc(index, host, out, popen)
        self.procs.append(proc)
        return proc

    def live(self) -> list[Proc]:
        return [p for p in self.procs if p.popen.poll() is None]

    def sample(self) -> None:
        for p in self.live():
            now = read_proc(p.popen.pid)
            if now is None:
                continue
            top = self.peaks.setdefault(p.index, Peaks())
            top.rss, top.pss = max(top.rss, now.rss), max(top.pss, now.pss)
            top.threads, top.fds = max(top.threads, now.threads), max(top.fds, now.fds)

    def events(self) -> Iterator[dict[str, Any]]:
        for p in self.procs:
            if p.out.exists():
                for line in p.out.read_text().splitlines():
                    if line.endswith("}"):
                        yield {**json.loads(line), "index": p.index}

    def wait_for(self, what: str, test: Any, timeout_s: float) -> dict[str, Any]:
        """Samples until an event passes ``test``; returns the first such (earliest), or raises."""
        say(f"waiting for {what}")
        deadline = time.monotonic() + timeout_s
        while True:
            found = sorted((e for e in self.events() if test(e)), key=lambda e: e["t"])
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:g} s")
            self.sample()
            time.sleep(0.5)

    def close(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.kill()
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.terminate()
            try:
                self.coordinator.wait(10)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(10)


def views(job: Job) -> dict[int, tuple[float, int]]:
    """Each view any worker computed in: (when the first worker saw it, its size)."""
    found: dict[int, tuple[float, int]] = {}
    for e in job.events():
        if e["kind"] == "view" and (e["view"] not in found or e["t"] < found[e["view"]][0]):
            found[e["view"]] = (e["t"], e["size"])
    return found


def first_op_in(job: Job, view: int) -> float:
    """When the first step in ``view`` completed: the earliest timed allreduce recorded in it
    (records start with the second step of a view)."""
    return min((e["t"] for e in job.events() if e["kind"] == "op" and e["view"] == view), default=float("nan"))


def after(job: Job, what: str, since: float, size: int, timeout_s: float) -> dict[str, float]:
    """Waits for a view of ``size`` formed after ``since`` and a step done in it; their delays."""
    seen = job.wait_for(what, lambda e: e["kind"] == "view" and e["t"] > since and e["size"] == size, timeout_s)
    job.wait_for(f"a step in the view after {what}", lambda e: e["kind"] == "op" and e["view"] == seen["view"], timeout_s)
    return {"view_s": seen["t"] - since, "step_s": first_op_in(job, seen["view"]) - since, "view": seen["view"]}


def steady(job: Job, seconds: float) -> dict[str, Any]:
    """Lets the job train for ``seconds`` with nothing injected. Every view formed meanwhile is
    counted (``views``): a view that has fewer members than the one before dropped live workers
    (``false_failures``, how many), one with as many re-formed the ring (``reformed``: a link that
    broke, no worker lost; each still costs the job a restore). And the CPU (in cores) over the time of the coordinator, of the workers and of the
    whole machine (what else ran on it: the cores the job did not have)."""
    known = set(views(job))
    pid = job.coordinator.pid if job.coordinator else 0
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    machine0, workers0 = machine_seconds(), workers_seconds(job)
    wall0 = time.time()
    while time.monotonic() - t0 < seconds:
        job.sample()
        time.sleep(SAMPLE_S)
    took = time.monotonic() - t0
    used = (cpu_seconds(pid) - cpu0) / took
    machine, workers = (machine_seconds() - machine0) / took, (workers_seconds(job) - workers0) / took
    seen = views(job)
    new = {v: s for v, s in seen.items() if v not in known}
    sizes = [seen[v][1] for v in sorted(seen) if v >= max(known)]  # the last view before, then the new ones
    dropped = sum(max(0, a - b) for a, b in itertools.pairwise(sizes))
    reformed = sum(1 for a, b in itertools.pairwise(sizes) if a == b)
    return {"seconds": seconds, "start": wall0, "end": time.time(), "coordinator_cpu": used,
            "workers_cpu": workers, "machine_cpu": machine,
            "false_failures": dropped, "reformed": reformed, "views": new, "exited": [p.index for p in job.procs if p.popen.poll() is not None]}


def step_times(job: Job, world: int, start: float, end: float) -> dict[tuple[str, int, int, int], list[float]]:
    """Every rank's time of each timed allreduce in views of ``world`` within [start, end], by
    (algorithm setting, size, view, step), for the steps every rank recorded."""
    by: dict[tuple[str, int, int, int], list[float]] = {}
    for e in job.events():
        if e["kind"] == "op" and e["world"] == world and start <= e["t"] <= end:
            by.setdefault((e.get("algorithm", "job"), e["size"], e["view"], e["step"]), []).append(e["seconds"])
    return {k: ts for k, ts in by.items() if len(ts) == world}


def op_times(job: Job, world: int, start: float, end: float) -> dict[int | str, dict[str, Any]]:
    """Per size, over the steps of views of ``world`` within [start, end]: the median over steps
    of the slowest rank's time, and the median of every rank's; the median of every rank's CPU
    seconds over the allreduce, over filling its vector and over checking its sum; and how many
    rank-calls ran each set of algorithms (the calls by the job's setting, not --versus's). Under ``commit``, the same of the steps' commits (which
    ``run`` moves to a key of its own)."""
    by: dict[tuple[int | str, int, int], list[dict[str, Any]]] = {}
    for e in job.events():
        if (e["kind"] in ("op", "commit") and e["world"] == world and start <= e["t"] <= end
                and e.get("algorithm", "job") == "job"):
            by.setdefault((e.get("size", "commit"), e["view"], e["step"]), []).append(e)
    result: dict[int | str, dict[str, Any]] = {}
    keys: list[int | str] = [*job.sizes, "commit"]
    for size in keys:
        steps = [es for (s, _, _), es in by.items() if s == size and len(es) == world]
        if not steps:
            continue
        calls = [e for es in steps for e in es]
        found = result[size] = {"slowest_s": statistics.median(max(e["seconds"] for e in es) for es in steps),
                                "median_s": statistics.median(e["seconds"] for e in calls), "steps": len(steps)}
        for key in ("cpu", "fill_cpu", "check_cpu"):
            if all(key in e for e in calls):
                found[f"{key}_s"] = statistics.median(e[key] for e in calls)
        if all("ran" in e for e in calls):
            ran: dict[str, int] = {}
            for e in calls:
                ran["+".join(e["ran"])] = ran.get("+".join(e["ran"]), 0) + 1
            found["ran"] = ran
    return result


def versus(job: Job, world: int, start: float, end: float, other: str) -> dict[int, dict[str, float]]:
    """Per size, the job's setting against ``other`` in the same steps: each step's slowest rank's
    time under each, and the median over steps of their ratio (job / other), paired step by step."""
    by = step_times(job, world, start, end)
    result = {}
    for size in job.sizes:
        pairs = [(max(ts), max(by[(other, s, v, n)])) for (a, s, v, n), ts in by.items()
                 if a == "job" and s == size and (other, s, v, n) in by]
        if pairs:
            result[size] = {"job_s": statistics.median(a for a, _ in pairs), "other_s": statistics.median(b for _, b in pairs),
                            "ratio": statistics.median(a / b for a, b in pairs), "steps": len(pairs)}
    return result


def churn(job: Job, rng: random.Random, timeout_s: float) -> dict[str, Any]:
    """10% killed at once, 10% joining at once, one host cut off: the delays of each."""
    n = job.workers
    k = max(1, n // 10)
    result: dict[str, Any] = {"killed": k}
    victims = rng.sample(job.live(), k)
    since = time.time()
    for p in victims:
        p.popen.send_signal(signal.SIGKILL)
    result["kill"] = after(job, "a view without the killed", since, n - k, timeout_s)
    since = time.time()
    for p in victims:
        job.start_worker(p.host)
    result["join"] = after(job, "a view with the joiners", since, n, timeout_s)
    host = rng.choice(job.hosts)
    cut = [p for p in job.live() if p.host is host]
    since = time.time()
    subprocess.run(["ip", "-n", host.netns, "link", "set", DEVICE, "down"], check=True, timeout=30)
    result["cut"] = {"host": host.index, "workers": len(cut),
                     **after(job, "a view without the cut host", since, n - len(cut), timeout_s)}
    return result


def finish(job: Job, timeout_s: float) -> None:
    """Stops training at a step every rank of the newest view is still short of, and waits."""
    last = max((e["step"] for e in job.events() if e["kind"] == "op"), default=0)
    job.stop.write_text(str(last + 5))
    deadline = time.monotonic() + timeout_s
    newest = max(views(job))
    members = {e["index"] for e in job.events() if e["kind"] == "view" and e["view"] == newest}
    while any(job.procs[i].popen.poll() is None for i in members) and time.monotonic() < deadline:
        time.sleep(0.5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    per_host = args.workers // args.hosts
    if per_host * args.hosts != args.workers:
        raise SystemExit("--workers must be a multiple of --hosts")
    with contextlib.ExitStack() as stack:
        if args.workdir:
            tmp = pathlib.Path(args.workdir)
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ringserve-scale-")))
        lan = stack.enter_context(Lan(args.hosts + 1))
        # The coordinator ends a world that falls below its minimum: with churn, the minimum
        # leaves room for the killed tenth and for the host cut off.
        least = args.workers - max(args.workers // 10, per_host) if args.churn else args.workers
        nice = ["nice", "-n", str(args.coordinator_nice)] if args.coordinator_nice else []
        job = Job(lan, args.workers, args.sizes, tmp, args.heartbeat_timeout, least, nice, args.versus,
                  dict(kv.split("=", 1) for kv in args.env))
        try:
            job.start_coordinator()
            launched = time.time()
            for i in range(args.workers):
                job.start_worker(job.hosts[i // per_host])
            full = job.wait_for("full view", lambda e: e["kind"] == "view" and e["size"] == args.workers, args.timeout)
            imported = max(e["imported"] for e in job.events() if e["kind"] == "start")
            ready = max(e["ready"] for e in job.events() if e["kind"] == "start")
            # What the interpreters' start and imports cost in CPU, all workers together: on this
            # machine's cores, no launch can form a view sooner than that divided by them.
            startup_cpu = sum(e["ready_cpu"] for e in job.events() if e["kind"] == "start")
            started = max(e["started"] for e in job.events() if e["kind"] == "start")
            job.wait_for("a step in the full view", lambda e: e["kind"] == "op", args.timeout)
            calm = steady(job, args.steady_s)
            result: dict[str, Any] = {
                "workers": args.workers, "hosts": args.hosts, "coordinator_nice": args.coordinator_nice, "sizes": args.sizes, "load": os.getloadavg()[0],
                "env": args.env, "cores": os.cpu_count(), "placement": [p.host.index for p in job.procs[:args.workers]],
                "first_view_from_launch_s": full["t"] - launched, "first_view_from_last_start_s": full["t"] - started,
                "first_view_from_last_import_s": full["t"] - imported, "first_view_from_last_ready_s": full["t"] - ready,
                "startup_cpu_s": startup_cpu,
                "steady": calm,
                "ops": op_times(job, args.workers, calm["start"], calm["end"])}
            if args.versus:
                result["versus"] = {"algorithm": args.versus,
                                    "sizes": versus(job, args.workers, calm["start"], calm["end"], args.versus)}
            result["commit"] = result["ops"].pop("commit", None)
            if args.churn:
                result["churn"] = churn(job, rng, args.timeout)
            finish(job, args.timeout)
            result["wrong"] = [e for e in job.events() if e["kind"] == "wrong"]
            result["algorithms"] = algorithms(job)
            result["peaks"] = {i: vars(p) for i, p in job.peaks.items()}
            return result
        finally:
            job.close()


def algorithms(job: Job) -> dict[str, int]:
    """The allreduce algorithms the workers ran, and how many calls each, over the whole run."""
    ran: dict[str, int] = {}
    for e in job.events():
        if e["kind"] == "end":
            for name, count in e["algorithms"].items():
                ran[name] = ran.get(name, 0) + count
    return ran


def report(r: dict[str, Any]) -> str:
    peaks = list(r["peaks"].values())
    mib = 1 << 20

    def spread(key: str, scale: float = 1) -> str:
        values = [p[key] / scale for p in peaks]
        return f"{statistics.median(values):.0f} (largest {max(values):.0f})"

    lines = [f"{r['workers']} workers on {r['hosts']} hosts; load average {r['load']:.1f}",
             f"first full view: {r['first_view_from_launch_s']:.1f} s from the launch, "
             f"{r['first_view_from_last_start_s']:.1f} s from the last process's start, "
             f"{r['first_view_from_last_import_s']:.1f} s from the last import of ringserve, "
             f"{r['first_view_from_last_ready_s']:.1f} s from the last to have loaded what rs.init() needs "
             f"(the workers' start and imports took {r['startup_cpu_s']:.0f} CPU-seconds: "
             f"{r['startup_cpu_s'] / r['cores']:.1f} s on {r['cores']} cores at best)",
             f"steady {r['steady']['seconds']:g} s: false failures {r['steady']['false_failures']} "
             f"(live workers dropped), rings re-formed {r['steady'].get('reformed', 0)}, "
             f"coordinator CPU {r['steady']['coordinator_cpu']:.2f} of a core, wrong results {len(r['wrong'])}",
             f"per worker: RSS {spread('rss', mib)} MiB, PSS {spread('pss', mib)} MiB, threads {spread('threads')}, "
             f"descriptors {spread('fds')}"]
    lines.append("allreduce ran: " + ", ".join(f"{k} {v}" for k, v in sorted(r["algorithms"].items())))
    rows = [{"size": label(s) if s != "commit" else s, "slowest": f"{o['slowest_s'] * 1e3:.1f}",
             "median": f"{o['median_s'] * 1e3:.1f}", "cpu": f"{o['cpu_s'] * 1e3:.1f}" if "cpu_s" in o else "-",
             "steps": o["steps"]} for s, o in [*r["ops"].items(), ("commit", r.get("commit"))] if o]
    lines.append(table(rows, [("size", "size"), ("slowest", "ms, slowest rank (median over steps)"),
                              ("median", "ms, median rank"), ("cpu", "ms CPU, median rank"), ("steps", "steps")]))
    if "versus" in r:
        other = r["versus"]["algorithm"]
        rows = [{"size": label(s), "job": f"{o['job_s'] * 1e3:.1f}", "other": f"{o['other_s'] * 1e3:.1f}",
                 "ratio": f"{o['ratio']:.2f}", "steps": o["steps"]} for s, o in sorted(r["versus"]["sizes"].items())]
        lines.append(table(rows, [("size", "size"), ("job", "ms, auto (slowest rank)"), ("other", f"ms, {other} flat"),
                                  ("ratio", f"auto / {other}, paired by step (median)"), ("steps", "steps")]))
    if "churn" in r:
        c = r["churn"]
        for what in ("kill", "join", "cut"):
            lines.append(f"{what}: new view after {c[what]['view_s']:.1f} s, first step in it after {c[what]['step_s']:.1f} s")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--sizes", type=parse_size, nargs="+", default=list(SIZES))
    p.add_argument("--steady-s", type=float, default=30.0, help="seconds of training with nothing injected")
    p.add_argument("--churn", action="store_true", help="then kill 10%%, start 10%%, cut one host")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=600.0, help="the longest wait for any one event")
    p.add_argument("--coordinator-nice", type=int, default=0,
                   help="the coordinator's niceness (negative: ahead of the workers, as on a machine of its own)")
    p.add_argument("--versus", metavar="ALGORITHM",
                   help="also run each allreduce by ALGORITHM over the whole ring (e.g. ring), alternating with "
                        "the job's setting step by step, and report their ratio (steady views only)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set this in every worker's environment (e.g. RINGSERVE_LINK_MBPS=10000); repeatable")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--workdir", help="keep the workers' event files and logs in this directory")
    args = p.parse_args()
    if args.versus and args.churn:  # a view made between a rank's switch and its call would plan it by the job's setting
        p.error("--versus times steady views: run it without --churn")
    # A SIGTERM (a timeout's) unwinds like Ctrl-C, so that the namespaces and processes go with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    print(report(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
