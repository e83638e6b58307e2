"""A user's driver script: Ray Train's own TorchConfig(backend="ringserve"), with ringserve's worker
setup hook in the job's runtime_env. Prints rank 0's metrics as JSON on its last line.

    python torchconfig_job.py <gcs address> <storage path> <epochs>
"""

from __future__ import annotations

import json
import os
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer


def main(address: str, storage: str, epochs: int) -> None:
    ray.init(address=address, log_to_driver=False, runtime_env={
        "worker_process_setup_hook": "ringserve.ray.register_torch_backend",
        "env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], **json.loads(os.environ["WORKER_ENV"])},
    })
    from ray_digits import train_loop

    trainer = TorchTrainer(
        train_loop, train_loop_config={"epochs": epochs},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="ringserve"), run_config=RunConfig(storage_path=storage, name="digits"),
    )
    result = trainer.fit()
    ray.shutdown()
    print(json.dumps(dict(result.metrics)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
