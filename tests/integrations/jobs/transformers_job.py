"""One rank of a transformers Trainer job on CPU, on the backend given.

    transformers_job.py OUT_DIR BACKEND

A tiny GPT-2 built from a config (no download), random token sequences, a few steps of the
Trainer's AdamW. ``TrainingArguments(ddp_backend=...)`` names only the backends Accelerate knows,
and Accelerate refuses any other on CPU; so for BACKEND=ringserve the script makes the process
group first, from the launcher's env:// variables, and leaves ``ddp_backend`` unset: the Trainer
takes the group it finds. For BACKEND=gloo it is the Trainer's own path (``ddp_backend="gloo"``).
Rank 0 saves the first and the final parameters to OUT_DIR/params.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

import ringserve.torch.distributed  # noqa: F401  registers the "ringserve" backend with torch

STEPS = 4


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """64 random sequences of 16 tokens, the same on every rank."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    if backend != "gloo":
        dist.init_process_group(backend)
    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(out_dir / "trainer"), use_cpu=True, max_steps=STEPS,
                             per_device_train_batch_size=4, learning_rate=1e-3, seed=0, data_seed=0,
                             ddp_backend="gloo" if backend == "gloo" else None, report_to="none",
                             save_strategy="no", logging_steps=1, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    result = trainer.train()
    assert dist.get_backend() == backend and args.world_size == dist.get_world_size(), (
        dist.get_backend(), args.world_size)
    if args.process_index == 0:
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"init": init, "final": final}, out_dir / "params.pt")
        print(f"trained {result.global_step} steps on {args.world_size} ranks over {dist.get_backend()}; "
              f"loss {result.training_loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
