"""One rank of the chaos campaign's torchrun job: DDP over the ringserve backend, resumed from a checkpoint.

    python -m torch.distributed.run --nproc-per-node 4 --max-restarts N ... \\
        ddp_worker.py LOG STEPS PAUSE_S CHECKPOINT_DIR [CHECKPOINT_EVERY]

torchrun's documented elastic pattern: when a worker dies, the agent stops the others and starts
every rank again (TORCHELASTIC_RESTART_COUNT counts the restarts), and each rank resumes from the
newest checkpoint. Rank 0 writes it (model, optimizer, step) every CHECKPOINT_EVERY steps (default
1), to a temporary file renamed over the last one, so a reader never sees half a checkpoint; every
rank loads it before DistributedDataParallel's first broadcast, which rank 0's next write must wait
for, so all ranks of an incarnation start from the same one.

After each step every rank appends ``{"pid", "time", "view", "step", "sha"}`` to LOG: sha is the
sha256 of its parameters, view the restart count, which all ranks of an incarnation share. The
batches are a function of (step, rank) alone, so a job that was restarted ends with the bits of one
that never was.

A rank whose collective fails because a peer died (``DistBackendError``, which DDP hands on inside
a RuntimeError naming it) prints one line and exits 1, as the agent is about to stop it anyway;
any other exception keeps its traceback, for the campaign to count.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ringserve.torch.distributed  # noqa: F401  registers the "ringserve" backend


def say(line: str) -> None:
    """One line in one write: four ranks share torchrun's output, and print's two writes interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for tensor in model.state_dict().values():
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    return sha.hexdigest()


def main() -> int:
    log_path, steps, pause_s, checkpoints = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4])
    every = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    view = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    torch.set_num_threads(1)
    dist.init_process_group("ringserve", rank=rank, world_size=world_size)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoint = checkpoints / "checkpoint.pt"
    step = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        say(f"rank {rank} (restart {view}): resuming from the checkpoint of step {step}")
    ddp = DDP(model)

    try:
        step = train(ddp, model, optimizer, rank, view, step, steps, pause_s, log_path, checkpoint, every)
    except RuntimeError as exc:
        if not (isinstance(exc, dist.DistBackendError) or "DistBackendError: ringserve:" in str(exc)):
            raise
        reason = str(exc).strip().splitlines()[0]
        say(f"rank {rank} (restart {view}): a collective failed, for torchrun to restart the group: {reason}")
        return 1
    say(f"rank {rank} (restart {view}) finished at step {step}")
    dist.destroy_process_group()
    return 0


def train(ddp: DDP, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, view: int, step: int,
          steps: int, pause_s: float, log_path: str, checkpoint: Path, every: int) -> int:
    """Trains from ``step`` to ``steps``, logging each step and checkpointing on rank 0; returns the last step."""
    with open(log_path, "a", encoding="utf-8") as log:
        while step < steps:
            g = torch.Generator().manual_seed(step * 7919 + rank)
            x = torch.randn(16, 32, generator=g)
            y = torch.randint(0, 4, (16,), generator=g)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            step += 1
            if rank == 0 and (step % every == 0 or step == steps):
                # Every rank holds these bits after the step (DDP averaged the gradients): rank 0's
                # copy is the world's.
                temporary = checkpoint.with_name(f"checkpoint.{os.getpid()}.tmp")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, temporary)
                os.replace(temporary, checkpoint)
            record = {"pid": os.getpid(), "time": time.time(), "view": view, "step": step, "sha": digest(model)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(pause_s)
    return step


if __name__ == "__main__":
    sys.exit(main())
