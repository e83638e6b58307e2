"""One rank of DDP with torch's powerSGD_hook and DDP's default buckets (a 1 MiB first bucket, then
25 MiB ones: this model makes three), over the backend given.

    ddp_powersgd.py OUT_DIR BACKEND

Each rank fits its own batch for a few steps. Saves the losses, the final parameters and the
bucket indices the hook saw to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import ringserve.torch  # noqa: F401  registers the backend

STEPS = 5


def main() -> None:
    out, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=size)
    torch.manual_seed(0)
    # 2.3 MB of float32 parameters: DDP makes a 1 MiB first bucket, then the rest.
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    ddp = DDP(model)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        random_seed=0)
    seen: set[int] = set()

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations, not strings
        seen.add(bucket.index())
        return powerSGD_hook.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    torch.save({"rank": rank, "buckets": sorted(seen), "losses": losses,
                "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
