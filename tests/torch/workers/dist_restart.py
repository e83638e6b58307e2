"""One rank of the recovery worlds: DDP training that survives a peer's death, as docs/guide/torch-distributed.md says.

    dist_restart.py OUT_DIR MODE        (MODE: torchrun | ringserve)

Trains STEPS steps of DDP with SGD and momentum, rank 0 checkpointing every CHECKPOINT_EVERY
steps (model, optimizer, step; a file written then renamed). In its first life, rank 1 SIGKILLs
itself at step KILL_AT (a marker file remembers it died).

- ``torchrun`` (run under ``torchrun --max-restarts 1``): the agent stops the survivors and
  starts every rank again; each resumes from the checkpoint.
- ``ringserve`` (run under ``ringserve run --restart-failed``): the launcher starts rank 1 again;
  the survivors catch the error, destroy the group and make a new one, in which the restarted
  rank joins them, and every rank resumes from the checkpoint.

Each rank writes its final parameters, where it resumed from and how many groups it made, to
OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ringserve.torch.distributed  # noqa: F401

STEPS = 20
CHECKPOINT_EVERY = 5
KILL_AT = 12


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(out: Path, rank: int, size: int, record: dict[str, Any]) -> None:
    dist.init_process_group("ringserve", rank=rank, world_size=size)
    record["groups"] += 1
    model = net()
    optimizer = optimizer_of(model)
    start = 0
    checkpoint = out / "checkpoint.pt"
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
        record["resumed_from"].append(start)
    ddp = DDP(model)
    for step in range(start, STEPS):
        if step == KILL_AT and rank == 1 and not (out / "died").exists():
            (out / "died").write_text("1")
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        if (step + 1) % CHECKPOINT_EVERY == 0:
            dist.barrier()  # every rank finished the step: the checkpoint is the world's
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                           out / "checkpoint.tmp")
                os.replace(out / "checkpoint.tmp", checkpoint)
            dist.barrier()
    record["final"] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record: dict[str, Any] = {"rank": rank, "groups": 0, "resumed_from": [], "errors": [],
                              "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT")}
    if mode == "torchrun":
        train(out, rank, size, record)
    else:
        for _ in range(3):
            try:
                train(out, rank, size, record)
                break
            except RuntimeError as exc:  # DistBackendError, or DDP's RuntimeError naming it
                record["errors"].append(str(exc).splitlines()[0])
                dist.destroy_process_group()
    dist.destroy_process_group()
    torch.save(record, out / f"rank{rank}.{record['attempt'] or 'x'}.{os.getpid()}.pt")


if __name__ == "__main__":
    main()
