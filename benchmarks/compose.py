"""Allreduce between containers of one host (docker-compose) against ``ringserve run`` on that host.

    ../shared/tools/docker-engine up && eval "$(../shared/tools/docker-engine env)"
    docker-compose build --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL"
    python benchmarks/compose.py --world 4 --sizes 1M 64M --rounds 3

Each round runs, one after the other (so that each sees the same machine load):

- ``ringserve run -np N`` on the host: workers see each other's /proc, shared memory through it;
- ``docker-compose up --scale worker=N`` with the compose file as shipped: one container per
  worker, each in its own PID namespace, the rings handed over Unix sockets in the shared tmpfs
  volume (RINGSERVE_SHARED_DIR, see ringserve/worker/dataplane/links/fdpass.py);
- the same with RINGSERVE_SHARED_DIR empty: what containers got before, every payload over the
  stream (the bridge network's veth pairs).

Every worker times in-place float32 allreduces (``out=a``, as benchmarks/allreduce.py) and reports
its ms per op and the share of its payload bytes that went through shared memory. The containers
run this file from the repository's benchmarks/ directory, mounted read-only by a compose override
file written for the run; the image, the network and the volume are the shipped compose file's.
The table gives, per size and setup, the median over the rounds of the slowest rank's ms per op,
its range, and the paired ratio to ``ringserve run`` within each round.
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import table  # noqa: E402

MARK = "COMPOSE-BENCH "
PROJECT = "ringserve-bench"


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import ringserve as rs
    from ringserve import api

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from allreduce import parse_size, time_ops

    rs.init()
    counters = api.context().worker.counters
    result = {"rank": rs.rank(), "size": rs.size(), "ms": {}, "shared": {}}
    for text in args.sizes:
        size = parse_size(text)
        a = np.ones(size // 4, dtype=np.float32)
        sent0, shared0 = counters.bytes_sent, counters.shared_bytes_sent
        samples = time_ops(lambda a=a: rs.allreduce(a, op="average", name="bench", out=a), rs.barrier, size)
        result["ms"][text] = statistics.median(samples) * 1e3
        result["shared"][text] = (counters.shared_bytes_sent - shared0) / max(1, counters.bytes_sent - sent0)
    print(MARK + json.dumps(result), flush=True)
    rs.shutdown()


def _worker_argv(args: argparse.Namespace, script: str) -> list[str]:
    return ["python", script, "--role", "worker", "--sizes", *args.sizes]


def _parse(output: str, world: int) -> list[dict]:
    found = [json.loads(line.split(MARK, 1)[1]) for line in output.splitlines() if MARK in line]
    if len(found) != world:
        raise RuntimeError(f"{len(found)} of {world} workers reported:\n{output[-4000:]}")
    return found


def run_host(args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "ringserve.cli", "run", "-np", str(args.world),
            *[sys.executable if a == "python" else a for a in _worker_argv(args, str(ROOT / "benchmarks" / "compose.py"))]]
    out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    if out.returncode:
        raise RuntimeError(f"ringserve run exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return _parse(out.stdout + out.stderr, args.world)


def run_compose(args: argparse.Namespace, override: pathlib.Path, shared_dir: bool) -> list[dict]:
    def dc(*more: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker-compose", "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"),
                               "-f", str(override), "--project-directory", str(ROOT), *more],
                              env=env, capture_output=True, text=True, **kw)  # type: ignore[call-overload]

    env = {**os.environ, "RINGSERVE_MIN_WORKERS": str(args.world), "BENCH_SHARED_DIR": "/run/ringserve" if shared_dir else ""}
    try:
        up = dc("up", "-d", "--no-build", "--scale", f"worker={args.world}", timeout=300)
        if up.returncode:
            raise RuntimeError(f"compose up exited {up.returncode}:\n{up.stdout[-3000:]}{up.stderr[-3000:]}")
        ids = dc("ps", "-q", "worker", timeout=60).stdout.split()
        codes = subprocess.run(["docker", "wait", *ids], capture_output=True, text=True, timeout=args.timeout_s).stdout.split()
        logs = dc("logs", "--no-color", "worker", timeout=120).stdout
        if codes != ["0"] * args.world:
            raise RuntimeError(f"the workers exited {codes}:\n{logs[-4000:]}")
        return _parse(logs, args.world)
    finally:
        dc("down", "-v", "--remove-orphans", timeout=300)


OVERRIDE = """\
services:
  worker:
    command: {command}
    environment:
      RINGSERVE_SHARED_DIR: ${{BENCH_SHARED_DIR}}
    volumes:
      - {bench}:/app/benchmarks:ro
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--sizes", nargs="+", default=["1M", "64M"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--role", choices=["main", "worker"], default="main")
    args = p.parse_args()
    if args.role == "worker":
        return worker(args)
    setups = {"ringserve run": None, "compose, shared dir": True, "compose, stream only": False}
    results: dict[str, list[list[dict]]] = {name: [] for name in setups}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        override = pathlib.Path(tmp) / "bench.yml"
        override.write_text(OVERRIDE.format(command=json.dumps(_worker_argv(args, "benchmarks/compose.py")),
                                            bench=ROOT / "benchmarks"))
        for r in range(args.rounds):
            for name, shared in setups.items():
                t0 = time.monotonic()
                results[name].append(run_host(args) if shared is None else run_compose(args, override, shared))
                print(f"round {r + 1}: {name} in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for size in args.sizes:
        base = [max(w["ms"][size] for w in run) for run in results["ringserve run"]]
        for name in setups:
            ms = [max(w["ms"][size] for w in run) for run in results[name]]
            ratios = [m / b for m, b in zip(ms, base, strict=True)]
            shared = min(min(w["shared"][size] for w in run) for run in results[name])
            rows.append({"size": size, "setup": name, "ms": f"{statistics.median(ms):.1f} [{min(ms):.1f} - {max(ms):.1f}]",
                         "ratio": f"{statistics.median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}]",
                         "shared": f"{shared:.3f}"})
    print(f"in-place float32 allreduce, world {args.world}, {args.rounds} interleaved rounds; load average "
          f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores")
    print(table(rows, [("size", "size"), ("setup", "setup"), ("ms", "ms/op [range]"),
                       ("ratio", "vs ringserve run, paired [range]"), ("shared", "bytes through shared memory")]))


if __name__ == "__main__":
    main()
