"""Ray Train step time: TorchTrainer on the "ringserve" backend against TorchTrainer on gloo, in one run.

    bash scripts/test_ray.sh --co -q >/dev/null   # or any way of installing the ray extra first
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 python benchmarks/ray_train.py
    python benchmarks/ray_train.py --workers 2 --steps 40 --rounds 2

One local Ray cluster (on 127.0.0.1) runs, in each round and one after the other, the same
TorchTrainer loop with ``TorchConfig(backend="gloo")`` and with ringserve's ``RingserveConfig()``:
DistributedDataParallel (``ray.train.torch.prepare_model``) over an MLP 784-2048-2048-10 (5.8M
float32 parameters), SGD, a batch of 64 per worker, one torch thread per worker. A step is
zero_grad, forward, backward and optimizer step; the first ``--warmup`` steps are not timed. Each
worker times its steps, and the slowest rank's median is the run's step time. The table gives each
backend's best round and the ratio ringserve / gloo paired within each round (median and range):
below 1 is faster than gloo. Process-group setup and Ray's own start are not timed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import table

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the cluster on 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

BATCH = 64


def train_loop(config: dict[str, Any]) -> None:
    import statistics
    import time

    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
    times = []
    for step in range(config["warmup"] + config["steps"]):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        if step >= config["warmup"]:
            times.append(time.perf_counter() - start)
    medians: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(medians, statistics.median(times))
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if dist.get_rank() == 0:
            pathlib.Path(folder, "done").write_text("1")
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"step_s": max(medians), "backend": dist.get_backend()}, checkpoint=checkpoint)


def _fit(torch_config: Any, workers: int, steps: int, warmup: int, storage: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop, train_loop_config={"steps": steps, "warmup": warmup},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=torch_config, run_config=RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return float(result.metrics["step_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import ray
    from ray.train.torch import TorchConfig

    from ringserve.ray import RingserveConfig

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RINGSERVE_HEARTBEAT_TIMEOUT_S": "30"}})
    results: dict[str, list[float]] = {"gloo": [], "ringserve": []}
    try:
        with tempfile.TemporaryDirectory() as storage:
            for _ in range(args.rounds):
                results["gloo"].append(_fit(TorchConfig(backend="gloo"), args.workers, args.steps, args.warmup, storage))
                results["ringserve"].append(_fit(RingserveConfig(), args.workers, args.steps, args.warmup, storage))
    finally:
        ray.shutdown()
    ratios = [r / g for r, g in zip(results["ringserve"], results["gloo"], strict=True)]
    rows: list[dict[str, object]] = [
        {"backend": "gloo (TorchConfig)", "step": f"{min(results['gloo']) * 1e3:.1f} ms", "ratio": "1"},
        {"backend": "ringserve (RingserveConfig)", "step": f"{min(results['ringserve']) * 1e3:.1f} ms",
         "ratio": f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"},
    ]
    print(f"Ray Train, DDP over an MLP of 5.8M parameters, {args.workers} workers, batch {BATCH} each, "
          f"{args.steps} timed steps, {args.rounds} rounds")
    print(table(rows, [("backend", "backend"), ("step", "step (slowest rank, best round)"),
                       ("ratio", "ratio to gloo (median, range)")]))


if __name__ == "__main__":
    main()
