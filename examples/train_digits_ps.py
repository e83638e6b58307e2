"""The digits demo through the parameter server: the shards hold the model, each worker trains on its share.

    ringserve run --ps 2 -np 4 python examples/train_digits_ps.py                  # 2 shards, 4 workers, ssp
    ringserve run --ps 2 -np 4 python examples/train_digits_ps.py --mode async
    docker-compose --profile ps up --scale worker=4 --scale ps=2                     # the compose demo runs this

The workers do not wait for each other: in ssp mode (the default) a fast one runs at most
``--staleness`` steps ahead of the slowest, in async mode not even that; one that dies is dropped at
the next view and the others go on. The shards run Adam on the gradients the workers push (see
ringserve.torch.ps). Each worker trains ``--epochs`` passes over its share of the training set,
then prints ``rank R: test accuracy A after S steps``, scored on the whole test set with the
values it pulled last.
"""

from __future__ import annotations

import argparse
import sys

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from train_digits import mlp, shard

import ringserve as rs
from ringserve.torch.ps import ParameterServerOptimizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async", "ssp", "average"], default="ssp")
    parser.add_argument("--staleness", type=int, default=2, help="ssp: steps a worker may run ahead")
    parser.add_argument("--epochs", type=int, default=20, help="passes over this worker's share")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.25, random_state=args.seed, stratify=y)
    torch.manual_seed(args.seed)
    model = mlp(args.hidden)
    adam = torch.optim.Adam(model.parameters(), lr=args.lr)
    rs.init()  # after the slow imports and the optimizer's first construction (a no-op if joined)
    rank, size = rs.rank(), rs.size()
    xs, ys = shard(x_train, y_train, rank, size)
    xt, yt = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)
    opt = ParameterServerOptimizer(adam, model, mode=args.mode, staleness=args.staleness)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(epoch * 1000 + rank))
        for start in range(0, len(xs) - args.batch_size + 1, args.batch_size):
            idx = order[start : start + args.batch_size]
            opt.zero_grad()
            loss_fn(model(xs[idx]), ys[idx]).backward()
            opt.step()
            steps += 1
    opt.synchronize()
    with torch.no_grad():
        accuracy = (model(xt).argmax(1) == yt).float().mean().item()
    print(f"rank {rank}: test accuracy {accuracy:.2%} after {steps} steps ({args.mode} mode, "
          f"shard versions {opt.client.versions})", flush=True)
    opt.close()
    rs.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
