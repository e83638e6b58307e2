"""An elastic epoch over an ElasticSampler in which one rank leaves half way (SIGTERM to itself).

Run under ``ringserve run -np 3 --min-np 2``: ``python elastic_sampler.py OUT_DIR``. Each rank
appends one JSON line per commit to ``OUT_DIR/log.<pid>.jsonl``: the world size, and the dataset
indices of the batch it committed. The test checks that the epoch's indices were processed once
each, by three ranks and then by two.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

import ringserve.torch as hvd

# 24 by three ranks (4 batches each), then 24 by two: whole batches throughout. The last rank asks
# to leave after its second commit; its third commit's check carries that (checks are pipelined:
# elastic/state.py), and the world changes at the fourth.
LENGTH = 48
BATCH = 2
LEAVE_AFTER = 2  # the last rank's commits before it asks to leave


def main(out_dir: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    log = open(os.path.join(out_dir, f"log.{os.getpid()}.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sampler = hvd.elastic.ElasticSampler(list(range(LENGTH)), shuffle=True, seed=7)
    # ``started``: the world of 3 formed. The launcher starts 3, but the first view may form with
    # the 2 that came first (min-np 2); the epoch's arithmetic (whole batches throughout) needs 3.
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, started=False)
    resets: list[int] = []
    mine = [0]  # batches this process committed
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state: Any) -> None:
        while not state.started:
            if hvd.size() == 3:
                state.started = True
            else:
                time.sleep(0.05)
            state.commit()  # nothing processed: the third's arrival interrupts here
        share = list(state.sampler)  # this rank's part of what the epoch has left, in this world
        for batch_idx in range(0, len(share) // BATCH):
            batch = share[batch_idx * BATCH: (batch_idx + 1) * BATCH]
            hvd.allreduce(torch.ones(1), name="step")  # a step of training on the batch
            state.sampler.record_batch(batch_idx, BATCH)
            log.write(json.dumps({"size": hvd.size(), "rank": hvd.rank(), "batch": batch, "resets": resets}) + "\n")
            log.flush()
            state.commit()
            mine[0] += 1
            if hvd.rank() == 2 and mine[0] == LEAVE_AFTER:
                os.kill(os.getpid(), signal.SIGTERM)  # leaves at its next commit

    train(state)
    log.close()
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
