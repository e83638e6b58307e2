"""One rank of the FSDP2 world: fully_shard on CPU, a few Adam steps, then a DCP save and load.

    dist_fsdp.py OUT_DIR BACKEND [hsdp]

With ``hsdp``, every layer is sharded over a two-dimensional DeviceMesh (2 replicas x size/2
shards: HSDP), whose groups are groups of some ranks (new_group).

The full parameters after training (gathered by ``full_tensor()``), and whether a fresh sharded
model loads back exactly what ``torch.distributed.checkpoint.save`` wrote, go to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import ringserve.torch.distributed  # noqa: F401

STEPS = 3


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def sharded(seed: int, mesh: DeviceMesh | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = net()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    out, backend = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=size)
    mesh = None
    if sys.argv[3:] == ["hsdp"]:
        mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
    model = sharded(0, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).sum().backward()
        optimizer.step()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    checkpoint = out / f"checkpoint_{backend}"
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=checkpoint)
    fresh = sharded(1, mesh)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    fresh_optimizer.zero_grad()
    fresh(torch.zeros(1, 16)).sum().backward()
    fresh_optimizer.step()  # so that its state exists, to be loaded into
    state = {"model": fresh.state_dict(), "optimizer": fresh_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint)
    fresh.load_state_dict(state["model"])
    loaded = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    torch.save({"rank": dist.get_rank(), "full": full, "loaded": loaded}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
