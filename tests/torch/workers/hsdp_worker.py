"""One rank of a replica group of fault-tolerant HSDP (ringserve.torch.hsdp), for test_hsdp.py.

Started as a torchrun of its group would start it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
with RINGSERVE_HSDP_GROUP naming the group and RINGSERVE_COORDINATOR the world's coordinator.
Every group trains on the same batches (``batch``: rank r of a group gets batch (step, r)), so
the average over the groups is the one group's gradient however many groups a step has: a run
that loses a group and takes it back ends where one process training on both ranks' batches
ends (``reference``). Each rank appends a line per commit to ``<out>/<gang>-<rank>.jsonl``; rank
0 of each group writes the group's full parameters to ``<out>/final-<gang>.pt`` at the end.
While the file ``<out>/hold`` exists, steps are slower: the test holds the survivors back while a
group starts again.

    python hsdp_worker.py OUT STEPS PAUSE_S
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import ringserve.torch as hvd
from ringserve import api
from ringserve.torch import hsdp

LR = 1e-2
HELD_S = 0.2  # the pause of a step while the file <out>/hold exists (the test waits for a group)


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 5))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)


def reference(steps: int, group_size: int) -> dict[str, torch.Tensor]:
    """Where one process training on every rank's batches ends (what FSDP2's average reaches)."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        optimizer.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(group_size)))
        (loss / group_size).backward()  # type: ignore[operator]
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def build(group: hsdp.ReplicaGroup) -> tuple[torch.nn.Sequential, hsdp.DistributedOptimizer, hsdp.HSDPState]:
    """The model sharded over ``group`` by FSDP2, its optimizer and its elastic state (also the
    chaos campaign's HSDP job's: benchmarks/chaos_jobs/hsdp_rank.py)."""
    # A different start in every group: the first sync makes them one.
    torch.manual_seed(hash(group.gang) % 1000)
    model = net()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=group.mesh)
    fully_shard(model, mesh=group.mesh)
    optimizer = hsdp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), group)
    return model, optimizer, hsdp.HSDPState(model, optimizer, group, step=0)


def step(model: torch.nn.Module, optimizer: hsdp.DistributedOptimizer, state: hsdp.HSDPState,
         group: hsdp.ReplicaGroup) -> None:
    """One step on this rank's batch of ``state.step``, then a commit."""
    x, y = batch(state.step, group.rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    state.step += 1
    state.commit()


def main() -> None:
    out, steps, pause_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    group = hsdp.init()
    model, optimizer, state = build(group)
    log = out / f"{group.gang.replace('/', '-')}-{group.rank}.jsonl"

    @hsdp.run
    def train(state: hsdp.HSDPState) -> None:
        while state.step < steps:
            step(model, optimizer, state, group)
            with log.open("a") as f:
                f.write(json.dumps({"group": group.name, "gang": group.gang, "rank": group.rank, "step": state.step,
                                    "view": api.context().worker.running_view,
                                    "size": hvd.size(), "time": time.time()}) + "\n")
            time.sleep(HELD_S if (out / "hold").exists() else pause_s)

    train(state)
    full = {k: v.full_tensor().detach() for k, v in model.state_dict().items()}
    if group.rank == 0:
        torch.save(full, out / f"final-{group.gang.replace('/', '-')}.pt")
    print(f"group {group.name} rank {group.rank} finished at step {state.step}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
