"""Ray Train's TorchTrainer on the "ringserve" torch.distributed backend, on a real local Ray cluster:
Ray's own TorchConfig(backend="ringserve") (with ringserve's worker setup hook), and RingserveConfig."""

from __future__ import annotations

from typing import Any

import pytest

EPOCHS = 8


def train_loop(config: dict[str, Any]) -> None:
    import hashlib

    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from ray_digits import digits
    from train_digits import mlp

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
    ray.train.report({"backend": dist.get_backend(), "size": size, "identical": len(set(digests)) == 1,
                      "first_loss": first, "last_loss": last, "accuracy": accuracy})


def _fit(torch_config: Any, tmp_path: Any, runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop, train_loop_config={"epochs": EPOCHS},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=torch_config,
        run_config=RunConfig(storage_path=str(tmp_path), name="digits", worker_runtime_env=runtime_env or {}),
    )
    result = trainer.fit()
    assert result.error is None, result.error
    return dict(result.metrics)


def _check(metrics: dict[str, Any]) -> None:
    assert metrics["backend"] == "ringserve" and metrics["size"] == 2, metrics
    assert metrics["identical"], "the ranks' parameters differ"
    assert metrics["last_loss"] < metrics["first_loss"] / 3 and metrics["accuracy"] > 0.9, metrics


@pytest.mark.timeout(400)
def test_torchtrainer_trains_with_ray_trains_own_torchconfig_on_the_ringserve_backend(ray_cluster: Any, tmp_path: Any) -> None:
    from ray.train.torch import TorchConfig

    hook = {"worker_process_setup_hook": "ringserve.ray.register_torch_backend"}
    _check(_fit(TorchConfig(backend="ringserve"), tmp_path, hook))


@pytest.mark.timeout(400)
def test_torchtrainer_trains_with_ringserve_config_and_nothing_else_set_up(ray_cluster: Any, tmp_path: Any) -> None:
    from ringserve.ray import RingserveConfig

    _check(_fit(RingserveConfig(), tmp_path))
