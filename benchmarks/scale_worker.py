"""One worker of the scale harness (benchmarks/scale.py): an elastic numpy training loop.

Usage: scale_worker.py OUT STOP SIZES...

Each step allreduces one vector of each size (bytes) under the job's algorithm (``auto`` unless
RINGSERVE_ALGORITHM says otherwise); with SCALE_VERSUS=ALGORITHM, twice: once as the job's setting
plans it and once by ALGORITHM over the whole ring (flat), in an order that alternates by step, so
that the two are timed in the same conditions. It checks every element of each sum exactly against the sum
computed here, and commits. Rank r of a view of n contributes ``c(r, step) + (i % 251)`` at index
i, with c from 1 to 13, so the sum is ``sum(c(r, step) for r < n) + n * (i % 251)``: integers below
2**24, exact in float32 in any order of summation, and a rank's contribution missed, counted twice,
from another step or shifted by a chunk's offset changes it.

Appends one JSON line to OUT per event: ``start`` (the process's start, when ringserve was
imported, and when the modules ``rs.init()`` loads were: "ready", with the CPU it took to get
there), ``init`` (when ``rs.init()`` returned, and in which view), ``view`` (each view it computes
in: id, size, rank, when), ``op`` (each timed allreduce: view, size, seconds, algorithm setting;
the first step after a view is left out, it pays the view's set-up; with the process's CPU
seconds, all threads, over the allreduce (``cpu``), over filling the vector (``fill_cpu``) and over
checking the sum (``check_cpu``), and the algorithms the call ran (``ran``): what
benchmarks/scale_sim.py calibrates and plans its simulation by), ``commit`` (the step's commit,
whose allreduce decides whether the world changes: seconds and CPU), ``wrong`` (a sum that
differs: where and by how much), and ``end``. Training stops at the
step that the file STOP names, once it exists (the harness writes a step past every rank's, so that
all stop at the same one).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

STARTED = time.time()

import numpy as np  # noqa: E402 (after the start time: importing is part of what is measured)

import ringserve as rs  # noqa: E402
from ringserve import elastic  # noqa: E402

IMPORTED = time.time()
import ringserve.worker.runtime  # noqa: E402 (what rs.init() loads: gRPC, protobuf, the worker)

READY = time.time()  # from here on, the time to the first view is ringserve's: joining, the view, the links
READY_CPU = time.process_time()  # the CPU this process took to get here (the interpreter, its imports)
PERIOD = 251  # the index pattern's period, a prime, so that no chunk boundary is a multiple of it
TILE = PERIOD * 1024  # elements filled or checked at a time (1 MiB of float32)


def contribution(rank: int, step: int) -> int:
    return 1 + (rank * 31 + step * 7) % 13


def fill(out: np.ndarray, tile: np.ndarray, add: float) -> None:
    """``out[i] = add + (i % PERIOD)``, a tile at a time (the tile's length a multiple of PERIOD)."""
    for k in range(0, out.size, tile.size):
        m = min(tile.size, out.size - k)
        np.add(tile[:m], add, out=out[k:k + m])


def first_wrong(total: np.ndarray, tile: np.ndarray, size: int, base: int, scratch: np.ndarray) -> int:
    """The first index where ``total`` is not ``base + size * (i % PERIOD)``; -1 where none is."""
    for k in range(0, total.size, tile.size):
        m = min(tile.size, total.size - k)
        want = np.multiply(tile[:m], size, out=scratch[:m])
        want += base
        bad = np.flatnonzero(total[k:k + m] != want)
        if bad.size:
            return k + int(bad[0])
    return -1


def setting(algorithm: str | None) -> None:
    """Runs the calls that follow by ``algorithm`` over the whole ring (None: as the job's
    configuration says). Every rank switches at the same call, so that all run the same plan: the
    planner reads the setting call by call (worker/ops/algorithms.py ground)."""
    node = rs.api.context().worker.node
    plane = node.planes.current
    if plane is None:
        return
    cfg = node.config
    plane.algorithm = algorithm or cfg.algorithm
    plane.hierarchical = "0" if algorithm else cfg.hierarchical


def last_step(stop: str) -> float:
    try:
        with open(stop, encoding="utf-8") as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return float("inf")


def main() -> None:
    out_path, stop = sys.argv[1], sys.argv[2]
    sizes = [int(s) for s in sys.argv[3:]]
    versus = os.environ.get("SCALE_VERSUS")
    out = open(out_path, "a", encoding="utf-8")  # noqa: SIM115 (held for the process's life)

    def record(kind: str, **fields: object) -> None:
        out.write(json.dumps({"kind": kind, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")
        out.flush()

    if os.environ.get("SCALE_LOG"):  # ringserve's own account, with times, in the worker's log
        logging.basicConfig(format="%(asctime)s %(name)s %(message)s", level=os.environ["SCALE_LOG"])
    record("start", started=STARTED, imported=IMPORTED, ready=READY, ready_cpu=READY_CPU)
    rs.init()
    # A worker that joins a running world prepares first (admit_when_ready): view 0 until admitted.
    record("init", view=rs.api.context().worker.running_view, size=rs.size())
    # One buffer per size, reduced in place (as gradients are), and filled and checked a tile at a
    # time: the job's own arrays are the sizes plus 2 x TILE (a worker's memory is measured).
    tile = (np.arange(TILE) % PERIOD).astype(np.float32)
    scratch = np.empty(TILE, dtype=np.float32)
    sums = {n: np.empty(n // 4, dtype=np.float32) for n in sizes}
    seen = {"view": -1}
    counters = rs.api.context().worker.counters  # the worker's for its life, across views

    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        while True:
            step: int = state.step  # type: ignore[attr-defined]
            if step >= last_step(stop):
                return
            view, rank, size = rs.api.context().worker.view_id, rs.rank(), rs.size()
            fresh = view != seen["view"]
            if fresh:
                seen["view"] = view
                record("view", view=view, size=size, rank=rank)
            ways: list[str | None] = [None] if not versus else [None, versus] if step % 2 else [versus, None]
            for nbytes in sizes:
                total = sums[nbytes]
                for way in ways:
                    cpu0 = time.process_time()
                    fill(total, tile, contribution(rank, step))
                    setting(way)
                    before = dict(counters.algorithms)
                    cpu1, begin = time.process_time(), time.perf_counter()
                    rs.allreduce(total, op="sum", name=f"scale.{nbytes}.{way or 'job'}", out=total)
                    took, cpu2 = time.perf_counter() - begin, time.process_time()
                    base = sum(contribution(r, step) for r in range(size))
                    bad = first_wrong(total, tile, size, base, scratch)
                    cpu3 = time.process_time()
                    if bad >= 0:
                        record("wrong", view=view, step=step, size=nbytes, first=bad, got=float(total[bad]),
                               want=float(base + size * (bad % PERIOD)), algorithm=way or "job")
                    if not fresh:
                        after = dict(counters.algorithms)  # copied at once: the loop thread adds to it
                        ran = sorted(a for (op, a), n in after.items() if op == "allreduce" and n > before.get((op, a), 0))
                        record("op", view=view, world=size, step=step, size=nbytes, seconds=took, cpu=cpu2 - cpu1,
                               fill_cpu=cpu1 - cpu0, check_cpu=cpu3 - cpu2, ran=ran, algorithm=way or "job")
            setting(None)
            state.step = step + 1  # type: ignore[attr-defined]
            cpu0, begin = time.process_time(), time.perf_counter()
            state.commit()
            if not fresh:
                record("commit", view=view, world=size, step=step, seconds=time.perf_counter() - begin,
                       cpu=time.process_time() - cpu0)

    train(state)
    ran = rs.api.context().worker.counters.algorithms
    record("end", step=state.step, algorithms={name: n for (op, name), n in ran.items() if op == "allreduce"})  # type: ignore[attr-defined]
    rs.shutdown()


if __name__ == "__main__":
    main()
