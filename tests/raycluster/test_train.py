"""Ray Train's TorchTrainer on the "ringserve" torch.distributed backend, on a real local Ray cluster:
ringserve's RingserveConfig (nothing else set up), and Ray's own TorchConfig(backend="ringserve") from
a driver whose job registers the backend with Ray's worker setup hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ray_digits import WORKER_ENV

pytestmark = pytest.mark.ray


EPOCHS = 8
JOB = Path(__file__).resolve().parent / "torchconfig_job.py"


def _check(metrics: dict[str, Any]) -> None:
    assert metrics["backend"] == "ringserve" and metrics["size"] == 2, metrics
    assert metrics["identical"], "the ranks' parameters differ"
    assert metrics["last_loss"] < metrics["first_loss"] / 3 and metrics["accuracy"] > 0.9, metrics


@pytest.mark.timeout(400)
def test_torchtrainer_trains_with_ringserve_config_and_nothing_else_set_up(ray_cluster: Any, tmp_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray_digits import train_loop

    from ringserve.ray import RingserveConfig

    trainer = TorchTrainer(
        train_loop, train_loop_config={"epochs": EPOCHS},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=RingserveConfig(), run_config=RunConfig(storage_path=str(tmp_path), name="digits"),
    )
    result = trainer.fit()
    assert result.error is None, result.error
    _check(dict(result.metrics))


@pytest.mark.timeout(400)
def test_torchtrainer_trains_with_ray_trains_own_torchconfig_on_the_ringserve_backend(ray_cluster: Any, tmp_path: Path) -> None:
    # A second driver on the same cluster, as a user's script would be: its job's runtime_env names
    # ringserve's setup hook, so that every worker of that job has the backend registered.
    address = ray_cluster.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, str(JOB), address, str(tmp_path), str(EPOCHS)], capture_output=True,
                          text=True, timeout=360, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                                                    "WORKER_ENV": json.dumps(WORKER_ENV)})
    assert done.returncode == 0, done.stderr[-4000:]
    _check(json.loads(done.stdout.strip().splitlines()[-1]))
