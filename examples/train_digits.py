"""Trains an MLP on scikit-learn's handwritten digits with ringserve.torch on several workers.

    ringserve run -np 4 python examples/train_digits.py      # 4 workers under the launcher
    python examples/train_digits.py --np 4                   # the same: it launches itself
    python examples/train_digits.py --compression int8       # int8 gradients with error feedback

The data ships inside scikit-learn (``load_digits``), so nothing is downloaded. Each worker trains
on its quarter of the training set; DistributedOptimizer averages the gradients. Rank 0 shows a
progress bar and prints the loss and the test accuracy. At the end every rank hashes its
parameters, the hashes are gathered, and the program exits non-zero unless all are identical.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import ringserve.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4, help="workers to launch when not run by `ringserve run`")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compression", choices=["none", "fp16", "bf16", "int8"], default="none",
                        help="how gradients travel on the wire")
    parser.add_argument("--fp16", action="store_const", dest="compression", const="fp16", help="--compression fp16")
    parser.add_argument("--no-error-feedback", action="store_true",
                        help="with a lossy compression, drop what each step's encoding lost")
    return parser.parse_args(argv)


def mlp(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def shard(x: np.ndarray, y: np.ndarray, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s equal share (the last rows that do not divide evenly are dropped)."""
    per = len(x) // size
    part = slice(rank * per, (rank + 1) * per)
    return torch.tensor(x[part], dtype=torch.float32), torch.tensor(y[part])


def parameter_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(args: argparse.Namespace) -> int:
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.25, random_state=args.seed, stratify=y)
    xs, ys = shard(x_train, y_train, rank, size)
    xt, yt = shard(x_test, y_test, rank, size)

    torch.manual_seed(args.seed + rank)  # different on each rank: the broadcast makes them equal
    model = mlp(args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * size)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    lossy = args.compression != "none"
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, args.compression),
        error_feedback=lossy and not args.no_error_feedback)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = len(xs) // args.batch_size

    bar = tqdm(range(1, args.epochs + 1), desc=f"digits on {size} workers", disable=rank != 0,
               unit="epoch", file=sys.stdout, mininterval=0.5)
    for epoch in bar:
        model.train()
        order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(epoch * 1000 + rank))
        total = 0.0
        for step in range(steps):
            idx = order[step * args.batch_size: (step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(xs[idx]), ys[idx])
            loss.backward()
            optimizer.step()
            total += loss.item()
        train_loss = hvd.allreduce(torch.tensor(total / steps), name="train_loss").item()
        model.eval()
        with torch.no_grad():
            correct = (model(xt).argmax(1) == yt).sum()
        counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(yt))]), op=hvd.Sum, name="accuracy")
        accuracy = counts[0].item() / counts[1].item()
        bar.set_postfix(loss=f"{train_loss:.4f}", accuracy=f"{accuracy:.1%}")
    bar.close()
    if rank == 0:
        print(f"final: train loss {train_loss:.4f}, test accuracy {accuracy:.2%} "
              f"({int(counts[0])}/{int(counts[1])} test digits)", flush=True)

    digests = hvd.allgather_object(parameter_digest(model))
    identical = len(set(digests)) == 1
    if rank == 0:
        if identical:
            print(f"all {size} ranks hold identical parameters (sha256 {digests[0][:16]}...)", flush=True)
        else:
            print(f"ERROR: the ranks' parameters differ: {digests}", flush=True)
    hvd.shutdown()
    return 0 if identical else 1


def main() -> int:
    args = parse_args()
    if "RINGSERVE_COORDINATOR" in os.environ:
        return train(args)
    # Not started by a launcher: start a coordinator and args.np workers of this same script.
    from ringserve.launch import launch

    return launch(args.np, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]).code


if __name__ == "__main__":
    sys.exit(main())
