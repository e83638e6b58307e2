"""One rank of the PowerSGD world: torch's DDP powerSGD_hook (over gloo) and ringserve's
Compression.powersgd (DistributedOptimizer) trained side by side on the same data; then the numpy
API's PowerSGD on one matrix.

    powersgd.py OUT_DIR RANK STEPS

Both models start from the same seed, and the optimizer's one bucket holds the parameters in the
order of DDP's bucket (read in the hook), so that both draw their initial Qs for the same matrices
in the same order. Saved to OUT_DIR/rank{r}.pt: both models' final parameters, and the numpy rounds'
inputs, errors and results.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import ringserve
import ringserve.torch as hvd

START = 2
LR = 0.1


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def reference(rank: int, steps: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """DDP with torch's hook, one bucket; returns its parameters and the bucket's order by name."""
    model = net()
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = DDP(model)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=START,
                                        min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                        random_seed=0)
    order: list[str] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations, not strings
        order[:] = [names[id(p)] for p in bucket.parameters()]
        return powerSGD_hook.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    train(ddp, opt, steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, order


def ours(rank: int, steps: int, order: list[str]) -> dict[str, torch.Tensor]:
    model = net()
    params = dict(model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=rank, start_powerSGD_iter=START),
                                   groups=[[params[n] for n in order]])
    train(model, opt, steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    me = dist.get_rank()
    for step in range(steps):
        x, y = batch(step, me)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def numpy_rounds(steps: int) -> dict[str, Any]:
    """The numpy API's PowerSGD on one 40 x 30 matrix, from the first call (start_powerSGD_iter=0)."""
    compressor = ringserve.PowerSGD(2, start_powerSGD_iter=0)
    me = ringserve.rank()
    rng = np.random.default_rng(77 + me)
    record: dict[str, Any] = {"inputs": [], "errors_before": [], "errors_after": [], "results": []}
    for _ in range(steps):
        grad = rng.standard_normal((40, 30)).astype(np.float32)
        before = compressor.error("m")
        record["inputs"].append(grad.copy())
        record["errors_before"].append(np.zeros(grad.size, np.float32) if before is None else before.copy())
        record["results"].append(ringserve.allreduce(grad, name="m", compression=compressor))
        after = compressor.error("m")
        assert after is not None
        record["errors_after"].append(after.copy())
    return record


def main() -> None:
    out, rank, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    hvd.init()
    me, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=me, world_size=size)
    expected, order = reference(rank, steps)
    got = ours(rank, steps, order)
    record = numpy_rounds(4)
    torch.save({"rank": hvd.rank(), "expected": expected, "got": got, "order": order, "numpy": record},
               out / f"rank{me}.pt")
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
