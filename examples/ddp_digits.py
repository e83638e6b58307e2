"""A plain torch.distributed DDP script (digits, an MLP) whose backend string is "ringserve".

    ringserve run -np 4 python examples/ddp_digits.py              # under ringserve's launcher
    torchrun --standalone --nproc-per-node 4 examples/ddp_digits.py  # under torchrun
    torchrun --standalone --nproc-per-node 4 examples/ddp_digits.py --backend gloo   # the same on gloo

It is the usual shape, ``dist.init_process_group(backend, rank=rank, world_size=world_size)``, a
model in DistributedDataParallel, an optimizer, a DistributedSampler; only the backend string and
the import that registers it are ringserve's. The data ships inside scikit-learn. Rank 0 prints
the loss and the test accuracy; at the end the ranks compare their parameters' hashes, and the
program exits non-zero unless all are identical.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ringserve.torch.distributed  # noqa: F401  registers the "ringserve" backend


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ringserve")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, rank=rank, world_size=world_size)

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    train = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}", flush=True)

    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests: list[object] = [None] * world_size
    dist.all_gather_object(digests, digest)
    same = len(set(digests)) == 1
    if rank == 0:
        print(f"test accuracy {100 * accuracy:.2f}% on {world_size} workers over {dist.get_backend()}", flush=True)
        print(f"all {world_size} ranks hold identical parameters" if same else f"parameters differ: {digests}", flush=True)
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
