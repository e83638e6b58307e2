"""The coordinator at scale: N simulated workers over the real gRPC API.

The coordinator runs in its own process (``ringserve coordinator``), so that its CPU time can be
read from /proc; the simulated workers (tests/swarm.py) run 500 to a process, each with its own
connection, and Join, hold a WatchView stream and heartbeat through the real worker's client (on
one Heartbeats stream each; see ringserve/worker/control/client.py) at the interval the coordinator
hands out (it stretches it past 1,000 workers, see ringserve/coordinator/pacing.py). For each N:

- first view: from the last Join's answer to the harness receiving the view of all N (and to the
  last worker receiving it);
- steady windows (``--rounds`` of ``--steady`` s): the coordinator's CPU per heartbeat (its
  process CPU time over the window divided by the heartbeats answered in it, ticks and
  everything else included), heartbeat latency p50 and p99 as the simulated workers saw it, and
  as a probe in the harness's process saw it (a unary call every 0.1 s from a client not sharing
  its process with 500 others: the coordinator's own share of the latency);
- Status: the time of a full answer (every member) and of the CLI's (summary and 20 members),
  and of the whole ``ringserve status`` command (a new Python process);
- failures: 10% of the workers go silent at once; the time from then to the view without them,
  and whether that was one view; and that no live worker was ever declared dead;
- then, on the same coordinator and the 90% left, unary calls and the stream compared in
  interleaved windows (unary, stream, stream, unary, ...): CPU per heartbeat and latency of each
  (``compared_*``; ``--no-compare`` skips it). Unary heartbeats may overload a loaded machine,
  which is why they come last.

The load average is recorded at the start and end of each N and in each window: on a shared
machine the latencies follow the load, the CPU per heartbeat much less.

Targets at 2,000: first view within settle + 2 s, p99 heartbeat under 50 ms, failure view
within heartbeat_timeout + 1 s, nobody live declared dead, ``ringserve status`` within 1 s. The
simulated workers share the machine with the coordinator, so on a small machine their own CPU
shows in the latencies. On a quiet machine, the 2,000-worker figures alone:

    python benchmarks/coordinator_scale.py --workers 2000 --json coordinator_2000.json

and all of them: ``--workers 100 500 1000 2000`` (the default). ``--max-heartbeats-per-second 0``
keeps the interval at ``--interval`` whatever N (the coordinator's stretching off).
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
from ringserve.worker.control.client import REOPEN_FIRST_S  # noqa: E402


async def measure(
    n: int, *, interval: float, timeout: float, settle: float, steady_s: float, rounds: int, compare: bool,
    max_rate: float | None = None,
) -> dict[str, Any]:
    procs = max(1, (n + 499) // 500)
    load_start = os.getloadavg()[0]
    extra = [] if max_rate is None else ["--max-heartbeats-per-second", str(max_rate)]
    async with Scale(n, procs=procs, interval=interval, timeout=timeout, settle=settle, extra_args=extra) as scale:
        await scale.start_swarms()
        first = await scale.wait_view(lambda v: len(v.members) == n, settle + 60)
        longest = max(interval, timeout / 3)  # the interval, however far the coordinator stretches it
        await asyncio.sleep(2 * longest)
        windows = {"stream": [await window(scale, steady_s) for _ in range(rounds)]}
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
        # Then unary and stream compared on this coordinator and these workers (the 90% left),
        # in interleaved windows (unary, stream, stream, unary, ...), so that a drift in the
        # machine's load falls on both alike. Last, because unary heartbeats may overload it.
        compared: dict[str, list[dict[str, Any]]] = {"stream": [], "unary": []}
        views_before = len(scale.views)
        mode = "stream"
        for wanted in [m for r in range(rounds if compare else 0) for m in (("unary", "stream"), ("stream", "unary"))[r % 2]]:
            if wanted != mode:
                await scale.broadcast(wanted)
                mode = wanted
                await asyncio.sleep(2 * longest + REOPEN_FIRST_S)  # every worker beats the new way by now
            compared[mode].append(await window(scale, steady_s))
        result: dict[str, Any] = {
            "workers": n,
            "swarm_processes": procs,
            "load_start": load_start,
            "first_view_s": first.at - scale.joined_at,
            "first_view_all_workers_s": max(final["first_view_at"]) - scale.joined_at,
            "interval_handed_out_s": windows["stream"][-1]["interval"],
        }
        result.update(summarize("stream", windows["stream"]))
        result.update({
            "status_full_s": status_s[0],
            "status_cli_s": status_s[1],
            "status_command_s": status_command_s,
            "failure_view_s": failure.at - began,
            "failure_views": len(views_after),
            "failure_one_view": len(views_after) == 1 and set(failure.failed) == gone,
            "live_declared_dead": len(declared - gone) + final["unknown"],
            "live_told_unknown": final["unknown"],
            # Each view after the failure: seconds after it, members, and how many it dropped.
            "views_after_failure": [(round(v.at - began, 2), len(v.members), len(v.failed)) for v in views_after],
            "live_missed_heartbeats": final["missed"],
            # The longest a live simulated worker went between two heartbeats it sent (its swarm's
            # own lag included): past the timeout it is dropped, whatever the latencies say.
            "live_longest_gap_s": final["longest_gap"],
            "coordinator_rss_mb": scale.coordinator_rss_bytes() / 2**20,
        })
        for name, measured in compared.items():
            if measured:
                result.update(summarize(f"compared_{name}", measured))
        result.update({
            "compared_views": [(v.view_id, len(v.members), len(v.failed)) for v in scale.views[views_before:]],
            "load_end": os.getloadavg()[0],
        })
        return result


async def window(scale: Scale, steady_s: float) -> dict[str, Any]:
    """One steady window: the coordinator's CPU per heartbeat and the latencies in it."""
    cpu0, before = scale.coordinator_cpu_s(), await scale.report()
    views_before = len(scale.views)
    window_start = time.monotonic()
    probe, interval = await probe_heartbeats(scale, steady_s)
    cpu1, after = scale.coordinator_cpu_s(), await scale.report()
    window_end = time.monotonic()
    beats = after["heartbeats"] - before["heartbeats"]
    latencies = [lat for sent, lat in after["latencies"] if window_start <= sent < window_end]
    return {
        "cpu_ms_per_heartbeat": 1e3 * (cpu1 - cpu0) / max(beats, 1),
        "coordinator_cpu_share": (cpu1 - cpu0) / (window_end - window_start),
        "heartbeats_per_s": beats / (window_end - window_start),
        "latencies": latencies,
        "probe": probe,
        "streaming": after["streaming"],
        "missed": after["missed"] - before["missed"],
        "longest_gap": after["longest_gap"],
        "views": [(v.view_id, len(v.members), len(v.failed)) for v in scale.views[views_before:]],
        "interval": interval,
        "load": os.getloadavg()[0],
    }


