"""Would heartbeats sent from a thread of their own outlast starvation better than the event loop's?

One process beats twice a second two ways at once: a task on its asyncio loop (as a worker
heartbeats today, ringserve/worker/control/loops.py) and a plain thread that sleeps between
beats (what a heartbeat thread would do, without the gRPC call). Reported: each one's longest gap
between two beats, under

- ``starved``: the process beside ``--stress`` busy processes and whatever else the machine runs
  (a noisy neighbour; 256 workers on 2 cores);
- ``blocked``: its loop blocked ``--block-s`` s at a time by a call that releases the GIL (a
  ``time.sleep`` in a callback: a long C call, a held lock);
- ``busy``: its loop kept ``--block-s`` s at a time in pure Python (holding the GIL, which the
  interpreter hands the thread every switch interval).

SIGSTOP is not measured: it stops every thread at once, so a thread buys nothing there.

    python benchmarks/heartbeat_thread.py --seconds 20 --stress 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time

BEAT_S = 0.5


def longest_gap(times: list[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def measure(mode: str, seconds: float, block_s: float) -> dict[str, float]:
    loop_beats: list[float] = []
    thread_beats: list[float] = []
    done = threading.Event()

    def thread_beat() -> None:
        while not done.wait(BEAT_S):
            thread_beats.append(time.monotonic())

    thread = threading.Thread(target=thread_beat, daemon=True)
    thread.start()
    end = time.monotonic() + seconds
    next_block = time.monotonic() + 2.0
    try:
        while time.monotonic() < end:
            loop_beats.append(time.monotonic())
            if mode != "starved" and time.monotonic() >= next_block:
                if mode == "blocked":
                    time.sleep(block_s)  # noqa: ASYNC251 - the point: the loop is blocked, the GIL free
                else:
                    until = time.monotonic() + block_s
                    while time.monotonic() < until:
                        pass
                next_block = time.monotonic() + 3.0
            await asyncio.sleep(BEAT_S)
    finally:
        done.set()
        thread.join()
    return {"loop_longest_gap_s": round(longest_gap(loop_beats), 3),
            "thread_longest_gap_s": round(longest_gap(thread_beats), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--stress", type=int, default=4, help="busy processes at nice 0 for the starved case")
    parser.add_argument("--block-s", type=float, default=4.5)
    ns = parser.parse_args()
    result: dict[str, object] = {"cpus": os.cpu_count(), "beat_s": BEAT_S}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(ns.stress)]
    try:
        result["starved"] = {**asyncio.run(measure("starved", ns.seconds, ns.block_s)), "load": os.getloadavg()[0]}
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    result["blocked"] = asyncio.run(measure("blocked", ns.seconds, ns.block_s))
    result["busy"] = asyncio.run(measure("busy", ns.seconds, ns.block_s))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
