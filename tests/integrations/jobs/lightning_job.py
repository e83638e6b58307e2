"""One rank of a Lightning job: a Trainer with DDPStrategy on CPU, on the backend given.

    lightning_job.py OUT_DIR BACKEND DEVICES

A tiny regression model, fixed seeds and data, a few steps of SGD; rank 0 saves the first and the
final parameters to OUT_DIR/params.pt. Under ``ringserve run`` (or torchrun) Lightning finds
torchrun's variables and starts nothing; run alone, with DEVICES > 1, Lightning's own launcher
starts the other ranks as subprocesses of this script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import ringserve.torch.distributed  # noqa: F401  registers the "ringserve" backend with torch

STEPS = 6


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    out_dir, backend, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    L.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)
    model = Regressor()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=1, max_steps=STEPS,
                        strategy=DDPStrategy(process_group_backend=backend),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    trainer.fit(model, data)
    assert torch.distributed.get_backend() == backend, torch.distributed.get_backend()
    if trainer.global_rank == 0:
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"init": init, "final": final}, out_dir / "params.pt")
        print(f"trained {trainer.global_step} steps on {trainer.world_size} ranks over {backend}", flush=True)


if __name__ == "__main__":
    main()
