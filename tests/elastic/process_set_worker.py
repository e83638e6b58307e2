"""An elastic numpy training loop that uses a process set every step, registered at the start and
again in a reset callback (docs/guide/process-sets.md). Usage: process_set_worker.py LOG STEPS PAUSE_S

Every commit appends the commit record (commit_log.py); every step checks the set's allreduce
against the sum of its members' values, and prints ``set view=V ranks=R`` when a view first uses it.
"""

from __future__ import annotations

import hashlib
import sys
import time
from typing import Any

import numpy as np
from commit_log import CommitLog

import ringserve as rs
from ringserve import elastic

DIM = 1 << 10
sets: dict[str, rs.ProcessSet] = {}


def register() -> None:
    """The same registrations on every rank, from the world's size now (at start and after a reset)."""
    sets["evens"] = rs.add_process_set(range(0, rs.size(), 2))


def main() -> None:
    log_path, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    rs.init()
    register()

    class Logged(CommitLog, elastic.ObjectState):
        log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (held for the process's life)

        def digest(self) -> str:
            weights: Any = self.w
            return hashlib.sha256(np.ascontiguousarray(weights).tobytes()).hexdigest()

    state = Logged(step=0, w=np.zeros(DIM))
    state.register_reset_callbacks([register])
    seen: set[int] = set()

    @elastic.run
    def train(state: Logged) -> None:
        while state.step < steps:
            rng = np.random.default_rng(state.step * 7919 + rs.rank())
            avg = rs.allreduce(rng.standard_normal(DIM), op="average", name="grad")
            evens = sets["evens"]
            if evens.included():
                got = rs.allreduce(np.full(3, rs.rank() + 1.0), op="sum", name="evens", process_set=evens)
                want = float(sum(r + 1 for r in evens.ranks))
                assert got.tolist() == [want] * 3, (got, want, evens)
                view = api_view()
                if view not in seen:
                    seen.add(view)
                    print(f"set view={view} ranks={evens.ranks}", flush=True)
            state.w = state.w - 0.05 * avg
            state.step += 1
            time.sleep(pause)
            state.commit()

    train(state)
    print(f"finished at step {state.step}", flush=True)
    rs.shutdown()


def api_view() -> int:
    return rs.api.context().worker.running_view


if __name__ == "__main__":
    main()
