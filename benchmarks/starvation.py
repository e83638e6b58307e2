"""False failures under CPU starvation: N simulated workers, busy processes, random stops, kills.

The coordinator runs in its own process (``ringserve coordinator``, default heartbeat settings:
1 s interval, 5 s timeout); N simulated workers (tests/swarm.py: Join, a WatchView stream, and
heartbeats through the real worker's client) run ``--per-process`` to a process, so that a
stopped process stands for a stopped worker host or a worker's paused process. Then, for
``--duration`` s:

- ``--stress`` busy processes compete for the CPUs with everything else (a noisy neighbour);
- every ``--stop-every`` s (on average, exponential gaps), one swarm process chosen at random is
  stopped (SIGSTOP) for ``--stop-s`` s and then let go on (SIGCONT): every thread of its
  workers stops, as in a GC pause or a starved process;
- every ``--coordinator-stop-every`` s (0: never), the coordinator's own process is stopped for
  ``--coordinator-stop-s`` s.

Nothing in that time may be declared dead: every worker declared failed is a **false failure**.
Then ``--kill`` swarm processes are killed (SIGKILL) at once, and the **detection time** is from
the kill to the view without every one of their workers (the heartbeat path only: simulated
workers have no ring peers to report them).

Reported: the false failures (workers, and the stops they followed), the stops made, the
detection time and the views it took, the load average, and the longest gap a live simulated
worker saw between two heartbeats it sent (its own starvation). Each false failure is explained
from the coordinator's INFO log (``--coordinator-log``): the reason it was removed for, the
probes of it (seconds before the removal, why, the answer), and how long before the removal its
own swarm and the coordinator were last stopped.

    python benchmarks/starvation.py --workers 256 --stress 4 --duration 60 --stop-s 4.5 --stop-every 1 \
        --coordinator-stop-every 12 --kill 3 --json starvation.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from swarm import Scale  # noqa: E402

BUSY = "while True: pass"


async def stopping(proc: asyncio.subprocess.Process, seconds: float, stops: list[tuple[float, int, float]]) -> None:
    """Stops ``proc`` for ``seconds``, and records (when, pid, seconds)."""
    stops.append((time.monotonic(), proc.pid, seconds))
    proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGCONT)


async def measure(ns: argparse.Namespace) -> dict[str, Any]:
    n, per = ns.workers, ns.per_process
    procs = max(1, n // per)
    rng = random.Random(ns.seed)
    log = ns.coordinator_log or str(pathlib.Path(tempfile.mkdtemp(prefix="starvation-")) / "coordinator.log")
    wall = time.time() - time.monotonic()  # the log's clock, less the harness's
    async with Scale(n, procs=procs, interval=ns.interval, timeout=ns.timeout, settle=1.0,
                     extra_args=ns.coordinator_args, health=True, log=log) as scale:
        await scale.start_swarms()
        await scale.wait_view(lambda v: len(v.members) == n, 120)
        shares = [n // procs + (i < n % procs) for i in range(procs)]
        owners = {w: scale.swarms[i] for i in range(procs)
                  for w in scale.ids[sum(shares[:i]):sum(shares[:i + 1])]}
        load_start = os.getloadavg()[0]
        began = time.monotonic()
        stops: list[tuple[float, int, float]] = []
        coordinator_stops: list[tuple[float, int, float]] = []
        pending: set[asyncio.Task[None]] = set()
        next_stop = began + rng.expovariate(1 / ns.stop_every)
        next_coordinator = (began + rng.expovariate(1 / ns.coordinator_stop_every)
                            if ns.coordinator_stop_every > 0 else float("inf"))
        while time.monotonic() < began + ns.duration:
            now = time.monotonic()
            if now >= next_stop:
                victim = rng.choice(scale.swarms)
                pending.add(asyncio.create_task(stopping(victim, ns.stop_s, stops)))
                next_stop = now + rng.expovariate(1 / ns.stop_every)
            if now >= next_coordinator:
                assert scale.coordinator is not None
                pending.add(asyncio.create_task(
                    stopping(scale.coordinator, ns.coordinator_stop_s, coordinator_stops)))
                next_coordinator = now + max(ns.coordinator_stop_s + 1,
                                             rng.expovariate(1 / ns.coordinator_stop_every))
            await asyncio.sleep(0.05)
        await asyncio.gather(*pending)
        await asyncio.sleep(ns.timeout + 2)  # a drop after the last stop shows up by now
        churn_end = time.monotonic()
        falsely = {w for v in scale.views if v.at > began for w in v.failed}
        live_report = await scale.report()
        load_churn = os.getloadavg()[0]
        last_view = scale.views[-1].view_id
        killed = [s for s in rng.sample(scale.swarms, ns.kill)]
        gone = {w for w, owner in owners.items() if owner in killed}
        killed_at = time.monotonic()
        for swarm in killed:
            swarm.send_signal(signal.SIGKILL)
        seen = await scale.wait_view(lambda v: v.view_id > last_view and not gone & set(v.members),
                                     ns.timeout + 60)
        await asyncio.sleep(ns.timeout)
        after_kill = [v for v in scale.views if v.view_id > last_view]
        falsely_after_kill = {w for v in after_kill for w in v.failed} - gone
        for swarm in killed:  # Scale's exit must not wait on them
            await swarm.wait()
        scale.swarms = [s for s in scale.swarms if s not in killed]
        dropped_after_stop = sum(
            1 for at, pid, seconds in stops
            if any(owners[w].pid == pid for w in falsely)
        )
        explained = explain(log, wall, falsely | falsely_after_kill, owners, stops, coordinator_stops)
        return {
            "workers": n,
            "swarm_processes": procs,
            "stress_processes": ns.stress,
            "cpus": os.cpu_count(),
            "duration_s": churn_end - began,
            "load_start": load_start,
            "load_churn_end": load_churn,
            "worker_stops": len(stops),
            "worker_stop_s": ns.stop_s,
            "coordinator_stops": len(coordinator_stops),
            "coordinator_stop_s": ns.coordinator_stop_s,
            "false_failures": len(falsely) + len(falsely_after_kill),
            "false_failures_during_churn": len(falsely),
            "stops_followed_by_a_false_failure": dropped_after_stop,
            "views_during_churn": len([v for v in scale.views if began < v.at <= churn_end]),
            "live_longest_gap_s": live_report["longest_gap"],
            "live_missed_heartbeats": live_report["missed"],
            "killed_workers": len(gone),
            "detection_s": seen.at - killed_at,
            "detection_views": len(after_kill),
            "detection_one_view": len(after_kill) == 1 and set(after_kill[0].failed) == gone,
            "load_end": os.getloadavg()[0],
            "removal_reasons": dict(Counter(f["reason"] for f in explained)),
            "false_failure_detail": explained,
            "coordinator_log": log,
        }


LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")


def explain(log: str, wall: float, falsely: set[str], owners: dict[str, Any],
            stops: list[tuple[float, int, float]], coordinator_stops: list[tuple[float, int, float]]) -> list[dict[str, Any]]:
    """Why each false failure happened, from the coordinator's log: its removal's reason, the
    probes of it (when, why, the answer), and how it stood to the stops of its own swarm and of
    the coordinator (seconds from the start of the nearest stop before the removal)."""
    lines: list[tuple[float, str]] = []
    for line in pathlib.Path(log).read_text().splitlines():
        found = LOG_LINE.match(line)
        if found:
            at = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall
            lines.append((at, found.group(2)))

    def last_stop_before(at: float, chosen: list[tuple[float, int, float]]) -> float | None:
        before = [at - began for began, _, _ in chosen if began <= at]
        return round(min(before), 2) if before else None

    detail = []
    for w in sorted(falsely):
        removed = [(at, text) for at, text in lines if text.startswith(f"worker {w} removed: ")]
        at = removed[0][0] if removed else float("nan")
        own = [s for s in stops if s[1] == owners[w].pid]
        detail.append({
            "worker": w,
            "reason": removed[0][1].split(": ", 1)[1] if removed else "(not in the log)",
            "probes": [(round(t - at, 2), text.split(" (", 1)[1]) for t, text in lines
                       if text.startswith(f"probe of worker {w} ")],
            "own_stop_s_before": last_stop_before(at, own),
            "coordinator_stop_s_before": last_stop_before(at, coordinator_stops),
        })
    return detail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--per-process", type=int, default=8, help="simulated workers in each swarm process")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (s)")
    parser.add_argument("--timeout", type=float, default=5.0, help="heartbeat timeout (s)")
    parser.add_argument("--stress", type=int, default=4, help="busy processes competing for the CPUs")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of stops and starvation")
    parser.add_argument("--stop-every", type=float, default=2.0, help="mean seconds between two worker stops")
    parser.add_argument("--stop-s", type=float, default=3.0, help="how long each stop lasts")
    parser.add_argument("--coordinator-stop-every", type=float, default=30.0,
                        help="mean seconds between two stops of the coordinator (0: never)")
    parser.add_argument("--coordinator-stop-s", type=float, default=6.0, help="how long each coordinator stop lasts")
    parser.add_argument("--kill", type=int, default=3, help="swarm processes killed at once at the end (3 of 32: 9%%)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--coordinator-args", nargs=argparse.REMAINDER, default=[],
                        help="the rest of the line goes to `ringserve coordinator`")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--coordinator-log", default="", help="the coordinator's INFO log (default: a temporary file)")
    ns = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(ns.stress)]
    try:
        result = asyncio.run(measure(ns))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}), flush=True)
    if ns.json:
        pathlib.Path(ns.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
