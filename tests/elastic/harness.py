"""The chaos harness: an elastic job under `ringserve run`, faults injected, invariants checked."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

WORKER = str(Path(__file__).with_name("elastic_worker.py"))
TORCH_WORKER = str(Path(__file__).with_name("torch_elastic_worker.py"))


@dataclass
class Run:
    log: Path
    launcher: subprocess.Popen[bytes]
    started: float = field(default_factory=time.time)
    faults: list[tuple[float, str, int]] = field(default_factory=list)  # (time, kind, pid)
    lines: list[str] = field(default_factory=list)  # the output so far, once follow() was called
    reader: threading.Thread | None = None

    def records(self) -> list[dict]:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def workers(self) -> list[int]:
        """Live worker pids: the launcher's children."""
        path = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children")
        try:
            return [int(p) for p in path.read_text().split()]
        except OSError:
            return []

    def wait_for_step(self, step: int, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if any(r["step"] >= step for r in self.records()):
                return
            time.sleep(0.05)
        raise AssertionError(f"no commit reached step {step} within {timeout_s} s")

    def signal(self, kind: str, sig: int, pid: int | None = None) -> int:
        pid = pid or random.choice(self.workers())
        self.faults.append((time.time(), kind, pid))
        os.kill(pid, sig)
        return pid

    def follow(self) -> None:
        """Reads the launcher's output as it comes, so that a test can wait for a line, and so
        that the launcher never blocks on a full pipe (start() calls it; a second call is a no-op)."""
        if self.reader is not None:
            return
        stream = self.launcher.stdout
        assert stream is not None

        def read() -> None:
            for raw in stream:
                self.lines.append(raw.decode(errors="replace"))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()

    def wait_for_line(self, text: str, timeout_s: float) -> str:
        """The first line of output holding ``text`` (after follow()), once it comes."""
        deadline = time.time() + timeout_s
        while True:
            found = [line for line in list(self.lines) if text in line]
            if found:
                return found[0]
            assert time.time() < deadline, f"no line with {text!r} within {timeout_s} s:\n{''.join(self.lines)[-4000:]}"
            assert self.launcher.poll() is None or self.reader is None or self.reader.is_alive(), (
                f"the run ended without a line with {text!r}:\n{''.join(self.lines)[-4000:]}")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> tuple[int, str]:
        if self.reader is not None:
            try:
                self.launcher.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait()
                self.reader.join(10)
                raise AssertionError(f"the run hung past {timeout_s} s:\n{''.join(self.lines)[-4000:]}") from None
            self.reader.join(10)
            return self.launcher.returncode, "".join(self.lines)
        try:
            out, _ = self.launcher.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            out, _ = self.launcher.communicate()
            raise AssertionError(f"the run hung past {timeout_s} s:\n{out.decode()[-4000:]}") from None
        return self.launcher.returncode, out.decode()


def start(tmp: Path, *, workers: int = 4, steps: int, pause_s: float, min_np: int = 2, max_np: int = 0,
          restart: bool = True, fault: str = "", heartbeat_timeout_s: float = 2.0, worker: str = WORKER,
          max_restarts: int = 10, env: dict[str, str] | None = None) -> Run:
    log = tmp / "commits.jsonl"
    cmd = [sys.executable, "-m", "ringserve.cli", "run", "-np", str(workers), "--min-np", str(min_np),
           "--max-np", str(max_np or workers), "--heartbeat-timeout", str(heartbeat_timeout_s)]
    if restart:
        cmd += ["--restart-failed", "--max-restarts", str(max_restarts)]
    cmd += [sys.executable, worker, str(log), str(steps), str(pause_s)]
    if fault:
        cmd.append(fault)
    env = {**os.environ, "RINGSERVE_ELASTIC_TIMEOUT_S": "60", "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60", **(env or {})}
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    run = Run(log=log, launcher=launcher)
    # Read as it comes: a pipe read only at the end holds 64 KiB, and a launcher blocked on it stops
    # forwarding its workers' output, so they block in their next log line too (heartbeats included).
    run.follow()
    return run


def check_invariants(records: list[dict], steps: int | None) -> dict[str, float]:
    """Asserts the chaos invariants; returns figures (commits, rollbacks, views). ``steps``: the
    last step training must have reached (None: a run that ended on StateLostError)."""
    by_view_step: dict[tuple[int, int], set[str]] = defaultdict(set)
    by_pid: dict[int, list[int]] = defaultdict(list)
    for r in records:
        by_view_step[(r["view"], r["step"])].add(r["sha"])
        by_pid[r["pid"]].append(r["step"])
    divergent = {k: v for k, v in by_view_step.items() if len(v) > 1}
    assert not divergent, f"replicas diverged at (view, step): {sorted(divergent)}"
    for pid, seq in by_pid.items():
        # Each commit moves one step on (or jumps forward when a worker takes a further commit
        # from another rank at a sync); it never goes back or repeats.
        assert all(b > a for a, b in itertools.pairwise(seq)), f"worker {pid} committed steps {seq}: a step went back or repeated"
    if steps is not None:
        assert max(r["step"] for r in records) == steps, "training did not reach its last step"
    # Why no check across views: a collective can finish on one rank and fail on the others (the
    # rank got every frame before a peer died). That rank commits the step alone; if it is then
    # dropped from the world, the survivors redo the step in their new world, rightly. What must
    # hold is above: no worker ever goes back on a step it committed or applies one twice.
    return {"commits": len(records), "views": len({r["view"] for r in records})}


def recovery_times(run: Run, records: list[dict]) -> list[float]:
    """For each fault: seconds from it to the first commit of a newer view."""
    times = []
    for at, _kind, _pid in run.faults:
        before = [r["view"] for r in records if r["time"] <= at]
        view = max(before) if before else 0
        after = [r["time"] for r in records if r["time"] > at and r["view"] > view]
        if after:
            times.append(min(after) - at)
    return times


def coordinator_address(run: Run, timeout_s: float = 30.0) -> str:
    """The address the launcher's coordinator listens on, from its first line of output."""
    marker = "coordinator at "
    line = run.wait_for_line(marker, timeout_s)
    assert marker in line, f"unexpected first line {line!r}"
    return line.split(marker, 1)[1].split(";", 1)[0].strip()


def start_worker(address: str, log: Path, steps: int, pause_s: float, *, worker: str = WORKER,
                 env: dict[str, str] | None = None, output: Path | None = None) -> subprocess.Popen[bytes]:
    """One more worker process for a running job, outside the launcher. Its output goes to a
    pipe (read with communicate() at its end), or to the file ``output``: a worker that writes
    more than a pipe holds (64 KiB) blocks in its next write until someone reads."""
    env = {**os.environ, "RINGSERVE_COORDINATOR": address, "RINGSERVE_ELASTIC_TIMEOUT_S": "60",
           "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60", "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = [sys.executable, worker, str(log), str(steps), str(pause_s)]
    if output is None:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with output.open("ab") as sink:
        return subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT)


RESUMED = re.compile(r"resuming from (?:the checkpoint of )?commit (\d+)")


def resumed_steps(out: str) -> set[int]:
    """The commits a world resumed from after losing every holder of the last one, as logged."""
    return {int(m.group(1)) for m in RESUMED.finditer(out)}


def check_no_silent_regression(records: list[dict], out: str) -> list[tuple[int, int]]:
    """Asserts that the job's committed step never went back, except to just after a commit the
    output says a world resumed from; returns each such drop as (from step, to step).

    Views are taken in their order (the coordinator numbers them): a view's first commit may
    repeat the furthest step of the views before it (survivors redo the step that one rank
    committed alone before the view broke), never fall below it unless a resume was logged. In
    view order, not time order: a process stopped (SIGSTOP) in the middle of a commit writes that
    commit's record, of its old view, only once it runs again.
    """
    allowed = resumed_steps(out)
    by_view: dict[int, list[int]] = defaultdict(list)
    for r in records:
        by_view[r["view"]].append(r["step"])
    furthest = -1
    drops = []
    for view in sorted(by_view):
        first = min(by_view[view])
        if first < furthest:
            assert first - 1 in allowed, (
                f"the job's committed step went back from {furthest} to {first} (view {view}) "
                f"with no resume logged (resumes logged from {sorted(allowed)})"
            )
            drops.append((furthest, first))
            furthest = first
        furthest = max(furthest, *by_view[view])
    return drops


def wait_for_fresh_syncs(hold: Path, count: int, timeout_s: float, ignore: set[int] | frozenset[int] = frozenset()) -> set[int]:
    """The pids of fresh workers held before taking the state (HOLD_FRESH_SYNC, see commit_log.py),
    once there are ``count`` of them. ``ignore``: pids that do not count (the workers started
    first: one slow to start was held at its first sync too, until the hold timed out)."""
    deadline = time.time() + timeout_s
    while True:
        pids = {int(line) for line in hold.read_text().splitlines() if line.strip()} if hold.exists() else set()
        pids -= ignore
        if len(pids) >= count:
            return pids
        assert time.time() < deadline, f"only {len(pids)} of {count} restarted workers came to take the state"
        time.sleep(0.02)


def kill_together(run: Run, pids: list[int]) -> float:
    """SIGKILLs ``pids`` in the same millisecond; returns when."""
    at = time.time()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.faults += [(at, f"kill -9 x{len(pids)}", pid) for pid in pids]
    return at


def wait_for_world(run: Run, workers: int, timeout_s: float) -> None:
    """Waits until ``workers`` processes have committed in one view (a slow starter can miss the
    first view and join later, fresh)."""
    deadline = time.time() + timeout_s
    while True:
        records = run.records()
        if any(len({r["pid"] for r in records if r["view"] == v}) >= workers for v in {r["view"] for r in records}):
            return
        assert time.time() < deadline, f"the {workers} workers never trained in one view"
        time.sleep(0.05)


def save_timeline(name: str, run: Run, records: list[dict]) -> None:
    """With CHAOS_TIMELINE_DIR set, writes this run's failover timeline there as JSON, for
    benchmarks/plots.py: every commit (pid, time, view, step) and every fault, times from the start."""
    directory = os.environ.get("CHAOS_TIMELINE_DIR")
    if not directory:
        return
    import datetime

    out = Path(directory) / (re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "failover", "name": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cores": os.cpu_count(), "load_average": [round(x, 1) for x in os.getloadavg()]},
        "faults": [{"time": round(at - run.started, 3), "kind": kind, "pid": pid} for at, kind, pid in run.faults],
        "commits": [{"time": round(r["time"] - run.started, 3), "pid": r["pid"], "view": r["view"], "step": r["step"]}
                    for r in records],
        "recovery_s": [round(t, 3) for t in recovery_times(run, records)],
    }, indent=1) + "\n")

