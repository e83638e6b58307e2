"""A training script written for Horovod, in the style of Horovod's own PyTorch MNIST example.

The test runs a copy of this file in which the one line ``import horovod.torch as hvd`` is replaced
by ``import ringserve.torch as hvd``; nothing else changes. The data is synthetic (no download).
"""

from __future__ import annotations

import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from torch import nn, optim

parser = argparse.ArgumentParser(description="PyTorch synthetic example")
parser.add_argument("save_dir", nargs="?", default=".", help="where each rank saves its checkpoint")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size for training")
parser.add_argument("--test-batch-size", type=int, default=100, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=4, help="batches between log lines")
parser.add_argument("--fp16-allreduce", action="store_true", default=True, help="use fp16 compression")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0, help="predivide factor")
parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")


def synthetic(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 20, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ teacher).argmax(1))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def metric_average(val: float, name: str) -> float:
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic(1024, 1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = synthetic(400, 2)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            with optimizer.skip_synchronize():
                optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}")

        model.eval()
        test_loss = 0.0
        test_accuracy = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.argmax(dim=1)
                test_accuracy += pred.eq(target).float().sum().item()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%")

    torch.save(model.state_dict(), os.path.join(args.save_dir, f"checkpoint-rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main()
