"""ringserve.torch: a Horovod-compatible PyTorch binding.

A script written for ``horovod.torch`` runs after changing only its import:

```python
import ringserve.torch as hvd

hvd.init()
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
```

Elastic training is ``hvd.elastic`` (``run``, ``TorchState``, ``ObjectState``, ``ElasticSampler``),
with no import besides this one. This import also registers torch.distributed's "ringserve" backend
(``ringserve.torch.distributed``), so ``dist.init_process_group("ringserve")`` works after it.

Errors: every error raised here is a ``RuntimeError`` (see ringserve.errors), as Horovod's are.
``hvd.HorovodInternalError`` is ringserve's ``RecoverableError`` (what Horovod's elastic mode
restores and retries after) and ``hvd.HostsUpdatedInterrupt`` ringserve's own. A mismatch of
shapes, dtypes or roots between the ranks is a ``MismatchError``: a RuntimeError, but not a
HorovodInternalError, since retrying it would fail again. Argument errors (an unknown op, a
second collective of a name still in flight) are ``InvalidArgumentError``, a ValueError.

The functions run over ringserve's one default context (``ringserve.api``). Process sets are
Horovod's: ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set(ranks)``, then
``process_set=`` on any collective and on DistributedOptimizer (see ringserve.worker.ops.process_sets).
"""

from __future__ import annotations

from ringserve.bindings import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    ringserve_built,
    rocm_built,
)
from ringserve.errors import HostsUpdatedInterrupt
from ringserve.errors import RecoverableError as HorovodInternalError

# Last: hvd.elastic builds on the functions above (``import ringserve.torch as hvd`` then
# ``hvd.elastic.run`` works, as in Horovod).
# torch.distributed's "ringserve" backend, registered by this import (init_process_group("ringserve")).
# The parameter server's binding: ringserve.torch.ps.ParameterServerOptimizer (see ringserve.ps).
from ringserve.torch import distributed, elastic, ps
from ringserve.torch.basics import (
    ProcessSet,
    add_process_set,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from ringserve.torch.collectives import (
    Handle,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from ringserve.torch.compression import Compression, Compressor
from ringserve.torch.diloco import DiLoCo
from ringserve.torch.exchange import alltoall, alltoall_async
from ringserve.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ringserve.torch.grouped import (
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
)
from ringserve.torch.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ringserve.torch.optimizer import DistributedOptimizer
from ringserve.torch.sparse import sparse_allreduce_async
from ringserve.torch.sync_batch_norm import SyncBatchNorm
from ringserve.torch.timeline import start_timeline, stop_timeline

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Compressor",
    "DiLoCo",
    "DistributedOptimizer",
    "Handle",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "distributed",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "ps",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "ringserve_built",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
