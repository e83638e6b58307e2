"""The digits demo, elastic: workers may join, leave (SIGTERM) or die while it trains, and it finishes.

    ringserve run -np 4 --min-np 1 --max-np 8 python examples/train_digits_elastic.py
    python examples/train_digits_elastic.py --np 4              # the same: it launches itself
    docker-compose up --scale worker=4                          # the compose demo runs this script

What ends the job is the committed state, not the world: it trains ``--epochs`` passes over the
training set, and an ElasticSampler deals each epoch's remaining digits to whoever is in the world.
A world of 6 takes fewer steps per epoch than a world of 4, but every world stops at the same
committed epoch, and a worker that joins late stops there too. The state (model, optimizer,
sampler, epoch) is committed every ``--commit-every`` steps. At a commit the ranks admit waiting
workers (``--scale worker=6`` on a running job) and let go of a worker that got SIGTERM
(``docker stop``); a worker that dies (``docker kill``) costs the others the steps since their last
commit. The learning rate is the base rate times the world's size, set again whenever the world
changes.

At the end every rank prints the sha256 of its parameters (``rank R of N: parameters sha256 H``);
the hashes are gathered, rank 0 says whether all are identical, and a rank whose hash differs from
another's exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from train_digits import mlp, parameter_digest, shard

import ringserve.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4, help="workers to launch when not run by a launcher")
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set, whatever the world")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3, help="per worker: the rate is this times the world's size")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit-every", type=int, default=1, help="steps between commits")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> int:
    hvd.init()
    torch.set_num_threads(1)

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.25, random_state=args.seed, stratify=y)
    dataset = torch.utils.data.TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(args.seed + os.getpid())  # different everywhere: the first sync makes them equal
    model = mlp(args.hidden)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                         named_parameters=model.named_parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0, loss=0.0, accuracy=0.0)

    @hvd.elastic.run
    def run(state: hvd.elastic.TorchState) -> bool:
        # Called after every sync, with the world it will train in: the rate follows its size
        # (a restore or a sync brings back the rate of the world that committed).
        rank, size = hvd.rank(), hvd.size()
        for group in optimizer.param_groups:
            group["lr"] = args.lr * size
        if rank == 0:
            print(f"training on {size} workers from commit {state.commits} (epoch {state.epoch}, "
                  f"step {state.steps})", flush=True)
        while state.epoch < args.epochs:
            model.train()
            for batch, (xb, yb) in enumerate(loader):
                optimizer.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(batch, args.batch_size)
                state.steps += 1
                state.loss = loss.item()
                if state.steps % args.commit_every == 0:
                    state.commit()
            state.accuracy = evaluate(model, x_test, y_test)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            if rank == 0:
                print(f"epoch {state.epoch}/{args.epochs} on {size} workers: loss {state.loss:.4f} "
                      f"(rank 0's last batch), test accuracy {state.accuracy:.2%}", flush=True)
            state.commit()
        return check_identical(model)

    identical = run(state)
    hvd.shutdown()
    return 0 if identical else 1


def evaluate(model: torch.nn.Module, x_test: object, y_test: object) -> float:
    """Test accuracy over the whole test set, each rank scoring its share."""
    xt, yt = shard(x_test, y_test, hvd.rank(), hvd.size())  # type: ignore[arg-type]
    model.eval()
    with torch.no_grad():
        correct = (model(xt).argmax(1) == yt).sum()
    counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(yt))]), op=hvd.Sum, name="accuracy")
    return counts[0].item() / counts[1].item()


def check_identical(model: torch.nn.Module) -> bool:
    """Every rank prints its parameters' hash; all are gathered and compared."""
    mine = parameter_digest(model)
    rank, size = hvd.rank(), hvd.size()
    print(f"rank {rank} of {size}: parameters sha256 {mine}", flush=True)
    digests = hvd.allgather_object(mine, name="parameter_digests")
    identical = len(set(digests)) == 1
    if rank == 0:
        if identical:
            print(f"all {size} ranks hold identical parameters (sha256 {mine[:16]}...)", flush=True)
        else:
            print(f"ERROR: the ranks' parameters differ: {digests}", flush=True)
    return identical


def main() -> int:
    args = parse_args()
    if "RINGSERVE_COORDINATOR" in os.environ:
        return train(args)
    from ringserve.launch import launch

    return launch(args.np, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]).code


if __name__ == "__main__":
    sys.exit(main())
