"""A worker process for the status page's browser test: a small elastic training loop (an
allreduce and a commit every step) until its time is up. It writes its address to a file once it
is in the world, so that the test knows which process is which member."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import ringserve
import ringserve.elastic
from ringserve import api


def main(address_file: str, seconds: float) -> None:
    ringserve.init()
    with open(address_file + ".tmp", "w", encoding="utf-8") as f:
        f.write(api.context().worker.address)
    os.replace(address_file + ".tmp", address_file)
    state = ringserve.elastic.ObjectState(step=0, w=np.zeros(1 << 16, np.float32))
    deadline = time.monotonic() + seconds

    @ringserve.elastic.run
    def train(state: ringserve.elastic.ObjectState) -> None:
        while time.monotonic() < deadline:
            state.w = state.w + ringserve.allreduce(np.ones(1 << 16, np.float32), op="average", name="grad")
            state.step += 1
            state.commit()
            time.sleep(0.02)

    train(state)
    ringserve.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
