"""ringserve: collective communication over gRPC.

Synchronous numpy API for training scripts::

    import ringserve as rs
    rs.init()                                   # RINGSERVE_COORDINATOR or init(coordinator=...)
    out = rs.allreduce(a, op="average", name="grad.w")
    evens = rs.add_process_set(range(0, rs.size(), 2))   # on every rank, alike
    if rs.rank() % 2 == 0:
        out = rs.allreduce(a, process_set=evens)       # over the even ranks only
    rs.shutdown()

Asyncio API: ``async with ringserve.Worker(coordinator=...) as w: await w.allreduce(a)``.
Parameter-server mode: ``ringserve.ParameterServer`` and ``ringserve.ps`` (clients, optimizers).
``import ringserve`` never imports torch.
"""

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
from ringserve.powersgd import PowerSGD
from ringserve.ps.server import ParameterServer
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
