"""ringserve: collective communication over gRPC.

Synchronous numpy API for training scripts:

```python
import ringserve as rs
rs.init()                                   # RINGSERVE_COORDINATOR or init(coordinator=...)
out = rs.allreduce(a, op="average", name="grad.w")
evens = rs.add_process_set(range(0, rs.size(), 2))   # on every rank, alike
if rs.rank() % 2 == 0:
    out = rs.allreduce(a, process_set=evens)       # over the even ranks only
rs.shutdown()
```

Asyncio API: ``async with ringserve.Worker(coordinator=...) as w: await w.allreduce(a)``.
Parameter-server mode: ``ringserve.ParameterServer`` and ``ringserve.ps`` (clients, optimizers).
``import ringserve`` never imports torch, and loads no layer until one of its names is read.
"""

from typing import TYPE_CHECKING

from ringserve._lazy import exports
from ringserve.errors import (
    CollectiveTimeoutError,
    CoordinatorUnreachableError,
    ExcludedError,
    InvalidArgumentError,
    MismatchError,
    NotInitializedError,
    PayloadLaneError,
    PeerUnavailableError,
    ProtocolError,
    RecoverableError,
    RendezvousTimeoutError,
    RingChangedError,
    RingserveError,
    ShardUnavailableError,
    StateLostError,
    TLSHandshakeError,
    UnsupportedError,
    UsageError,
    ViewInstallError,
    WorkerFailedError,
)

if TYPE_CHECKING:  # the same names, for type checkers: each is imported when first read (ringserve._lazy)
    from ringserve.api import (
        add_process_set,
        allgather,
        allgather_object,
        allreduce,
        alltoall,
        barrier,
        broadcast,
        broadcast_object,
        cross_rank,
        cross_size,
        global_process_set,
        grouped_allgather,
        grouped_reduce_scatter,
        init,
        is_initialized,
        join,
        local_rank,
        local_size,
        process_sets,
        rank,
        reduce_scatter,
        remove_process_set,
        shutdown,
        size,
    )
    from ringserve.config import CoordinatorConfig, WorkerConfig
    from ringserve.coordinator import Coordinator
    from ringserve.diloco import DiLoCo
    from ringserve.launch.shards import ParameterServer
    from ringserve.powersgd import PowerSGD
    from ringserve.worker.ops.process_sets import ProcessSet
    from ringserve.worker.runtime import Worker

__version__ = "0.1.0"

__all__ = [
    "CollectiveTimeoutError",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorUnreachableError",
    "DiLoCo",
    "ExcludedError",
    "InvalidArgumentError",
    "MismatchError",
    "NotInitializedError",
    "ParameterServer",
    "PayloadLaneError",
    "PeerUnavailableError",
    "PowerSGD",
    "ProcessSet",
    "ProtocolError",
    "RecoverableError",
    "RendezvousTimeoutError",
    "RingChangedError",
    "RingserveError",
    "ShardUnavailableError",
    "StateLostError",
    "TLSHandshakeError",
    "UnsupportedError",
    "UsageError",
    "ViewInstallError",
    "Worker",
    "WorkerConfig",
    "WorkerFailedError",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "grouped_allgather",
    "grouped_reduce_scatter",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "process_sets",
    "rank",
    "reduce_scatter",
    "remove_process_set",
    "shutdown",
    "size",
]

__getattr__, __dir__ = exports(__name__, {
    "add_process_set": "ringserve.api",
    "allgather": "ringserve.api",
    "allgather_object": "ringserve.api",
    "allreduce": "ringserve.api",
    "alltoall": "ringserve.api",
    "barrier": "ringserve.api",
    "broadcast": "ringserve.api",
    "broadcast_object": "ringserve.api",
    "cross_rank": "ringserve.api",
    "cross_size": "ringserve.api",
    "global_process_set": "ringserve.api",
    "grouped_allgather": "ringserve.api",
    "grouped_reduce_scatter": "ringserve.api",
    "init": "ringserve.api",
    "is_initialized": "ringserve.api",
    "join": "ringserve.api",
    "local_rank": "ringserve.api",
    "local_size": "ringserve.api",
    "process_sets": "ringserve.api",
    "rank": "ringserve.api",
    "reduce_scatter": "ringserve.api",
    "remove_process_set": "ringserve.api",
    "shutdown": "ringserve.api",
    "size": "ringserve.api",
    "CoordinatorConfig": "ringserve.config",
    "WorkerConfig": "ringserve.config",
    "Coordinator": "ringserve.coordinator",
    "DiLoCo": "ringserve.diloco",
    "ParameterServer": "ringserve.launch.shards",
    "PowerSGD": "ringserve.powersgd",
    "ProcessSet": "ringserve.worker.ops.process_sets",
    "Worker": "ringserve.worker.runtime",
}, submodules=("api", "config", "coordinator", "diloco", "elastic", "errors", "launch", "ps", "worker"))
