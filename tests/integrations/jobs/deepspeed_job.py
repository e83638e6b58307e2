"""One rank of a DeepSpeed job on CPU, on the backend given.

    deepspeed_job.py OUT_DIR BACKEND STAGE

``deepspeed.init_distributed(dist_backend=BACKEND)``, then ``deepspeed.initialize`` with ZeRO
stage STAGE (1, 2 or 3) and a plain torch optimizer (DeepSpeed's own CPU Adam is an op it compiles at
first use: the backend is what is under test here, not DeepSpeed's kernels). A tiny model, fixed seeds and data, a few
steps; rank 0 saves the first and the final parameters to
OUT_DIR/params.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import ringserve.torch.distributed  # noqa: F401  registers the "ringserve" backend with torch

STEPS = 6
BATCH = 8


def main() -> None:
    out_dir, backend, stage = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == backend, dist.get_backend()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        # Small buckets: several reductions per step. At stage 3, no parameter is kept whole on every
        # rank (DeepSpeed keeps those under 100k elements so by default, which would be all of these).
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
                              "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * world * BATCH, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(len(x), 1, generator=g)
    for step in range(STEPS):
        lo = (step * world + rank) * BATCH
        loss = torch.nn.functional.mse_loss(engine(x[lo:lo + BATCH]), y[lo:lo + BATCH])
        engine.backward(loss)
        engine.step()
    if stage == 3:  # each rank holds a shard of the parameters, not all of them
        params = list(engine.module.parameters())
        assert sum(p.ds_tensor.numel() for p in params) < sum(p.ds_numel for p in params)
    # At stage 3 the parameters are gathered whole on every rank (a collective); a no-op at 1 and 2.
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        final = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        torch.save({"init": init, "final": final}, out_dir / "params.pt")
        print(f"trained {STEPS} steps with ZeRO stage {stage} on {world} ranks over {dist.get_backend()}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