def summarize(mode: str, windows: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's windows: CPU per heartbeat (median and range over windows), latencies pooled."""
    cpu = sorted(w["cpu_ms_per_heartbeat"] for w in windows)
    latencies = [lat for w in windows for lat in w["latencies"]]
    probe = [lat for w in windows for lat in w["probe"]]
    return {
        f"{mode}_windows": len(windows),
        f"{mode}_cpu_ms_per_heartbeat": cpu[len(cpu) // 2],
        f"{mode}_cpu_ms_range": [cpu[0], cpu[-1]],
        f"{mode}_coordinator_cpu_share": sum(w["coordinator_cpu_share"] for w in windows) / len(windows),
        f"{mode}_heartbeats_per_s": sum(w["heartbeats_per_s"] for w in windows) / len(windows),
        f"{mode}_heartbeat_p50_ms": 1e3 * percentile(latencies, 0.5),
        f"{mode}_heartbeat_p99_ms": 1e3 * percentile(latencies, 0.99),
        f"{mode}_probe_p99_ms": 1e3 * percentile(probe, 0.99),
        f"{mode}_streaming_workers": min(w["streaming"] for w in windows),
        f"{mode}_missed": sum(w["missed"] for w in windows),  # beats unanswered within 5 s
        f"{mode}_longest_gap_s": max(w["longest_gap"] for w in windows),  # so far, between two beats sent
        f"{mode}_views": [v for w in windows for v in w["views"]],  # views formed in the windows
        f"{mode}_load": [round(w["load"], 1) for w in windows],
    }


async def probe_heartbeats(scale: Scale, duration_s: float) -> tuple[list[float], float]:
    """Heartbeat latencies of a lone client (an unknown worker id: the full unary RPC path, no
    state), and the heartbeat interval the coordinator hands out."""
    latencies = []
    interval = 0.0
    stop = time.monotonic() + duration_s
    while time.monotonic() < stop:
        began = time.monotonic()
        answer = await scale.stub.Heartbeat(pb.HeartbeatRequest(worker_id="benchmark-probe"), timeout=10)
        latencies.append(time.monotonic() - began)
        interval = answer.heartbeat_interval_s
        await asyncio.sleep(max(0.0, began + 0.1 - time.monotonic()))
    return latencies, interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[100, 500, 1000, 2000])
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (s), before any stretching")
    parser.add_argument("--max-heartbeats-per-second", type=float, default=None, dest="max_rate",
                        help="the coordinator's --max-heartbeats-per-second (its default: 1000; 0: never stretch)")
    parser.add_argument("--timeout", type=float, default=5.0, help="heartbeat timeout (s)")
    parser.add_argument("--settle", type=float, default=1.0, help="settle window (s)")
    parser.add_argument("--steady", type=float, default=10.0, help="each steady window measured (s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="steady stream windows per N, and unary/stream window pairs compared after (ABBA order)")
    parser.add_argument("--no-compare", action="store_true", help="measure the stream only, no unary windows")
    parser.add_argument("--json", help="also write the results to this file")
    ns = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    results = []
    for n in ns.workers:
        result = asyncio.run(measure(n, interval=ns.interval, timeout=ns.timeout, settle=ns.settle,
                                     steady_s=ns.steady, rounds=ns.rounds, compare=not ns.no_compare,
                                     max_rate=ns.max_rate))
        results.append(result)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    header = ("workers", "load", "first view", "CPU/heartbeat stream (compared: stream vs unary)",
              "p50 / p99 heartbeat stream", "p99 unary (compared)", "Status (CLI)", "status command", "failure view", "views", "live dropped")
    print(" | ".join(header))
    for r in results:
        unary = ""
        if "compared_unary_cpu_ms_per_heartbeat" in r:
            unary = f" ({r['compared_stream_cpu_ms_per_heartbeat']:.2f} vs {r['compared_unary_cpu_ms_per_heartbeat']:.2f})"
        print(" | ".join([
            str(r["workers"]), f"{r['load_start']:.1f}-{r['load_end']:.1f}", f"{r['first_view_s']:.2f} s",
            f"{r['stream_cpu_ms_per_heartbeat']:.2f}{unary} ms",
            f"{r['stream_heartbeat_p50_ms']:.0f} / {r['stream_heartbeat_p99_ms']:.0f} ms",
            f"{r['compared_unary_heartbeat_p99_ms']:.0f} ms" if "compared_unary_heartbeat_p99_ms" in r else "-",
            f"{r['status_cli_s'] * 1e3:.0f} ms", f"{r['status_command_s']:.2f} s", f"{r['failure_view_s']:.2f} s",
            str(r["failure_views"]), str(r["live_declared_dead"]),
        ]))
    if ns.json:
        pathlib.Path(ns.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
