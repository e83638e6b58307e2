"""An elastic numpy training loop for the chaos tests.

Usage: elastic_worker.py LOG STEPS PAUSE_S [FAULT]

Every commit appends ``{"pid", "time", "view", "step", "sha"}`` to LOG, the sha256 of the weights.
FAULT ``raise@K`` makes the first process that reaches step K raise inside a collective's loop.
With ELASTIC_PREPARE_S set, the process says where it stands after ``rs.init()`` ("init: rank R
of N") and then takes that long before its training starts, as a script that builds a large
model and its data after init.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from typing import Any

import numpy as np
from commit_log import CommitLog

import ringserve as rs
from ringserve import elastic

DIM = 1 << 14


def claim(marker: str) -> bool:
    """Whether this process is the first to claim ``marker``: created exclusively, so that of the
    ranks reaching the fault's step together only one raises (checking, then creating, let two)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main() -> None:
    log_path, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    fault = sys.argv[4] if len(sys.argv) > 4 else ""
    if os.environ.get("ELASTIC_LOG_TIMES"):  # the chaos campaign's: ringserve's warnings with their times
        logging.basicConfig(format="%(asctime)s %(message)s", level=logging.WARNING)
    if os.environ.get("ELASTIC_HOSTS_OF"):  # hosts of that many workers, by launch index (test_algorithm_kills.py)
        index = int(os.environ.get("RINGSERVE_RANK_HINT", "0"))
        os.environ["RINGSERVE_HOSTNAME"] = f"host{index // int(os.environ['ELASTIC_HOSTS_OF'])}"
    rs.init()
    if os.environ.get("ELASTIC_PREPARE_S"):
        print(f"init: rank {rs.rank()} of {rs.size()}", flush=True)
        time.sleep(float(os.environ["ELASTIC_PREPARE_S"]))

    class Logged(CommitLog, elastic.ObjectState):
        log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (held for the process's life)

        def digest(self) -> str:
            weights: Any = self.w
            return hashlib.sha256(np.ascontiguousarray(weights).tobytes()).hexdigest()

    state = Logged(step=0, w=np.zeros(DIM))

    @elastic.run
    def train(state: Logged) -> None:
        while state.step < steps:
            rng = np.random.default_rng(state.step * 7919 + rs.rank())
            grad = rng.standard_normal(DIM) + 0.01 * state.w
            if fault == f"raise@{state.step}" and not os.environ.get("FAULT_DONE") and claim(f"{log_path}.fault"):
                raise RuntimeError(f"injected fault at step {state.step}")
            avg = rs.allreduce(grad, op="average", name="grad")
            state.w = state.w - 0.05 * avg
            state.step += 1
            time.sleep(pause)
            state.commit()

    train(state)
    ran = sorted({name for (op, name) in rs.api.context().worker.counters.algorithms if op == "allreduce"})
    print(f"finished at step {state.step}; allreduce ran {', '.join(ran)}", flush=True)
    rs.shutdown()


if __name__ == "__main__":
    main()
