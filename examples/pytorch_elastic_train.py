"""Elastic training with ringserve.torch, in the shape of Horovod's elastic PyTorch examples, written
afresh: workers may come and go while it trains, and it goes on from the last commit.

    ringserve run -np 2 python examples/pytorch_elastic_train.py
    ringserve run -np 2 --min-np 1 --max-np 4 --restart-failed python examples/pytorch_elastic_train.py
    ringserve run -np 4 --min-np 2 --max-np 8 --host-discovery-script ./discover_hosts.sh \\
        python examples/pytorch_elastic_train.py --epochs 30

It trains an MLP on scikit-learn's handwritten digits (shipped with the package, so nothing is
downloaded). What makes it elastic, as in Horovod:

- the training loop is a function decorated with ``hvd.elastic.run``, whose first argument is a
  ``hvd.elastic.TorchState`` holding the model, the optimizer, the ``ElasticSampler`` and the
  epoch; no collective runs before it (the state is synced from rank 0 when it starts, and
  again after every change of the world);
- ``state.commit()`` every ``--batches-per-commit`` batches saves the state in memory: a worker
  that fails rolls the others back to it, and workers join or leave (SIGTERM) at a commit;
- the ``ElasticSampler`` deals the batches this epoch has left to the current world, so a world
  that changes mid-epoch neither repeats nor skips samples;
- a reset callback scales the learning rate with the new world size.

At the end rank 0 prints the test accuracy, and the ranks check that their parameters agree.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ringserve.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="ringserve elastic training example (PyTorch)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--batches-per-commit", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05, help="for one worker; scaled by the world size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--np", type=int, default=2, help="workers to launch when not run by `ringserve run`")
    return parser.parse_args(argv)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for tensor in model.parameters():
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main_worker(args: argparse.Namespace) -> int:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=args.seed,
                                                        stratify=y)
    train_set = torch.utils.data.TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
    test_x, test_y = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    loss_fn = torch.nn.CrossEntropyLoss()

    def on_state_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"world of {hvd.size()} workers; learning rate {args.lr * hvd.size():g}", flush=True)

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, args.epochs):  # noqa: B020  Horovod's idiom: a reset resumes at the epoch
            state.model.train()
            total, batches = 0.0, 0
            for batch_idx, (data, target) in enumerate(loader):
                optimizer.zero_grad()
                loss = loss_fn(state.model(data), target)
                loss.backward()
                optimizer.step()
                total, batches = total + loss.item(), batches + 1
                state.sampler.record_batch(batch_idx, args.batch_size)
                if batch_idx % args.batches_per_commit == 0:
                    state.commit()
            mean_loss = hvd.allreduce(torch.tensor(total / max(batches, 1)), name="epoch_loss").item()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: loss {mean_loss:.4f} on {hvd.size()} workers", flush=True)
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()  # the epoch is done: a reset from here starts the next one

    train(state)
    with torch.no_grad():
        correct = (model(test_x).argmax(1) == test_y).sum()
    counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(test_y))]), op=hvd.Sum, name="accuracy")
    digests = hvd.allgather_object(digest(model))
    agree = len(set(digests)) == 1
    if hvd.rank() == 0:
        # Every rank evaluated the whole test set, so the counts are the world's size times one's.
        print(f"test accuracy {counts[0].item() / counts[1].item():.2%}", flush=True)
        print(f"all {hvd.size()} ranks hold identical parameters" if agree else
              f"ERROR: the ranks' parameters differ: {digests}", flush=True)
    hvd.shutdown()
    return 0 if agree else 1


def main() -> int:
    args = parse_args()
    if "RINGSERVE_COORDINATOR" in os.environ:
        return main_worker(args)
    from ringserve.launch import launch  # not under a launcher: be one, for args.np workers

    return launch(args.np, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], elastic=True).code


if __name__ == "__main__":
    sys.exit(main())
