"""A numpy training run for the launcher's host tests.

Usage: hosts_train.py STEPS [sleep]

Each rank draws its own data (seeded by its rank and the step), the gradients are averaged with
allreduce, and every rank takes the same step. At the end each rank prints one line of JSON with
what the tests check: its rank and places, its Horovod variables, a forwarded variable, its
working directory and pid, and its weights. ``sleep`` makes it print its pid after the first
step and then wait, for the tests that kill something.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import ringserve as rs
from ringserve import api

DIM = 8


def gradient(w: np.ndarray, rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal((16, DIM))
    y = x @ np.arange(DIM, dtype=np.float64)
    return 2.0 * x.T @ (x @ w - y) / len(x)


def main() -> None:
    steps = int(sys.argv[1])
    rs.init()
    w = np.zeros(DIM)
    for step in range(steps):
        w = w - 0.05 * rs.allreduce(gradient(w, rs.rank(), step), op="average", name="grad")
        if step == 0 and sys.argv[2:] == ["sleep"]:
            print(f"pid={os.getpid()} rank={rs.rank()}", flush=True)
            time.sleep(120)
    print(json.dumps({
        "rank": rs.rank(), "size": rs.size(), "local": [rs.local_rank(), rs.local_size()],
        "cross": [rs.cross_rank(), rs.cross_size()], "host": os.environ.get("RINGSERVE_HOSTNAME"),
        "horovod": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
        "forwarded": os.environ.get("RS_TEST_FORWARDED"), "cwd": os.getcwd(), "w": w.tolist(),
        "payload_port": os.environ.get("RINGSERVE_PAYLOAD_PORT"),
        "lane_bytes": api.context().worker.counters.lane_bytes_sent,
    }), flush=True)
    rs.shutdown()


if __name__ == "__main__":
    main()
