"""What one numpy worker costs in memory, threads and file descriptors (issue 44: 256 workers).

    .venv/bin/python benchmarks/worker_memory.py                 # -np 4, the table per stage
    .venv/bin/python benchmarks/worker_memory.py -np 8 --mappings --tracemalloc

It runs ``ringserve run -np N`` on this script itself as the job (``--worker``): a numpy training
loop, as a user writes one, of allreduces of 4 KiB, 1 MiB and 16 MiB float32 arrays, each checked
exactly against the sum computed locally. Each worker reads its own /proc at each stage (after
``import ringserve``, after ``init`` returns the first view, after the loop, at the end, after a
barrier, and, with ``--idle S``, after S more seconds with nothing sent: what a job keeps between
bursts) and writes them as JSON:

- RSS, and its peak (VmHWM), from /proc/self/status;
- PSS, and USS (private clean and dirty pages: what this process alone costs the machine), from
  /proc/self/smaps_rollup. The shared-memory rings and the pages of shared libraries count in the
  RSS of every process that maps them, and split among them in PSS;
- threads, and open file descriptors;
- with ``--mappings``, /proc/self/smaps summed by mapping (grpc's .so, numpy's, python, the heap,
  the memfd rings, anonymous memory: malloc arenas, thread stacks, the result pool);
- with ``--tracemalloc``, the largest Python allocations by file after the loop.

The table gives the median over workers and the largest. ``--json PATH`` keeps every worker's
figures. ``--numpy-only`` runs the same loop without ringserve (each rank sums the arrays it would
have received itself): python, numpy and the job's own arrays, which the difference leaves out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"4K": 4 << 10, "1M": 1 << 20, "16M": 16 << 20}
STAGES = ("import", "init", "loop", "end", "idle")
MiB = 1 << 20


def read_self() -> dict[str, float]:
    """This process's memory in MiB, its threads and its open file descriptors."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rollup = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        rollup[key] = int(value.split()[0])
    kib = 1024 / MiB
    return {
        "rss": int(status["VmRSS"].split()[0]) * kib,
        "peak": int(status["VmHWM"].split()[0]) * kib,
        "pss": rollup["Pss"] * kib,
        "uss": (rollup["Private_Clean"] + rollup["Private_Dirty"]) * kib,
        "shared": (rollup["Shared_Clean"] + rollup["Shared_Dirty"]) * kib,
        "anon": rollup["Anonymous"] * kib,
        "threads": int(status["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def mapping_kind(path: str) -> str:
    """The group a mapping of /proc/self/smaps is summed in: a package of site-packages (grpc,
    numpy, cryptography), a shared library without its version, or the kind of anonymous memory."""
    if not path:
        return "anonymous (malloc arenas, thread stacks, the result pool)"
    if path.startswith("/memfd:") or path.startswith("/dev/shm"):
        return "shared memory (memfd rings)"
    if path.startswith("["):
        return path
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    name = os.path.basename(path)
    return name.split(".so", 1)[0] + ".so" if ".so" in name else name


def read_mappings() -> dict[str, dict[str, float]]:
    """/proc/self/smaps summed by mapping_kind: rss, pss and uss in MiB."""
    groups: dict[str, dict[str, float]] = {}
    current = "?"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            current = mapping_kind(head[5].strip() if len(head) > 5 else "")
            groups.setdefault(current, {"rss": 0.0, "pss": 0.0, "uss": 0.0})
            continue
        key = head[0].rstrip(":")
        if key in ("Rss", "Pss"):
            groups[current][key.lower()] += int(head[1]) / 1024
        elif key in ("Private_Clean", "Private_Dirty"):
            groups[current]["uss"] += int(head[1]) / 1024
    return {k: {n: round(v, 2) for n, v in g.items()} for k, g in groups.items() if g["rss"] > 0.05}


def worker(args: argparse.Namespace) -> int:
    """The job: a numpy training loop, measured at each stage; writes ``<out>/<rank>.json``."""
    stages: dict[str, dict[str, float]] = {}
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start()
    import numpy as np

    if args.numpy_only:
        rs = _Alone(int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"]))
    else:
        import ringserve as rs  # type: ignore[no-redef]

    stages["import"] = read_self()
    rs.init()
    stages["init"] = read_self()
    rank, world = rs.rank(), rs.size()
    started = time.perf_counter()
    for step in range(args.steps):
        for label in args.sizes:
            size = SIZES[label]
            grad = np.full(size // 4, rank + step, dtype=np.float32)
            out = rs.allreduce(grad, op="sum", name=f"grad.{label}")
            expected = world * step + world * (world - 1) / 2
            if not (out == expected).all():
                raise AssertionError(f"rank {rank}: allreduce of {label} gave {out[:4]}, not {expected}")
    loop_s = time.perf_counter() - started
    stages["loop"] = read_self()
    top: list[tuple[str, float]] = []
    if args.tracemalloc:
        import tracemalloc

        snap = tracemalloc.take_snapshot().statistics("filename")
        top = [(str(s.traceback[0].filename).replace(str(ROOT), "."), round(s.size / MiB, 2)) for s in snap[:15]]
    rs.barrier()
    mappings = read_mappings() if args.mappings else {}
    stages["end"] = read_self()
    if args.idle:
        time.sleep(args.idle)
        stages["idle"] = read_self()
    report = {"rank": rank, "world": world, "pid": os.getpid(), "stages": stages, "loop_s": loop_s,
              "mappings": mappings, "tracemalloc": top, "modules": len(sys.modules),
              "torch": "torch" in sys.modules, "grpc_threads": _thread_names()}
    Path(args.out, f"{rank}.json").write_text(json.dumps(report))
    rs.shutdown()
    return 0


class _Alone:
    """The loop's calls without ringserve: each rank makes the sum that it would have received."""

    def __init__(self, rank: int, world: int) -> None:
        self._rank, self._world = rank, world

    def init(self) -> None:
        pass

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    def allreduce(self, grad: Any, op: str, name: str) -> Any:
        step = grad[0] - self._rank
        out = grad.copy()  # a new result, as rs.allreduce returns
        out[:] = self._world * step + self._world * (self._world - 1) / 2
        return out

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _thread_names() -> dict[str, int]:
    """Threads of this process by name (/proc/self/task/*/comm), native ones included."""
    names: dict[str, int] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return names


def run_job(np_: int, steps: int, out: Path, extra: list[str], env: dict[str, str] | None = None,
            timeout_s: float = 600) -> list[dict]:
    """Runs the job under ``ringserve run -np np_`` and returns every worker's report, by rank."""
    command = [sys.executable, "-m", "ringserve.cli", "run", "-np", str(np_), sys.executable, str(Path(__file__)),
               "--worker", "--out", str(out), "--steps", str(steps), *extra]
    done = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the job exited with code {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(np_)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", type=int, default=4, dest="np_")
    parser.add_argument("--steps", type=int, default=10, help="loop steps, each an allreduce of every size")
    parser.add_argument("--mappings", action="store_true", help="sum /proc/self/smaps by mapping at the end")
    parser.add_argument("--tracemalloc", action="store_true", help="the largest Python allocations after the loop")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="the allreduces of each step")
    parser.add_argument("--idle", type=float, default=0.0, help="measure again after this many idle seconds")
    parser.add_argument("--numpy-only", action="store_true", help="the same loop without ringserve (the baseline)")
    parser.add_argument("--json", type=Path, help="write every worker's report here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    extra = [flag for flag, on in (("--mappings", args.mappings), ("--tracemalloc", args.tracemalloc),
                                   ("--numpy-only", args.numpy_only)) if on]
    extra += ["--idle", str(args.idle), "--sizes", *args.sizes]
    with tempfile.TemporaryDirectory() as out:
        reports = run_job(args.np_, args.steps, Path(out), extra)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    print(f"{args.np_} workers{' (numpy only)' if args.numpy_only else ''}, {args.steps} steps of "
          f"{' + '.join(args.sizes)} allreduces; median (largest) over workers")
    print(f"{'stage':6} {'RSS MiB':>14} {'peak MiB':>14} {'PSS MiB':>14} {'USS MiB':>14} {'shared MiB':>14} "
          f"{'threads':>9} {'fds':>7}")
    for stage in [s for s in STAGES if s in reports[0]["stages"]]:
        cells = []
        for key in ("rss", "peak", "pss", "uss", "shared", "threads", "fds"):
            values = [r["stages"][stage][key] for r in reports]
            cells.append(f"{statistics.median(values):.1f} ({max(values):.1f})")
        print(f"{stage:6} " + " ".join(f"{c:>14}" for c in cells[:5]) + " " + " ".join(f"{c:>9}" for c in cells[5:]))
    first = reports[0]
    print(f"modules loaded: {first['modules']}; torch imported: {any(r['torch'] for r in reports)}; "
          f"loop {statistics.median(r['loop_s'] for r in reports):.2f} s; threads by name (rank 0): "
          f"{first['grpc_threads']}")
    if first["mappings"]:
        print("rank 0's mappings at the end (MiB):")
        for kind, g in sorted(first["mappings"].items(), key=lambda kv: -kv[1]["rss"]):
            print(f"  {kind:50} rss {g['rss']:7.2f}  pss {g['pss']:7.2f}  uss {g['uss']:7.2f}")
    if first["tracemalloc"]:
        print("rank 0's largest Python allocations after the loop (MiB):")
        for name, size in first["tracemalloc"]:
            print(f"  {size:7.2f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
