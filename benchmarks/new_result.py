"""A new result per call against in place, interleaved in the same workers.

    python benchmarks/new_result.py                          # worlds 2 and 4; 1 MiB and 64 MiB
    python benchmarks/new_result.py --worlds 4 --sizes 64M --rounds 8 --pool-bytes 0   # no pool

``out = rs.allreduce(x)`` is the common usage; ``rs.allreduce(x, out=x)`` is what gloo's
all_reduce does. Each worker alternates batches of the two in the same processes (which one goes
first alternates from round to round), so both see the same machine load, and the table gives, per
world, size and lane (shared memory on one host, and with RINGSERVE_SHARED_MEMORY=0, as between
hosts: the TCP payload lane, or the gRPC stream with ``--lanes stream`` and RINGSERVE_PAYLOAD_LANE=off),
the median ms per op of each, and the paired ratio new / in place within each round:
its median and its range over the rounds. The new-result loop keeps the last result alive until the
next call returns, as ``out = rs.allreduce(x)`` in a loop does. ``--pool-bytes`` sets
RINGSERVE_RESULT_POOL_BYTES (0: no pool of result buffers, see ringserve/worker/dataplane/pool.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import PYTHON, read_json, run_ranks, table
from allreduce import parse_size


def per_batch(size: int) -> int:
    return max(3, min(40, (192 << 20) // size))


def measure(rs: Any, size: int, rounds: int) -> dict[str, list[float]]:
    """Per-op times of each mode, one per round, the modes' batches interleaved."""
    a = np.ones(size // 4, dtype=np.float32)
    n = per_batch(size)
    kept: list[np.ndarray] = []

    def in_place() -> None:
        rs.allreduce(a, op="average", name="bench", out=a)

    def new_result() -> None:
        out = rs.allreduce(a, op="average", name="bench")
        kept[:] = [out]  # the last result lives until the next one is back

    modes = {"in_place": in_place, "new": new_result}
    for fn in modes.values():  # warm-up: the first calls fault the pool in
        fn()
        fn()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for m in order:
            rs.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                modes[m]()
            times[m].append((time.perf_counter() - t0) / n)
    return times


def worker(args: argparse.Namespace) -> None:
    import ringserve as rs
    from ringserve import api

    rs.init()
    pool = api.context().worker.node.planes.pool  # read only: how many results it handed out again
    results = {str(size): {**measure(rs, size, args.rounds), "reused": [float(pool.reused)]} for size in args.sizes}
    pathlib.Path(args.out).write_text(json.dumps(results))
    rs.shutdown()


def run_world(world: int, args: argparse.Namespace, tmp: pathlib.Path, shared: bool) -> list[dict[str, object]]:
    from ringserve import Coordinator, CoordinatorConfig
    from ringserve.loop import LoopThread

    thread = LoopThread(use_uvloop=True)
    coord = Coordinator(CoordinatorConfig(min_workers=world, max_workers=world, settle_s=0.1))
    thread.run(coord.start(), 10)
    tag = f"{'shm' if shared else 'stream'}{world}"
    env = {"RINGSERVE_COORDINATOR": coord.address, "RINGSERVE_SHARED_MEMORY": "1" if shared else "0"}
    if not shared and args.stream_only:
        env["RINGSERVE_PAYLOAD_LANE"] = "off"
    if args.pool_bytes is not None:
        env["RINGSERVE_RESULT_POOL_BYTES"] = str(args.pool_bytes)
    me = str(pathlib.Path(__file__).resolve())
    try:
        run_ranks([[PYTHON, me, "--role", "worker", "--rounds", str(args.rounds), "--out", str(tmp / f"{tag}.{i}.json"),
                    "--sizes", *args.size_args] for i in range(world)], env, timeout_s=1200)
    finally:
        thread.run(coord.stop(0.1), 10)
        thread.stop()
    rows = []
    per_rank = [read_json(tmp / f"{tag}.{i}.json") for i in range(world)]
    for size in args.sizes:
        # a round's time is its slowest rank's
        inp = [max(r[str(size)]["in_place"][k] for r in per_rank) for k in range(args.rounds)]
        new = [max(r[str(size)]["new"][k] for r in per_rank) for k in range(args.rounds)]
        ratios = [x / y for x, y in zip(new, inp, strict=True)]
        rows.append({
            "world": world, "size": f"{size >> 20} MiB", "lane": "shared memory" if shared else ("stream-only" if args.stream_only else "payload lane"),
            "inp": f"{statistics.median(inp) * 1e3:.1f}", "new": f"{statistics.median(new) * 1e3:.1f}",
            "ratio": f"{statistics.median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}]",
            "reused": int(min(r[str(size)]["reused"][0] for r in per_rank)),
        })
    return rows


COLUMNS = [("world", "world"), ("size", "size"), ("lane", "lane"), ("inp", "in place ms/op"),
           ("new", "new result ms/op"), ("ratio", "new / in place, paired [range]"),
           ("reused", "results reused (so far)")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", nargs="+", default=["1M", "64M"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--lanes", nargs="+", choices=["shm", "stream"], default=["shm", "stream"],
                   help="shm: shared memory on; stream: shared memory off (the TCP payload lane carries the payloads)")
    p.add_argument("--stream-only", action="store_true", help="with shared memory off, the payload lane off too")
    p.add_argument("--pool-bytes", type=int, default=None, help="RINGSERVE_RESULT_POOL_BYTES for the workers")
    p.add_argument("--role", choices=["main", "worker"], default="main")
    p.add_argument("--out", default="")
    args = p.parse_args()
    args.size_args = list(args.sizes)
    args.sizes = [parse_size(s) for s in args.sizes]
    if args.role == "worker":
        return worker(args)
    rows = []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for lane in args.lanes:
                rows += run_world(world, args, pathlib.Path(tmp), lane == "shm")
    print(f"allreduce average of float32, new result against in place; {args.rounds} interleaved rounds; "
          f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores")
    print(table(rows, COLUMNS))


if __name__ == "__main__":
    main()
