"""Two trainings in one job, one after the other, each with a new elastic state (as a script that
pretrains, then fine-tunes, may write).

Usage: second_state_worker.py LOG STEPS PAUSE_S

Each training takes STEPS steps of an allreduce and a commit; the process then prints both
trainings' last steps and the lineage the second one ran in.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ringserve as rs
from ringserve import elastic


def training(steps: int, pause: float) -> elastic.ObjectState:
    state = elastic.ObjectState(step=0, w=np.zeros(8))

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        while state.step < steps:
            state.w = state.w + rs.allreduce(np.ones(8), op="average", name="ringserve.test.step")
            state.step += 1
            time.sleep(pause)
            state.commit()

    train(state)
    return state


def main() -> None:
    steps, pause = int(sys.argv[2]), float(sys.argv[3])
    rs.init()
    first = training(steps, pause)
    second = training(steps, pause)
    print(f"trainings ended at steps {first.step} and {second.step} (w {second.w[0]:g}), "
          f"the second in lineage {second.lineage}", flush=True)
    rs.shutdown()


if __name__ == "__main__":
    main()
