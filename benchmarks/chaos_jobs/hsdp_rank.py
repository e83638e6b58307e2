"""One rank of a replica group in the chaos campaign's HSDP job (chaos_jobs/hsdp.py).

Started as a torchrun of its group would start it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
with RINGSERVE_HSDP_GROUP naming the group and RINGSERVE_COORDINATOR the world's coordinator.
FSDP2 shards a small MLP inside the group over gloo; ringserve's HSDP replicates the shards across
the groups, with a commit every step: the model, batches and step of tests/torch/test_hsdp.py.

Every rank appends one line per commit to the job's commit log, in the campaign's format: ``pid``,
``time``, ``view``, ``step`` and ``sha``, the sha256 of the group's *full* parameters (each shard
gathered in the group), so that every rank of every group at one (view, step) must write the same
hash: a replica that diverged, or a restarted group that took a wrong shard, shows as a second one.

    python hsdp_rank.py LOG STEPS PAUSE_S
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from ringserve import api
from ringserve.torch import hsdp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "torch" / "workers"))
from hsdp_worker import build, step  # test_hsdp.py's model, batches and step


def full_sha(model: torch.nn.Module) -> str:
    """The sha256 of the group's full parameters and buffers (a gather in the group, every rank)."""
    h = hashlib.sha256()
    for key, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        h.update(key.encode())
        h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    log, steps, pause_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    faulthandler.register(signal.SIGUSR1)  # the campaign's dump of a hung job's stacks
    group = hsdp.init()
    model, optimizer, state = build(group)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @hsdp.run
    def train(state: hsdp.HSDPState) -> None:
        while state.step < steps:
            step(model, optimizer, state, group)
            line = {"pid": os.getpid(), "time": time.time(), "view": api.context().worker.running_view,
                    "step": state.step, "sha": full_sha(model), "group": group.name}
            os.write(fd, (json.dumps(line) + "\n").encode())  # one write: lines of many processes never mix
            time.sleep(pause_s)

    train(state)
    print(f"group {group.name} rank {group.rank} finished at step {state.step}", flush=True)
    os.close(fd)
    api.shutdown()


if __name__ == "__main__":
    main()
