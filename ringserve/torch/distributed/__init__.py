"""torch.distributed's "ringserve" backend: DDP, ZeRO, FSDP2 and DCP scripts run on ringserve.

Importing this module (``import ringserve.torch`` does) registers the backend and the
``ringserve://`` rendezvous with torch:

```python
import torch.distributed as dist
import ringserve.torch.distributed  # noqa: F401

dist.init_process_group("ringserve")          # under `ringserve run` or torchrun
# or dist.init_process_group("ringserve", init_method="ringserve://coordinator:50051")
model = torch.nn.parallel.DistributedDataParallel(model)
```

How a job finds its world: rendezvous.py. Ops and how each runs on the ring: ops.py. The seam to
ringserve's worker (new_group's sub-rings, send/recv, all_to_all): plane.py.
Options (compression and the rest): settings.py. Errors: a peer's death or any ringserve failure
is a ``torch.distributed.DistBackendError`` with ringserve's error as its cause (work.py).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler

from ringserve.torch.distributed.group import BACKEND_NAME, ProcessGroupRingserve, create
from ringserve.torch.distributed.rendezvous import SCHEME, ringserve_rendezvous
from ringserve.torch.distributed.settings import Options
from ringserve.torch.distributed.work import RingserveWork

__all__ = ["BACKEND_NAME", "Options", "ProcessGroupRingserve", "RingserveWork", "register"]


def register() -> None:
    """Registers the "ringserve" backend and the ringserve:// rendezvous with torch (again: a no-op)."""
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])
    with contextlib.suppress(RuntimeError):  # "already registered": an earlier import did it
        register_rendezvous_handler(SCHEME, ringserve_rendezvous)


register()
