"""ringserve on a Ray cluster, in the shape of ``horovod.ray``.

- ``RayExecutor``: ringserve workers as Ray actors placed with a placement group; the coordinator
  runs in the driver. ``start()``, ``run(fn, args=..., kwargs=...)`` (one result per rank, in rank
  order), ``run_remote`` (ObjectRefs), ``execute``, ``execute_single``, ``shutdown()``. With
  ``min_workers``/``max_workers`` it is elastic: a dead actor is replaced, and the others go on
  from their last commit. See programs/executor.py.
- Ray Train: ``TorchTrainer(..., torch_config=ringserve.ray.RingserveConfig())`` runs the torch
  process group on the "ringserve" backend with nothing else to set up; Ray's own
  ``TorchConfig(backend="ringserve")`` works too once the workers import the backend, which
  ``register_torch_backend`` does as Ray's worker setup hook (see train.py).

Example:
    ```python
    import ringserve.ray

    ex = ringserve.ray.RayExecutor(ringserve.ray.RayExecutor.create_settings(timeout_s=30),
                                   num_workers=4, cpus_per_worker=1, use_gpu=False)
    ex.start()
    results = ex.run(train_fn, args=[cfg])
    ex.shutdown()
    ```

Ray is an optional dependency (``pip install 'ringserve[ray]'``): without it, taking RayExecutor
(or RingserveConfig) from this package raises an ImportError that names the extra.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RayExecutor", "RaySettings", "RayWorkerError", "RingserveConfig", "register_torch_backend"]

_FROM = {"RayExecutor": "executor", "RaySettings": "settings", "RayWorkerError": "settings",
         "RingserveConfig": "train"}


def register_torch_backend() -> None:
    """Registers the "ringserve" torch.distributed backend in this process.

    As Ray's worker setup hook it makes Ray Train's own ``TorchConfig(backend="ringserve")`` work:

    ```python
    RunConfig(worker_runtime_env={"worker_process_setup_hook": "ringserve.ray.register_torch_backend"})
    ```
    """
    from ringserve.torch.distributed import register

    register()


def __getattr__(name: str) -> Any:
    # Imported on use: Ray is an extra, and Ray Train's TorchConfig needs torch too.
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'ringserve.ray' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"ringserve.ray.{module}"), name)
