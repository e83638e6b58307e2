"""Ray Train on the "ringserve" torch.distributed backend.

``TorchTrainer(..., torch_config=RingserveConfig())`` is Ray's ``TorchConfig(backend="ringserve")``
with one step more: before Ray sets up the process group, every training worker registers the
backend (``import ringserve.torch.distributed``), so nothing has to be imported or hooked by hand.
The rest is Ray's: it exports MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE and calls
``init_process_group("ringserve", init_method="env://")``; under that torchrun-style environment,
rank 0 starts the job's coordinator in its own process and the others find it through torch's store
(ringserve/torch/distributed/rendezvous.py). ``destroy_process_group`` at the end leaves the world
and stops that coordinator.

Example:
    ```python
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ringserve.ray import RingserveConfig

    trainer = TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=4),
                           torch_config=RingserveConfig())
    result = trainer.fit()
    ```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend
except ImportError:
    raise ImportError(
        "ringserve.ray.RingserveConfig needs Ray Train and torch: install them with "
        "`pip install 'ringserve[ray,torch]'` (torch==2.13.0 first, the CPU build; see scripts/setup.sh)."
    ) from None

from ringserve.torch.distributed import BACKEND_NAME


def _register() -> None:
    from ringserve.torch.distributed import register

    register()


class _RingserveBackend(_TorchBackend):
    """Ray's torch backend, after registering ringserve's in every training worker."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        worker_group.execute(_register)
        super().on_start(worker_group, backend_config)


@dataclass
class RingserveConfig(TorchConfig):
    """Ray Train's TorchConfig on the "ringserve" backend (see the module docstring).

    Attributes:
        backend: "ringserve" (a backend list such as "cpu:ringserve" works too).
        init_method: "env" (MASTER_ADDR/MASTER_PORT) or "tcp", as TorchConfig's.
        timeout_s: the collectives' deadline, as TorchConfig's.
    """

    backend: str | None = BACKEND_NAME

    @property
    def backend_cls(self) -> type:
        return _RingserveBackend
