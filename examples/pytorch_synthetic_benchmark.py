"""Images per second of a conv net trained on synthetic data, in the shape of Horovod's
pytorch_synthetic_benchmark.py, written afresh for ringserve.

    ringserve run -np 4 python examples/pytorch_synthetic_benchmark.py
    ringserve run -np 8 -H host1:4,host2:4 python examples/pytorch_synthetic_benchmark.py --model resnet18
    python examples/pytorch_synthetic_benchmark.py --model vgg8 --fp16-allreduce --batch-size 16

The models are defined here (torchvision's wheels do not load beside this torch build): ``lenet5``,
``vgg8``, ``resnet10`` and ``resnet18`` (the ResNet-18 layout at a width of your choosing). Each
step is a forward and backward pass on one random batch, gradients averaged by
DistributedOptimizer (``--fp16-allreduce``: in fp16 on the wire). After the warm-up batches it
times ``--num-iters`` iterations of ``--num-batches-per-iter`` batches, and rank 0 prints each
iteration's images/s per worker, their mean with a 95% interval, and the total over the workers.
At the end the ranks compare their parameters' digests (the benchmark trains, so they must agree).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import timeit
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import ringserve.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="ringserve synthetic benchmark (PyTorch)")
    parser.add_argument("--model", default="resnet10", choices=sorted(MODELS), help="the model to train")
    parser.add_argument("--batch-size", type=int, default=32, help="images per batch on each worker")
    parser.add_argument("--image-size", type=int, default=64, help="height and width of the synthetic images")
    parser.add_argument("--num-classes", type=int, default=100)
    parser.add_argument("--width", type=int, default=32, help="channels of the first stage (vgg, resnet)")
    parser.add_argument("--num-warmup-batches", type=int, default=5, help="batches before timing starts")
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="batches in one timed iteration")
    parser.add_argument("--num-iters", type=int, default=5, help="timed iterations")
    parser.add_argument("--fp16-allreduce", action="store_true", help="average the gradients in fp16 on the wire")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: cores / local size)")
    parser.add_argument("--np", type=int, default=2, help="workers to launch when not run by `ringserve run`")
    return parser.parse_args(argv)


def lenet5(num_classes: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(5), nn.Flatten(),
        nn.Linear(16 * 25, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes),
    )


def vgg8(num_classes: int, width: int) -> nn.Module:
    layers: list[nn.Module] = []
    channels = 3
    for stage, repeats in enumerate((1, 1, 2, 2)):
        for _ in range(repeats):
            out = width * 2 ** stage
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            channels = out
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(channels, 256), nn.ReLU(inplace=True), nn.Linear(256, num_classes))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (ResNet's basic block)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet(blocks: tuple[int, ...]) -> Callable[[int, int], nn.Module]:
    """A ResNet of basic blocks, ``blocks[i]`` in stage i (ResNet-18: 2, 2, 2, 2)."""

    def build(num_classes: int, width: int) -> nn.Module:
        layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        channels = width
        for stage, count in enumerate(blocks):
            out = width * 2 ** stage
            for i in range(count):
                layers.append(BasicBlock(channels, out, 2 if i == 0 and stage > 0 else 1))
                channels = out
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))
    return build


MODELS = {"lenet5": lenet5, "vgg8": vgg8, "resnet10": resnet((1, 1, 1, 1)), "resnet18": resnet((2, 2, 2, 2))}


def digest(model: nn.Module) -> str:
    """The parameters' digest (not the buffers': batch norm's running statistics are each rank's
    own, as in Horovod, which averages gradients only)."""
    h = hashlib.sha256()
    for tensor in model.parameters():
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def benchmark(args: argparse.Namespace) -> int:
    hvd.init()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))
    torch.manual_seed(hvd.rank())  # the broadcast below makes the models equal
    model = MODELS[args.model](args.num_classes, args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, args.num_classes, (args.batch_size,))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(data), target).backward()
        optimizer.step()

    def say(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    params = sum(p.numel() for p in model.parameters())
    say(f"Model: {args.model} ({params / 1e6:.2f} M parameters), batch size {args.batch_size}, "
        f"images {args.image_size}x{args.image_size}, {hvd.size()} workers"
        f"{', fp16 allreduce' if args.fp16_allreduce else ''}")
    say("Running warmup...")
    timeit.timeit(step, number=args.num_warmup_batches)
    say("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        say(f"Iter #{i}: {rate:.1f} img/sec per worker")
        rates.append(rate)
    mean, interval = float(np.mean(rates)), 1.96 * float(np.std(rates))
    say(f"Img/sec per worker: {mean:.1f} +-{interval:.1f}")
    say(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * mean:.1f} +-{hvd.size() * interval:.1f}")
    digests = hvd.allgather_object(digest(model))
    agree = len(set(digests)) == 1
    say(f"all {hvd.size()} ranks hold identical parameters" if agree else f"ERROR: the ranks' parameters differ: {digests}")
    hvd.shutdown()
    return 0 if agree else 1


def main() -> int:
    args = parse_args()
    if "RINGSERVE_COORDINATOR" in os.environ:
        return benchmark(args)
    from ringserve.launch import launch  # not under a launcher: be one, for args.np workers

    return launch(args.np, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]).code


if __name__ == "__main__":
    sys.exit(main())
