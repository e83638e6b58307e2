"""A numpy training loop that reports what its worker costs, for tests/cli/test_worker_memory.py.

Usage: memory_train.py OUT_DIR STEPS

Each step allreduces float32 gradients of 4 KiB, 1 MiB and 16 MiB and checks each sum exactly.
The worker reads its own /proc before ``import ringserve`` (python and numpy: the job's, not
ringserve's), at its peak, and at the end, after waiting for the shared rings to go idle, and
writes ``OUT_DIR/<rank>.json``. ``MEMORY_TRAIN_DEFECT`` plants what the test must catch:
``torch`` imports torch, and ``ballast`` keeps 64 MiB as ringserve would if it leaked; both may
be given, comma-separated.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np

SIZES = (4 << 10, 1 << 20, 16 << 20)


def proc_self() -> dict[str, int]:
    """This process's memory in KiB (RSS, its peak, the private pages, the shared-memory pages),
    its threads and its open file descriptors."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rollup = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in
                                                 Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])}
    kib = {key: int(status[key].split()[0]) for key in ("VmRSS", "VmHWM", "RssShmem", "Threads")}
    return {"rss": kib["VmRSS"], "peak": kib["VmHWM"], "shmem": kib["RssShmem"],
            "uss": rollup["Private_Clean"] + rollup["Private_Dirty"], "threads": kib["Threads"],
            "fds": len(os.listdir("/proc/self/fd"))}


def main() -> None:
    out_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    defects = os.environ.get("MEMORY_TRAIN_DEFECT", "").split(",")
    before = proc_self()  # python and numpy, which any numpy job pays

    import ringserve as rs

    ballast = np.ones(64 << 18, dtype=np.float32) if "ballast" in defects else None
    if "torch" in defects:
        try:
            import torch  # noqa: F401
        except ImportError:  # a stand-in of that name: all that the test looks at
            sys.modules["torch"] = types.ModuleType("torch")
    rs.init()
    rank, world = rs.rank(), rs.size()
    for step in range(steps):
        for size in SIZES:
            grad = np.full(size // 4, rank + step, dtype=np.float32)
            out = rs.allreduce(grad, op="sum", name=f"grad.{size}")
            expected = world * step + world * (world - 1) / 2
            if not (out == expected).all():
                raise AssertionError(f"rank {rank}: the allreduce of {size} bytes gave {out[:4]}, not {expected}")
    # The job's own arrays at the peak: the largest gradient and its result, and the result before it.
    arrays_kib = (2 * SIZES[-1] + SIZES[-2]) >> 10
    rs.barrier()
    time.sleep(float(os.environ.get("MEMORY_TRAIN_IDLE_S", "1")))  # the rings go idle and give their pages back
    end = proc_self()
    report = {"rank": rank, "world": world, "before": before, "end": end, "arrays_kib": arrays_kib,
              "torch": "torch" in sys.modules, "cryptography": "cryptography" in sys.modules,
              "ballast": ballast is not None}
    (out_dir / f"{rank}.json").write_text(json.dumps(report))
    rs.shutdown()


if __name__ == "__main__":
    main()
