"""The coordinator at scale: N simulated workers over the real gRPC API.

The coordinator runs in its own process (``ringserve coordinator``), so that its CPU time can be
read from /proc; the simulated workers (tests/swarm.py) run 500 to a process, each with its own
connection, and Join, hold a WatchView stream and heartbeat every heartbeat interval. For each N:

- first view: from the last Join's answer to the harness receiving the view of all N (and to the
  last worker receiving it);
- coordinator CPU per heartbeat: its process CPU time over a steady window, divided by the
  heartbeats answered in it (ticks and everything else included);
- heartbeat latency, p50 and p99, as the simulated workers saw it in that window, and as a probe
  in the harness's process saw it (one heartbeat every 0.1 s from a client not sharing its
  process with 500 others: the coordinator's own share of the latency);
- Status: the time of a full answer (every member) and of the CLI's (summary and 20 members),
  and of the whole ``ringserve status`` command (a new Python process);
- failures: 10% of the workers go silent at once; the time from then to the view without them,
  and whether that was one view; and that no live worker was ever declared dead.

Targets at 2,000: first view within settle + 2 s, p99 heartbeat under 50 ms, failure view
within heartbeat_timeout + 1 s, nobody live declared dead. The simulated workers share the
machine with the coordinator, so on a small machine their own CPU shows in the latencies.

    python benchmarks/coordinator_scale.py --workers 100 500 1000 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from swarm import Scale, percentile  # noqa: E402

from ringserve._proto import coordinator_pb2 as pb  # noqa: E402


async def measure(n: int, *, interval: float, timeout: float, settle: float, steady_s: float) -> dict[str, Any]:
    procs = max(1, (n + 499) // 500)
    async with Scale(n, procs=procs, interval=interval, timeout=timeout, settle=settle) as scale:
        await scale.start_swarms()
        first = await scale.wait_view(lambda v: len(v.members) == n, settle + 60)
        await asyncio.sleep(2 * interval)
        cpu0, before = scale.coordinator_cpu_s(), await scale.report()
        window_start = time.monotonic()
        probe = await probe_heartbeats(scale, steady_s)
        cpu1, after = scale.coordinator_cpu_s(), await scale.report()
        window_end = time.monotonic()
        beats = after["heartbeats"] - before["heartbeats"]
        latencies = [lat for sent, lat in after["latencies"] if window_start <= sent < window_end]
        status_s = []
        for request in (pb.StatusRequest(), pb.StatusRequest(limit=20)):
            began = time.monotonic()
            await scale.stub.Status(request, timeout=10)
            status_s.append(time.monotonic() - began)
        began = time.monotonic()
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ringserve.cli", "status", "--coordinator", scale.address,
            stdout=asyncio.subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert await cli.wait() == 0
        status_command_s = time.monotonic() - began
        last_view = scale.views[-1].view_id
        silenced, began = await scale.silence(0.1)
        gone = set(silenced)
        failure = await scale.wait_view(lambda v: v.view_id > last_view and not gone & set(v.members), timeout + 30)
        await asyncio.sleep(timeout)  # any later view (a live worker dropped) shows up by now
        final = await scale.report()
        views_after = [v for v in scale.views if v.view_id > last_view]
        declared = {w for v in scale.views for w in v.failed}
        return {
            "workers": n,
            "swarm_processes": procs,
            "first_view_s": first.at - scale.joined_at,
            "first_view_all_workers_s": max(final["first_view_at"]) - scale.joined_at,
            "cpu_ms_per_heartbeat": 1e3 * (cpu1 - cpu0) / max(beats, 1),
            "coordinator_cpu_share": (cpu1 - cpu0) / (window_end - window_start),
            "heartbeats_per_s": beats / (window_end - window_start),
            "heartbeat_p50_ms": 1e3 * percentile(latencies, 0.5),
            "heartbeat_p99_ms": 1e3 * percentile(latencies, 0.99),
            "probe_p50_ms": 1e3 * percentile(probe, 0.5),
            "probe_p99_ms": 1e3 * percentile(probe, 0.99),
            "status_full_s": status_s[0],
            "status_cli_s": status_s[1],
            "status_command_s": status_command_s,
            "failure_view_s": failure.at - began,
            "failure_views": len(views_after),
            "failure_one_view": len(views_after) == 1 and set(failure.failed) == gone,
            "live_declared_dead": len(declared - gone) + final["unknown"],
            "coordinator_rss_mb": scale.coordinator_rss_bytes() / 2**20,
        }


async def probe_heartbeats(scale: Scale, duration_s: float) -> list[float]:
    """Heartbeat latencies of a lone client (an unknown worker id: the full RPC path, no state)."""
    latencies = []
    stop = time.monotonic() + duration_s
    while time.monotonic() < stop:
        began = time.monotonic()
        await scale.stub.Heartbeat(pb.HeartbeatRequest(worker_id="benchmark-probe"), timeout=10)
        latencies.append(time.monotonic() - began)
        await asyncio.sleep(max(0.0, began + 0.1 - time.monotonic()))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[100, 500, 1000, 2000])
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (s)")
    parser.add_argument("--timeout", type=float, default=5.0, help="heartbeat timeout (s)")
    parser.add_argument("--settle", type=float, default=1.0, help="settle window (s)")
    parser.add_argument("--steady", type=float, default=10.0, help="steady window measured (s)")
    parser.add_argument("--json", help="also write the results to this file")
    ns = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    results = []
    for n in ns.workers:
        result = asyncio.run(measure(n, interval=ns.interval, timeout=ns.timeout, settle=ns.settle, steady_s=ns.steady))
        results.append(result)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    header = ("workers", "first view", "CPU/heartbeat", "p99 heartbeat (workers)", "p99 heartbeat (probe)",
              "Status (CLI)", "failure view", "views", "live dropped")
    print(" | ".join(header))
    for r in results:
        print(" | ".join([
            str(r["workers"]), f"{r['first_view_s']:.2f} s", f"{r['cpu_ms_per_heartbeat']:.2f} ms",
            f"{r['heartbeat_p99_ms']:.0f} ms", f"{r['probe_p99_ms']:.0f} ms",
            f"{r['status_cli_s'] * 1e3:.0f} ms", f"{r['failure_view_s']:.2f} s",
            str(r["failure_views"]), str(r["live_declared_dead"]),
        ]))
    if ns.json:
        pathlib.Path(ns.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
