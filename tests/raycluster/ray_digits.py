"""Training functions that the Ray tests run on their workers: the digits demo's model and data
(examples/train_digits.py), trained so that the result does not depend on the world's size.

Each step takes one global batch of ``batch`` digits from a permutation seeded by the epoch; rank
``r`` of ``n`` takes its ``batch / n`` slice, and DistributedOptimizer averages the ranks' mean
gradients, which is the mean gradient of the global batch. So 2 workers, 4 workers and one process
(``train_reference``) take the same steps, up to the order of float additions.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from train_digits import mlp, parameter_digest

HIDDEN = 64
# Every Ray worker's environment in the tests. A process of a loaded 2-core machine (Ray's own
# processes, and the workers of two jobs) can be descheduled for seconds: the coordinators that Ray
# Train's rank 0 starts (configured from the environment, rendezvous.py) get a heartbeat timeout with
# room for that.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "RINGSERVE_HEARTBEAT_TIMEOUT_S": "30"}


def digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=seed, stratify=y)
    return (torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train),
            torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test))


def _flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
           epochs: int, batch: int, rank: int, size: int) -> float:
    loss_fn = torch.nn.CrossEntropyLoss()
    per = batch // size
    loss = torch.tensor(0.0)
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + epoch))
        for step in range(len(x) // batch):
            idx = order[step * batch: (step + 1) * batch][rank * per: (rank + 1) * per]
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
    return float(loss)


def train_reference(epochs: int, seed: int, batch: int) -> np.ndarray:
    """One process, the same steps: the parameters every world size must reach."""
    torch.set_num_threads(1)
    x, y, _, _ = digits(seed)
    torch.manual_seed(seed)
    model = mlp(HIDDEN)
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, y, epochs, batch, 0, 1)
    return _flat(model)


def train(epochs: int, seed: int, batch: int) -> dict[str, Any]:
    """The digits demo on this RayExecutor worker (ringserve.torch, Horovod's API)."""
    import ringserve.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    x, y, xt, yt = digits(seed)
    torch.manual_seed(seed + 17 * rank)  # different on each rank: the broadcast makes them equal
    model = mlp(HIDDEN)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(seed)
    reference_init = mlp(HIDDEN)  # what rank 0 started from, as train_reference does
    if rank == 0:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference_init.parameters(), strict=True))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    loss = _steps(model, optimizer, x, y, epochs, batch, rank, size)
    with torch.no_grad():
        accuracy = float((model(xt).argmax(1) == yt).float().mean())
    digests = hvd.allgather_object(parameter_digest(model))
    hvd.shutdown()
    return {"rank": rank, "size": size, "params": _flat(model), "digest": digests[rank],
            "identical": len(set(digests)) == 1, "loss": loss, "accuracy": accuracy}


def train_elastic(epochs: int, seed: int, step_delay_s: float) -> dict[str, Any]:
    """The elastic digits demo (examples/train_digits_elastic.py's loop, a commit every step), slowed
    by ``step_delay_s`` a step so that a test can kill a worker while it trains. It leaves ringserve
    initialized, so that the executor learns the rank each worker ended in."""
    import ringserve.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    x, y, _, _ = digits(seed)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    model = mlp(HIDDEN)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model.named_parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0)
    sizes: list[int] = []

    @hvd.elastic.run
    def run(state: Any) -> None:
        sizes.append(hvd.size())
        while state.epoch < epochs:
            for batch, (xb, yb) in enumerate(loader):
                optimizer.zero_grad()
                loss_fn(model(xb), yb).backward()
                optimizer.step()
                state.sampler.record_batch(batch, 32)
                state.steps += 1
                state.commit()
                time.sleep(step_delay_s)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    run(state)
    digests = hvd.allgather_object(parameter_digest(model), name="digests")
    return {"digest": parameter_digest(model), "identical": len(set(digests)) == 1, "epoch": state.epoch,
            "steps": state.steps, "sizes": sizes, "size": hvd.size()}


def train_loop(config: dict[str, Any]) -> None:
    """A Ray Train worker's loop: the digits demo under DistributedDataParallel on the process group
    Ray set up (the "ringserve" backend), each rank on its shard; rank 0 reports the metrics."""
    import hashlib
    import pathlib
    import tempfile

    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    x, y, xt, yt = digits(0)
    torch.manual_seed(rank)  # different everywhere: DDP broadcasts rank 0's parameters
    model = ray.train.torch.prepare_model(mlp(64))  # DistributedDataParallel over the process group
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * size, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    per = len(x) // size
    xs, ys = x[rank * per: (rank + 1) * per], y[rank * per: (rank + 1) * per]
    first = last = 0.0
    for epoch in range(config["epochs"]):
        order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for step in range(len(xs) // 32):
            idx = order[step * 32: (step + 1) * 32]
            optimizer.zero_grad()
            loss = loss_fn(model(xs[idx]), ys[idx])
            loss.backward()
            optimizer.step()
            total += loss.item()
        last = total / (len(xs) // 32)
        first = first or last
    with torch.no_grad():
        accuracy = float((model(xt).argmax(1) == yt).float().mean())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests: list[Any] = [None] * size
    dist.all_gather_object(digests, digest)
    metrics = {"backend": dist.get_backend(), "size": size, "identical": len(set(digests)) == 1,
               "first_loss": first, "last_loss": last, "accuracy": accuracy}
    # Ray Train keeps the metrics that come with a checkpoint: rank 0 saves its digest as one.
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            pathlib.Path(folder, "digest").write_text(digest)
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint)
