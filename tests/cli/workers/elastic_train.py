"""Elastic numpy training for the launcher's host tests: it trains until STOPFILE exists.

Usage: elastic_train.py STOPFILE [FAIL_HOST]

Every step averages the ranks' gradients and commits. Every 5th step rank 0 prints
``step=S size=N``; at the end every rank prints ``done step=S sha=...`` (its weights' digest).
The ranks agree on when to stop (a small allreduce of "does STOPFILE exist"), so they all stop at
the same step. FAIL_HOST: the first worker on that host (RINGSERVE_HOSTNAME) to reach step 10
exits with code 3, once per run (it claims STOPFILE.failed).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

import ringserve as rs
from ringserve import elastic

DIM = 64


def main() -> None:
    stop_file = sys.argv[1]
    fail_host = sys.argv[2] if len(sys.argv) > 2 else ""
    rs.init()
    state = elastic.ObjectState(step=0, w=np.zeros(DIM))

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        while True:
            asked = rs.allreduce(np.array([float(os.path.exists(stop_file))]), op="sum", name="stop")
            if asked[0] > 0:
                return
            if fail_host and os.environ.get("RINGSERVE_HOSTNAME") == fail_host and state.step >= 10:
                try:
                    os.close(os.open(stop_file + ".failed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    print(f"failing on purpose at step {state.step}", flush=True)
                    os._exit(3)
                except FileExistsError:
                    pass
            rng = np.random.default_rng(7919 * state.step + rs.rank())
            grad = rng.standard_normal(DIM) + 0.01 * state.w
            state.w = state.w - 0.05 * rs.allreduce(grad, op="average", name="grad")
            state.step += 1
            time.sleep(0.05)
            state.commit()
            if rs.rank() == 0 and state.step % 5 == 0:
                print(f"step={state.step} size={rs.size()}", flush=True)

    train(state)
    digest = hashlib.sha256(np.ascontiguousarray(state.w).tobytes()).hexdigest()[:16]
    print(f"done step={state.step} sha={digest}", flush=True)
    rs.shutdown()


if __name__ == "__main__":
    main()
