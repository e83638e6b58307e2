"""One rank of the DDP equivalence worlds: every scenario trained in turn, on the backend given.

    dist_ddp.py OUT_DIR BACKEND SCENARIO...

The same seeds and the same data on every backend: rank r's batch of step s is drawn from a
generator seeded with (s, r). Each scenario's final parameters (and ZeRO's consolidated optimizer
state on rank 0) go to OUT_DIR/rank{r}.pt, for the test to compare gloo's with ringserve's.
With RINGSERVE_TEST_DEVICE=cuda the model and the batches are on the GPU (DDP with device_ids);
the results are saved on the host.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import ringserve.torch.distributed as rsd

STEPS = 6
BATCH = 8
DEVICE = torch.device(os.environ.get("RINGSERVE_TEST_DEVICE", "cpu"))
SEEN: dict[str, list[str]] = {}  # per scenario: the devices of the trained parameters and gradients


class Net(torch.nn.Module):
    """An MLP with a BatchNorm (DDP broadcasts its buffers) and two heads, one of them unused by
    some ranks in some steps when ``switch`` is on."""

    def __init__(self, switch: bool) -> None:
        super().__init__()
        # No bias before the BatchNorm: its true gradient is zero, and Adam (ZeRO's) would blow the
        # rounding noise of the sums up into full steps, which differ with the order of the sums.
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 24, bias=False), torch.nn.BatchNorm1d(24), torch.nn.ReLU(),
                                        torch.nn.Linear(24, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 4)
        self.other = torch.nn.Linear(16, 4) if switch else None

    def forward(self, x: torch.Tensor, use_other: bool = False) -> torch.Tensor:
        h = self.body(x)
        return self.other(h) if use_other and self.other is not None else self.head(h)


def bf16_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations, not strings
    """torch's bf16_compress_hook itself. DDP refuses that hook by its name on a torch built
    without CUDA and NCCL, whatever the backend (gloo too); under another name it runs."""
    return default_hooks.bf16_compress_hook(state, bucket)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(BATCH, 12, generator=g).to(DEVICE), torch.randint(0, 4, (BATCH,), generator=g).to(DEVICE)


def train(scenario: str, rank: int, size: int, backend: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net(switch=scenario == "unused").to(DEVICE)
    group = None
    if scenario == "int8" and backend == "ringserve":
        # ringserve's own compression, chosen per group with pg_options (a group of every rank).
        group = dist.new_group(list(range(size)), pg_options=rsd.Options(compression="int8"))
    kwargs: dict[str, Any] = {"process_group": group}
    if DEVICE.type == "cuda":
        kwargs["device_ids"] = [torch.cuda.current_device()]
    if scenario == "unused":
        kwargs["find_unused_parameters"] = True
    if scenario == "static":
        kwargs["static_graph"] = True
    model = DDP(net, **kwargs)
    if scenario == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif scenario == "bf16_hook":
        model.register_comm_hook(None, bf16_hook)
    elif scenario == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            min_compression_rate=0.5, random_seed=0)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer: Any
    if scenario == "zero":
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step, rank)
        if scenario == "no_sync":
            # Gradient accumulation: the first half of the batch without communication.
            with model.no_sync():
                loss_fn(model(x[: BATCH // 2]), y[: BATCH // 2]).backward()
            loss_fn(model(x[BATCH // 2:]), y[BATCH // 2:]).backward()
        else:
            use_other = scenario == "unused" and (rank + step) % 3 == 0
            loss_fn(model(x, use_other), y).backward()
        optimizer.step()
    result: dict[str, Any] = {k: v.detach().cpu() for k, v in net.state_dict().items()}
    SEEN[scenario] = sorted({str(t.device) for p in net.parameters() for t in (p, p.grad) if t is not None})
    if scenario == "zero":
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            state = optimizer.state_dict()["state"]
            result["zero.exp_avg_sq"] = torch.stack([s["exp_avg_sq"].sum() for s in state.values()]).cpu()
    if group is not None:
        dist.destroy_process_group(group)
    return result


def main() -> None:
    out, backend, scenarios = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=size)
    results = {s: train(s, rank, size, backend) for s in scenarios}
    torch.save({"rank": dist.get_rank(), "size": dist.get_world_size(), "backend": dist.get_backend(),
                "results": results, "devices": SEEN}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
