"""A chaos worker that trains through the parameter server in ``ssp`` mode (benchmarks/chaos_jobs/ps.py).

Usage: ps_worker.py LOG STEPS PAUSE_S   (under ``ringserve run --ps S``; PS_STALENESS, default 2)

The task is least squares on samples of the worker's own (seeded by its launch index, so a
restarted worker has the same data), with SGD run on the shards. The worker's step is its ssp
clock: the step it pushes next, as the shards answer it (a restarted worker starts at the slowest
member's clock, not at 0). It appends to LOG:

- after each push of step ``c``: ``{"pid", "time", "view", "step": c, "sha": "ssp"}``, ``view``
  being the coordinator's view the worker is in (so that the campaign sees the world whole again
  once a killed worker's replacement trains in the newest view). These records mark progress and
  hold no replica hash: under ssp the values that workers compute a step on differ by design (each
  pulls whatever the others had pushed by then), so no per-step hash must agree, and a hash of
  them under a shared (view, step) would count as divergence what is the mode's very definition;
- once, at the end: ``{"pid", "time", "view": 0, "step": STEPS, "sha"}``, the sha256 of the
  values pulled after every member has pushed every step (a pull for clock STEPS + staleness,
  which the shards answer only once the slowest member's clock is STEPS). Nothing is pushed after
  that, so every worker must pull the same values: these records share (0, STEPS), and the
  campaign's divergence count and final-hash check compare them. A shard's restart that lost
  updates is no divergence (every worker pulls the same restored values); workers that pulled
  different final values are.

The first worker to finish creates LOG.done before it leaves the world. A worker that finds it
(a restarted worker admitted after the others finished: alone in a view, it would start again
from clock 0 and change the values the others recorded) exits 0 without training, as
``ringserve run`` starts no one new once training is over.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import ringserve as rs
from ringserve import api
from ringserve.errors import CollectiveTimeoutError
from ringserve.ps import Client, Optimizer

DIM = 256
SAMPLES = 64
LR = 0.02
PROGRESS = "ssp"  # the per-step records' sha: no replica hash (see the module)


def task(index: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + index)
    truth = np.linspace(-1, 1, DIM).astype(np.float32)
    x = rng.standard_normal((SAMPLES, DIM)).astype(np.float32)
    return x, (x @ truth + 0.5 + 0.01 * rng.standard_normal(SAMPLES)).astype(np.float32)


def gradients(values: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    err = x @ values["w"] + values["b"][0] - y
    return {"w": (2 * x.T @ err / len(y)).astype(np.float32), "b": np.array([2 * err.mean()], np.float32)}


def digest(values: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key in sorted(values):
        h.update(np.ascontiguousarray(values[key]).tobytes())
    return h.hexdigest()


def clock(ps: Client) -> int:
    """The step this worker pushes next (the shards' ssp clock for it; the lowest, should two differ)."""
    return min(link.step for link in ps.client.links)


def main() -> int:
    log_path, steps, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    staleness = int(os.environ.get("PS_STALENESS", "2"))
    done = log_path.with_name(log_path.name + ".done")
    index = int(os.environ.get("RINGSERVE_RANK_HINT", "0"))
    if done.exists():
        print(f"worker {os.getpid()}: training is over (the others finished); not starting", flush=True)
        return 0
    rs.init()
    start = {"w": np.zeros(DIM, np.float32), "b": np.zeros(1, np.float32)}
    ps = Client(start, mode="ssp", staleness=staleness, optimizer=Optimizer(kind="sgd", lr=LR))
    x, y = task(index)
    with log_path.open("a", encoding="utf-8") as log:

        def record(view: int, step: int, sha: str) -> None:
            shards = [link.step for link in ps.client.links]  # the clock each shard keeps for this worker
            log.write(json.dumps({"pid": os.getpid(), "time": time.time(), "view": view, "step": step, "sha": sha,
                                  "shards": shards}) + "\n")
            log.flush()

        try:
            while (step := clock(ps)) < steps:
                if done.exists():  # admitted only once the others had finished: see the module
                    print(f"worker {os.getpid()}: training is over (the others finished at step {steps}); "
                          f"leaving at clock {step} without pushing", flush=True)
                    return 0
                grads = gradients(ps.values, x, y)
                time.sleep(pause)
                ps.push(grads)
                record(api.context().worker.running_view, step, PROGRESS)
                ps.pull()
            # The barrier: a pull for clock steps + staleness waits until every member has pushed steps.
            barrier = ps.submit(lambda c: c.pull(lookahead=staleness))
            try:
                barrier.result(ps.config.round_timeout_s + 5.0)
            except concurrent.futures.TimeoutError:
                barrier.cancel()
                raise CollectiveTimeoutError(f"The final pull (clock {steps + staleness}) did not return within "
                                             f"{ps.config.round_timeout_s + 5.0:g} s.") from None
            record(0, steps, digest(ps.values))
            # Which shard's values two workers disagree on, should they: each link's incarnation and version.
            print(f"worker {os.getpid()}: final values from " + ", ".join(
                f"shard {link.index} incarnation {link.incarnation} version {link.version} step {link.step}" for link in ps.client.links)
                + "; by key " + ", ".join(f"{k} {digest({k: v})[:12]}" for k, v in sorted(ps.values.items())), flush=True)
            done.touch()
            print(f"worker {os.getpid()}: finished at step {steps}; lost updates {ps.client.lost_updates}, "
                  f"client counts {dict(ps.client.counts)}", flush=True)
        finally:
            ps.close()
            rs.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
