"""Hierarchical allreduce against the flat ring, on emulated hosts of several workers each.

    sudo python benchmarks/hierarchical.py --hosts 2 --per-host 2 --size 8M --rate-mbit 200 --delay-ms 5

Each host is a network namespace behind a shaped link (benchmarks/_netem.py). Its workers are each
in a PID namespace of their own (as containers are) and share a directory of their host only
(RINGSERVE_SHARED_DIR), so the workers of one host pass payloads through shared memory (handed
over the directory's Unix sockets), and workers on different hosts cannot: every byte between
hosts crosses the emulated network. Hosts are told apart by RINGSERVE_HOSTNAME, ranks placed host
by host. In each round the flat ring (RINGSERVE_HIERARCHICAL=0) and the hierarchical allreduce
(``auto``) run one after the other, each with fresh processes; the table gives the median over
the rounds of the slowest rank's time per op, the paired ratio hierarchical / flat within each
round, the IP bytes each host sent per op (the switch's count: headers and ACKs included) and the
share of the payload bytes its workers sent through shared memory.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import OPEN_COORDINATOR, PYTHON, read_json, table
from _netem import Wan, read_counters
from allreduce import parse_size


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import ringserve as rs
    from ringserve import api

    rs.init()
    counters = api.context().worker.counters
    a = np.ones(parse_size(args.size) // 4, dtype=np.float32)
    for _ in range(2):
        rs.allreduce(a, op="average", name="bench", out=a)
    rs.barrier()
    wire0, sent0, shared0 = read_counters(args.counters), counters.bytes_sent, counters.shared_bytes_sent
    t0 = time.perf_counter()
    for _ in range(args.ops):
        rs.allreduce(a, op="average", name="bench", out=a)
    took = (time.perf_counter() - t0) / args.ops
    rs.barrier()
    wire = [(b - w) / args.ops for w, b in zip(wire0, read_counters(args.counters), strict=True)]
    pathlib.Path(args.out).write_text(json.dumps({
        "t": took, "wire": wire, "done": counters.collectives_done,
        "shared": (counters.shared_bytes_sent - shared0) / max(1, counters.bytes_sent - sent0)}))
    rs.shutdown()


def run_config(wan: Wan, args: argparse.Namespace, tmp: pathlib.Path, mode: str, port: int) -> list[dict]:
    world = args.hosts * args.per_host
    host0 = wan.hosts[0]
    coordinator = subprocess.Popen(wan.command(host0, [PYTHON, "-m", "ringserve.cli", "coordinator", "--host", host0.address,
                                                       "--port", str(port), "--min-workers", str(world),
                                                       "--max-workers", str(world)], OPEN_COORDINATOR))
    procs, outs = [], []
    try:
        wan.wait_listening(host0, port, timeout_s=30)
        me = str(pathlib.Path(__file__).resolve())
        for h in wan.hosts:
            shared = tmp / f"{mode}-h{h.index}"
            shared.mkdir()
            for j in range(args.per_host):
                rank = h.index * args.per_host + j
                out = tmp / f"{mode}.{rank}.json"
                outs.append(out)
                env = {"RINGSERVE_COORDINATOR": f"{host0.address}:{port}", "RINGSERVE_BIND_HOST": h.address,
                       "RINGSERVE_HOSTNAME": f"h{h.index}", "RINGSERVE_SHARED_DIR": str(shared),
                       "RINGSERVE_HIERARCHICAL": mode, "RINGSERVE_RANK_HINT": str(rank), "OMP_NUM_THREADS": "1"}
                argv = ["unshare", "--pid", "--fork", "--mount-proc", PYTHON, me, "--role", "worker", "--size", args.size,
                        "--ops", str(args.ops), "--counters", wan.counters_path, "--out", str(out)]
                procs.append(subprocess.Popen(wan.command(h, argv, env)))
        deadline = time.monotonic() + args.timeout_s
        for i, p in enumerate(procs):
            if p.wait(max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"{mode}: rank {i} exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        coordinator.terminate()
        coordinator.wait(10)
    wan.check_switch()
    return [read_json(o) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--size", default="8M")
    p.add_argument("--ops", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=200)
    p.add_argument("--delay-ms", type=float, default=5)
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--role", choices=["main", "worker"], default="main")
    p.add_argument("--counters", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.role == "worker":
        return worker(args)
    modes = {"flat ring": "0", "hierarchical": "auto"}
    results: dict[str, list[list[dict]]] = {m: [] for m in modes}
    load0 = os.getloadavg()[0]
    port = 51800
    with tempfile.TemporaryDirectory() as tmp, Wan(args.hosts, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit) as wan:
        for r in range(args.rounds):
            for label, mode in modes.items():
                port += 1
                round_dir = pathlib.Path(tmp) / f"r{r}"
                round_dir.mkdir(exist_ok=True)
                results[label].append(run_config(wan, args, round_dir, mode, port))
                print(f"round {r + 1}: {label}", file=sys.stderr, flush=True)
    flat = [max(w["t"] for w in run) for run in results["flat ring"]]
    rows = []
    for label in modes:
        t = [max(w["t"] for w in run) for run in results[label]]
        ratios = [x / y for x, y in zip(t, flat, strict=True)]
        wire = [statistics.median(run[0]["wire"][h] for run in results[label]) for h in range(args.hosts)]
        rows.append({"label": label, "ms": f"{statistics.median(t) * 1e3:.0f} [{min(t) * 1e3:.0f} - {max(t) * 1e3:.0f}]",
                     "ratio": f"{statistics.median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}]",
                     "wire": " / ".join(f"{w / 2**20:.2f}" for w in wire),
                     "shared": "{:.2f} - {:.2f}".format(min(w["shared"] for run in results[label] for w in run),
                                                          max(w["shared"] for run in results[label] for w in run))})
    print(f"allreduce of {args.size} float32, {args.hosts} hosts x {args.per_host} workers, {args.rate_mbit:g} Mbit/s, "
          f"{args.delay_ms:g} ms one way; {args.rounds} rounds; load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(table(rows, [("label", "allreduce"), ("ms", "ms/op [range]"), ("ratio", "/ flat, paired [range]"),
                       ("wire", "MiB on the wire per op, per host"), ("shared", "payload share through shared memory, by rank")]))


if __name__ == "__main__":
    main()
