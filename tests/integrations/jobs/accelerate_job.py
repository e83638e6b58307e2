"""One rank of an Accelerate job on CPU, on the backend given.

    accelerate_job.py OUT_DIR BACKEND

Accelerate picks the CPU backend itself (gloo, or mpi) and refuses any other name; so for
BACKEND=ringserve the script makes the process group first, from the launcher's env:// variables,
and Accelerate takes the group it finds. For BACKEND=gloo it is Accelerate's own path, untouched.
A tiny model, fixed seeds and data, a few steps of Adam; rank 0 saves the first and the
final parameters to OUT_DIR/params.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import ringserve.torch.distributed  # noqa: F401  registers the "ringserve" backend with torch

STEPS = 6


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    if backend != "gloo":
        dist.init_process_group(backend)
    accelerator = Accelerator(cpu=True)
    assert dist.get_backend() == backend and accelerator.num_processes == dist.get_world_size(), (
        dist.get_backend(), accelerator.num_processes)
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    model.train()
    for step, (xb, yb) in enumerate(data):
        if step == STEPS:
            break
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
    # A collective of Accelerate's own, over the backend: every rank's last loss.
    losses = accelerator.gather(loss.detach()[None])
    assert losses.shape == (accelerator.num_processes,), losses.shape
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save({"init": init, "final": final}, out_dir / "params.pt")
        print(f"trained {STEPS} steps on {accelerator.num_processes} ranks over {dist.get_backend()} "
              f"({accelerator.distributed_type}); last losses {losses.tolist()}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
